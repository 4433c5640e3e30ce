"""Block boundaries on the CPU: uniform blocks, balanced (Ok-Topk) regions, block offsets.

All boundaries are int64 and computed in integer arithmetic, so they are exact for any n that
fits in int64 (n = 2**33 needs no dense array).
"""

import numpy as np
from numba import njit

from .. import _validate
from ._common import JIT, as_indices

# ---------------------------------------------------------------------------------------------
# compiled workers
# ---------------------------------------------------------------------------------------------


@njit(**JIT)
def _uniform_bounds(n, P):
    # bounds[p] = p * (n // P) + min(p, n % P): the first n % P blocks are one longer
    q = n // P
    r = n % P
    out = np.empty(P + 1, np.int64)
    for p in range(P + 1):
        out[p] = p * q + min(p, r)
    return out


@njit(**JIT)
def _nondecreasing(idx):
    ok = True
    for i in range(1, idx.shape[0]):
        ok &= idx[i - 1] <= idx[i]
    return ok


@njit(**JIT)
def _in_range(idx, n):
    ok = True
    for i in range(idx.shape[0]):
        j = np.int64(idx[i])
        ok &= (j >= 0) & (j < n)
    return ok


@njit(**JIT)
def _balanced_bounds(sorted_idx, n, P):
    # bounds = [0, s[(1 * m) // P], s[(2 * m) // P], ..., s[((P - 1) * m) // P], n]
    m = sorted_idx.shape[0]
    out = np.empty(P + 1, np.int64)
    out[0] = 0
    for p in range(1, P):
        # p * m can exceed int64 only for absurd m and P; split it to stay exact:
        # (p * m) // P == p * (m // P) + (p * (m % P)) // P
        out[p] = sorted_idx[p * (m // P) + (p * (m % P)) // P]
    out[P] = n
    return out


@njit(**JIT)
def _strictly_increasing_nonneg(idx):
    ok = idx.shape[0] == 0 or idx[0] >= 0
    for i in range(1, idx.shape[0]):
        ok &= idx[i - 1] < idx[i]
    return ok


@njit(**JIT)
def _block_offsets(idx, bounds):
    # offsets[b] = searchsorted(idx, bounds[b], side="left"); one binary search per bound
    m = idx.shape[0]
    out = np.empty(bounds.shape[0], np.int64)
    for b in range(bounds.shape[0]):
        v = np.int64(bounds[b])
        lo = 0
        hi = m
        while lo < hi:
            mid = (lo + hi) >> 1
            if np.int64(idx[mid]) < v:
                lo = mid + 1
            else:
                hi = mid
        out[b] = lo
    return out


# ---------------------------------------------------------------------------------------------
# public functions
# ---------------------------------------------------------------------------------------------


def uniform_bounds(n, P):
    """Boundaries of P near-equal contiguous blocks of [0, n).

    Parameters
    ----------
    n : int
        Vector length, n >= 0.
    P : int
        Number of blocks (ranks, or team size m), 1 <= P <= 2**31 - 1.

    Returns
    -------
    bounds : int64 ndarray of shape (P + 1,)
        ``bounds[0] = 0``, ``bounds[P] = n``; block p is ``[bounds[p], bounds[p + 1])``. The first
        ``n mod P`` blocks have ``n // P + 1`` elements, the others ``n // P``, so no block is
        empty while n >= P.

    Raises
    ------
    ValueError
        n < 0; P outside [1, 2**31 - 1].
    TypeError
        n or P not an integer.

    Notes
    -----
    docs/design.md §3 and §4 (SparDL blocks: C = ceil(n / m) is the longest block).
    """
    n = _validate.check_n(n)
    P = _validate.check_P(P)
    return _uniform_bounds(n, P)


def balanced_bounds(indices, n, P):
    """Boundaries of P regions holding near-equal numbers of the given indices (Ok-Topk).

    Parameters
    ----------
    indices : ndarray of shape (m,), int32 or int64
        Positions in [0, n), e.g. a rank's (or the averaged) selected top-k indices. Any order and
        duplicates are allowed; unsorted input is sorted first (a copy).
    n : int
        Vector length, n >= 0.
    P : int
        Number of regions, 1 <= P <= 2**31 - 1.

    Returns
    -------
    bounds : int64 ndarray of shape (P + 1,)
        ``[0, s[(1 m) // P], ..., s[((P - 1) m) // P], n]`` with s the sorted indices: the
        P-quantiles of s, so region p holds about m / P of them. Nondecreasing; regions may be
        empty. For m = 0 there are no quantiles and ``uniform_bounds(n, P)`` is returned.

    Raises
    ------
    ValueError
        Bad shapes; an index outside [0, n); n < 0; P outside [1, 2**31 - 1].
    TypeError
        indices not int32/int64; n or P not an integer.

    Notes
    -----
    Ok-Topk (Li & Hoefler, arXiv 2201.07598, balanced split-and-reduce): the
    reduction regions are chosen so that each owner receives a similar number of nonzeros,
    instead of equal index ranges. docs/design.md §3 kernel contract.
    """
    indices = as_indices("indices", indices)
    n = _validate.check_n(n)
    P = _validate.check_P(P)
    _validate.require(_in_range(indices, n), "indices", f"every index must lie in [0, n = {n})")
    if indices.shape[0] == 0:
        return _uniform_bounds(n, P)
    if not _nondecreasing(indices):
        indices = np.sort(indices)
    return _balanced_bounds(indices, n, P)


def block_offsets(indices, bounds):
    """Where each block starts within sorted indices: ``searchsorted(indices, bounds, 'left')``.

    Parameters
    ----------
    indices : ndarray of shape (m,), int32 or int64
        Non-negative, strictly increasing (sorted unique).
    bounds : ndarray of shape (B,), int32 or int64
        Nondecreasing block boundaries, e.g. from :func:`uniform_bounds` or
        :func:`balanced_bounds`.

    Returns
    -------
    offsets : int64 ndarray of shape (B,)
        ``offsets[b]`` = number of indices < ``bounds[b]``; the entries of block b are
        ``indices[offsets[b]:offsets[b + 1]]``.

    Raises
    ------
    ValueError
        An argument not 1-D; indices unsorted, duplicated or negative; bounds decreasing; an
        index in no block (outside ``[bounds[0], bounds[-1])``, or any index when bounds is
        empty).
    TypeError
        indices or bounds not int32/int64.

    Notes
    -----
    docs/design.md §3 kernel contract. One binary search per bound, O(B log m), after an O(m)
    validation pass over indices.
    """
    indices = as_indices("indices", indices)
    bounds = as_indices("bounds", bounds)
    _validate.require(
        _strictly_increasing_nonneg(indices),
        "indices",
        "must be non-negative, sorted and unique",
    )
    _validate.require(_nondecreasing(bounds), "bounds", "must be nondecreasing")
    # Sorted, so the ends decide: an index outside [bounds[0], bounds[-1]) is in no block.
    _validate.check_indices_in_blocks(
        indices.shape[0], bounds.shape[0], lambda: (indices[0], indices[-1], bounds[0], bounds[-1])
    )
    return _block_offsets(indices, bounds)
