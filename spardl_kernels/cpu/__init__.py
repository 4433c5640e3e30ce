"""Numba ``@njit`` CPU kernels of the kernel contract (docs/design.md §3).

Same fourteen names as ``spardl_kernels.cuda``; ``spardl_kernels`` dispatches between them.
"""

from .accumulate import accumulate_above, accumulate_topk
from .bounds import balanced_bounds, block_offsets, uniform_bounds
from .select import count_above, estimate_threshold, kth_largest_abs, select_above, topk_abs
from .sparse import coalesce, gather, merge_add, scatter_add

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
