"""Route each public kernel call to the CPU kernels or to their CUDA twins.

A call goes to ``spardl_kernels.cuda`` when any array argument lives on the GPU, otherwise to
``spardl_kernels.cpu``. ``numba.cuda`` is imported only when an argument looks like a GPU
array (:mod:`spardl_kernels.devices`), so CPU-only use never pays for (or depends on) the CUDA
toolchain.
"""

import functools

from . import cpu
from .devices import cuda_backend, is_device_array

KERNEL_NAMES = (
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
)


def backend_for(*arrays):
    """The kernel module for these arguments: ``spardl_kernels.cuda`` if any is a GPU array."""
    for a in arrays:
        if is_device_array(a):
            return cuda_backend()
    return cpu


def public(name, array_params):
    """The public function ``name``: the CPU kernel's signature and docstring, dispatching on the
    positional/keyword arguments named in ``array_params``."""
    impl = getattr(cpu, name)

    @functools.wraps(impl)
    def kernel(*args, **kwargs):
        arrays = [args[i] for i in range(min(len(array_params), len(args)))]
        arrays += [kwargs[p] for p in array_params[len(args) :] if p in kwargs]
        return getattr(backend_for(*arrays), name)(*args, **kwargs)

    kernel.__module__ = "spardl_kernels"
    return kernel
