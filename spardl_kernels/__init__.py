"""spardl_kernels: the compute kernels of sparse gradient communication (docs/design.md §3).

Fourteen functions on 1-D arrays: selection by magnitude (``topk_abs``, ``kth_largest_abs``,
``select_above``, ``count_above``, ``estimate_threshold``), sparse-vector arithmetic
(``merge_add``, ``coalesce``, ``scatter_add``, ``gather``), block boundaries
(``uniform_bounds``, ``balanced_bounds``, ``block_offsets``), and the first pass of an
error-feedback step: X = g + E fused with the top-k of blocks of X (``accumulate_topk``) or
with a threshold selection of X (``accumulate_above``). CPU
arrays (NumPy, or anything NumPy views without copying) run the Numba kernels of
:mod:`spardl_kernels.cpu`; GPU arrays (``__cuda_array_interface__``) run their twins in
:mod:`spardl_kernels.cuda` (:mod:`spardl_kernels.devices` says which arrays those are).
Tunables live in :mod:`spardl_kernels.config`.
"""

from ._dispatch import public as _public

# Each name dispatches on the arguments listed (the ones that may be GPU arrays).
topk_abs = _public("topk_abs", ("x",))
kth_largest_abs = _public("kth_largest_abs", ("x",))
select_above = _public("select_above", ("x",))
count_above = _public("count_above", ("x",))
estimate_threshold = _public("estimate_threshold", ("x",))
merge_add = _public("merge_add", ("ia", "va", "ib", "vb"))
coalesce = _public("coalesce", ("indices", "values"))
uniform_bounds = _public("uniform_bounds", ())
balanced_bounds = _public("balanced_bounds", ("indices",))
block_offsets = _public("block_offsets", ("indices", "bounds"))
scatter_add = _public("scatter_add", ("dense", "indices", "values"))
gather = _public("gather", ("dense", "indices"))
accumulate_topk = _public("accumulate_topk", ("g", "e", "ks", "bounds", "out"))
accumulate_above = _public("accumulate_above", ("g", "e", "out"))

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
