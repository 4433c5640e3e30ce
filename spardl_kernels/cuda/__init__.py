"""numba-cuda twins of the CPU kernels (docs/design.md §3): the same fourteen names and signatures,
the same results bit for bit.

Inputs are device arrays: anything exposing ``__cuda_array_interface__`` (torch CUDA tensors,
CuPy, Numba device arrays), used in place without a host copy, and the CUDA simulator's arrays
(``NUMBA_ENABLE_CUDASIM=1``). Array outputs are Numba device arrays (wrap them zero-copy with
``torch.as_tensor(out, device="cuda")`` or ``cupy.asarray(out)``); scalars come back to the host.
Launch parameters are read from :mod:`spardl_kernels.config` (``CUDA_*``) at call time.

Importing this package without a usable CUDA target (no driver or GPU, and the simulator not
enabled) raises ImportError; ``spardl_kernels`` reports it as one RuntimeError when a GPU array
is passed.
"""

from numba import cuda as _cuda

if not _cuda.is_available():
    raise ImportError(
        "spardl_kernels.cuda: no CUDA device or driver was found (numba.cuda.is_available() is "
        "False); set NUMBA_ENABLE_CUDASIM=1 before importing numba to use the CUDA simulator"
    )

from .accumulate import accumulate_above, accumulate_topk  # noqa: E402
from .bounds import balanced_bounds, block_offsets, uniform_bounds  # noqa: E402
from .select import (  # noqa: E402
    count_above,
    estimate_threshold,
    kth_largest_abs,
    select_above,
    topk_abs,
)
from .sparse import coalesce, gather, merge_add, scatter_add  # noqa: E402

__all__ = [
    "topk_abs",
    "kth_largest_abs",
    "select_above",
    "count_above",
    "estimate_threshold",
    "merge_add",
    "coalesce",
    "uniform_bounds",
    "balanced_bounds",
    "block_offsets",
    "scatter_add",
    "gather",
    "accumulate_topk",
    "accumulate_above",
]
