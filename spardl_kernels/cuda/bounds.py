"""Block boundaries on the GPU: uniform blocks, balanced (Ok-Topk) regions, block offsets.

CUDA twins of :mod:`spardl_kernels.cpu.bounds`; all boundaries are int64 and exact.
"""

import numpy as np
from numba import cuda, int64

from .. import _validate
from ..cpu import bounds as _cpu_bounds
from . import _common as C
from ._sort import sort_with_positions


@cuda.jit
def _quantiles(s, n, P, out):
    # out = [0, s[(1 * m) // P], ..., s[((P - 1) * m) // P], n], with
    # (p * m) // P == p * (m // P) + (p * (m % P)) // P to stay exact in int64
    m = s.shape[0]
    for p in range(cuda.grid(1), P + 1, cuda.gridsize(1)):
        if p == 0:
            out[p] = 0
        elif p == P:
            out[p] = n
        else:
            out[p] = s[p * (m // P) + (p * (m % P)) // P]


@cuda.jit
def _searchsorted_left(idx, bounds, out):
    # out[b] = #{j : idx[j] < bounds[b]}: one binary search per bound
    m = idx.shape[0]
    for b in range(cuda.grid(1), bounds.shape[0], cuda.gridsize(1)):
        v = int64(bounds[b])
        lo = 0
        hi = m
        while lo < hi:
            mid = (lo + hi) >> 1
            if int64(idx[mid]) < v:
                lo = mid + 1
            else:
                hi = mid
        out[b] = lo


def uniform_bounds(n, P):
    """Boundaries of P near-equal contiguous blocks of [0, n), as a device array.

    Parameters
    ----------
    n : int
        Vector length, n >= 0.
    P : int
        Number of blocks (ranks, or team size m), P >= 1.

    Returns
    -------
    bounds : int64 Numba device array of shape (P + 1,)
        ``bounds[p] = p * (n // P) + min(p, n mod P)``: the first n mod P blocks are one longer.

    Raises
    ------
    ValueError
        n < 0; P < 1.
    TypeError
        n or P not an integer.

    Notes
    -----
    docs/design.md §3 and §4. The P + 1 numbers are computed on the host by the CPU kernel (there
    is no data to move) and copied to the device, where :func:`block_offsets` uses them.
    ``spardl_kernels.uniform_bounds`` has no array argument and always returns the host array.
    """
    return cuda.to_device(_cpu_bounds.uniform_bounds(n, P))


def balanced_bounds(indices, n, P):
    """Boundaries of P regions holding near-equal numbers of the given indices (Ok-Topk).

    Parameters
    ----------
    indices : device array of shape (m,), int32 or int64
        Positions in [0, n), any order, duplicates allowed (unsorted input is sorted, a copy).
    n : int
        Vector length, n >= 0.
    P : int
        Number of regions, P >= 1.

    Returns
    -------
    bounds : int64 Numba device array of shape (P + 1,)
        ``[0, s[(1 m) // P], ..., s[((P - 1) m) // P], n]`` with s the sorted indices;
        ``uniform_bounds(n, P)`` for m = 0.

    Raises
    ------
    ValueError
        Bad shapes; an index outside [0, n); n < 0; P < 1.
    TypeError
        indices not int32/int64; n or P not an integer.

    Notes
    -----
    Ok-Topk (Li & Hoefler, arXiv 2201.07598, balanced split-and-reduce); docs/design.md §3.
    Sorting uses the stable radix sort of :mod:`spardl_kernels.cuda._sort`.
    """
    indices = C.as_indices("indices", indices)
    n = _validate.check_n(n)
    P = _validate.check_P(P)
    C.check_range(indices, n)
    if indices.shape[0] == 0:
        return uniform_bounds(n, P)
    s, _ = sort_with_positions(indices, max(n - 1, 0))
    out = C.empty(P + 1, np.int64)
    C.launch(_quantiles, P + 1)(s, n, P, out)
    return out


def block_offsets(indices, bounds):
    """Where each block starts within sorted indices, on the GPU:
    ``searchsorted(indices, bounds, 'left')``.

    Parameters
    ----------
    indices : device array of shape (m,), int32 or int64
        Non-negative, strictly increasing (sorted unique).
    bounds : device (or host) array of shape (B,), int32 or int64
        Nondecreasing block boundaries. A host array is copied to the device.

    Returns
    -------
    offsets : int64 Numba device array of shape (B,)
        ``offsets[b]`` = number of indices < ``bounds[b]``.

    Raises
    ------
    ValueError
        An argument not 1-D; indices unsorted, duplicated or negative; bounds decreasing; an
        index in no block (as the CPU function).
    TypeError
        indices or bounds not int32/int64.

    Notes
    -----
    docs/design.md §3 kernel contract. One thread and one binary search per bound; the checks
    copy a few numbers back.
    """
    indices = C.as_indices("indices", indices)
    bounds = C.as_indices("bounds", bounds)
    _validate.require(
        C.first_violation(indices, strict=True) < 0,
        "indices",
        "must be non-negative, sorted and unique",
    )
    _validate.require(
        C.first_violation(bounds, strict=False) < 0, "bounds", "must be nondecreasing"
    )
    B = bounds.shape[0]
    _validate.check_indices_in_blocks(
        indices.shape[0],
        B,
        lambda: (*C.ends(indices), *C.ends(bounds)),
    )
    out = C.empty(B, np.int64)
    if B:
        C.launch(_searchsorted_left, B)(indices, bounds, out)
    return out
