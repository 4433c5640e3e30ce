"""Sparse-vector kernels on the CPU: merge, coalesce, scatter-add and gather.

Sums are done in a fixed order and in the value dtype (DESIGN.md §3): a before b in
``merge_add``, earlier position first in ``coalesce`` and ``scatter_add``. Numba's CPU target has
no float16 arithmetic, so float16 values are widened to float32 in NumPy, summed in float32 by
the same compiled loops, and rounded to float16 once at the end. Copies of values (gather, the
unmatched entries of a merge) move bit patterns, so -0.0 and NaN payloads survive.
"""

import numpy as np
from numba import njit

from .. import _validate
from ._common import JIT, as_indices, as_values

# ---------------------------------------------------------------------------------------------
# compiled workers
# ---------------------------------------------------------------------------------------------


@njit(**JIT)
def _first_not_sorted_unique(idx):
    """-1 if idx is >= 0 and strictly increasing, else the first offending position."""
    n = idx.shape[0]
    if n > 0 and idx[0] < 0:
        return 0
    bad = False
    # all(idx[i - 1] < idx[i]): a branch-free reduction, then locate the culprit if needed
    for i in range(1, n):
        bad |= idx[i - 1] >= idx[i]
    if not bad:
        return -1
    for i in range(1, n):
        if idx[i - 1] >= idx[i]:
            return i
    return -1


@njit(**JIT)
def _merge_add(ia, va, ib, vb, out_i, out_v):
    """Merge two ascending index lists, summing a + b where they meet.

    Returns (count, ok) where ok is False if the output is not strictly increasing from a
    non-negative start, which happens exactly when an input is not sorted unique and >= 0.
    """
    na = ia.shape[0]
    nb = ib.shape[0]
    a = 0
    b = 0
    o = 0
    last = np.int64(-1)
    bad = False
    # The loop body is branch-free on purpose: which list advances is data dependent and
    # unpredictable, so selects beat branches.
    while a < na and b < nb:
        x = np.int64(ia[a])
        y = np.int64(ib[b])
        take_a = x <= y
        take_b = y <= x
        m = min(x, y)
        u = va[a]
        w = vb[b]
        # v = va[a] + vb[b] if both, else the one taken (copied, not added to 0: keeps -0.0)
        v = u + w if (take_a and take_b) else (u if take_a else w)
        out_i[o] = m
        out_v[o] = v
        bad |= m <= last
        last = m
        a += take_a
        b += take_b
        o += 1
    while a < na:
        m = np.int64(ia[a])
        out_i[o] = m
        out_v[o] = va[a]
        bad |= m <= last
        last = m
        a += 1
        o += 1
    while b < nb:
        m = np.int64(ib[b])
        out_i[o] = m
        out_v[o] = vb[b]
        bad |= m <= last
        last = m
        b += 1
        o += 1
    return o, not bad


@njit(**JIT)
def _min_index(idx):
    m = np.int64(0)
    for i in range(idx.shape[0]):
        m = min(m, np.int64(idx[i]))
    return m


@njit(**JIT)
def _coalesce(indices, values):
    """Stable sort by index, then sum each run in original-position order."""
    n = indices.shape[0]
    # A stable sort is skipped when the input is already nondecreasing (the common case).
    sorted_ = True
    for i in range(1, n):
        sorted_ &= indices[i - 1] <= indices[i]
    if sorted_:
        order = np.arange(n)
    else:
        order = np.argsort(indices, kind="mergesort")
    out_i = np.empty(n, indices.dtype)
    out_v = np.empty(n, values.dtype)
    o = -1
    prev = np.int64(-1)
    for p in range(n):
        j = order[p]
        i = np.int64(indices[j])
        if o >= 0 and i == prev:
            # out_v[o] = sum(values[j] for j in run, in original order), left to right
            out_v[o] += values[j]
        else:
            o += 1
            out_i[o] = i
            out_v[o] = values[j]
            prev = i
    return out_i[: o + 1].copy(), out_v[: o + 1].copy()


@njit(**JIT)
def _index_range_ok(indices, n):
    ok = True
    for i in range(indices.shape[0]):
        j = np.int64(indices[i])
        ok &= (j >= 0) & (j < n)
    return ok


@njit(**JIT)
def _scatter_add(dense, indices, values):
    # dense[indices[j]] += values[j] for j = 0, 1, ... in order (duplicates accumulate)
    for j in range(indices.shape[0]):
        dense[indices[j]] += values[j]


@njit(**JIT)
def _gather(dense, indices, out):
    n = dense.shape[0]
    ok = True
    for j in range(indices.shape[0]):
        i = np.int64(indices[j])
        ok &= (i >= 0) & (i < n)
        # clamp so that a bad index never reads out of bounds; the result is discarded then
        out[j] = dense[min(max(i, 0), n - 1)]
    return ok


# ---------------------------------------------------------------------------------------------
# public functions
# ---------------------------------------------------------------------------------------------


def _as_sum_dtype(v):
    """float16 values are summed in float32 (DESIGN.md §3)."""
    return v.astype(np.float32) if v.dtype == np.float16 else v


def merge_add(ia, va, ib, vb):
    """Union of two sorted unique sparse vectors, values summed where indices meet.

    Parameters
    ----------
    ia : ndarray of shape (na,), int32 or int64
        Strictly increasing, non-negative.
    va : ndarray of shape (na,), float16, float32 or float64
    ib : ndarray of shape (nb,), int32 or int64
        Strictly increasing, non-negative.
    vb : ndarray of shape (nb,), same dtype as va

    Returns
    -------
    indices : ndarray of shape (m,), int64 (int32 if both ia and ib are int32)
        The sorted union, max(na, nb) <= m <= na + nb.
    values : ndarray of shape (m,), va.dtype
        ``va + vb`` (in that order) where the indices meet, else the entry's own value, bit for
        bit. float16 sums are computed in float32 and rounded once.

    Raises
    ------
    ValueError
        An argument not 1-D; len(va) != len(ia) or len(vb) != len(ib); ia or ib unsorted,
        duplicated or negative.
    TypeError
        Index arrays not int32/int64, value arrays not float16/32/64, or va, vb dtypes differ.

    Notes
    -----
    DESIGN.md §3 kernel contract. One branch-free merge pass; the sorted-unique check is fused
    into it (the output is strictly increasing iff both inputs are), so valid input is read once.
    """
    ia = as_indices("ia", ia)
    va = as_values("va", va)
    ib = as_indices("ib", ib)
    vb = as_values("vb", vb)
    _validate.check_same_length("va", va.shape[0], "ia", ia.shape[0])
    _validate.check_same_length("vb", vb.shape[0], "ib", ib.shape[0])
    _validate.check_same_dtype("vb", vb.dtype, "va", va.dtype)
    idt = np.result_type(ia.dtype, ib.dtype)
    na, nb = ia.shape[0], ib.shape[0]
    out_i = np.empty(na + nb, idt)
    if va.dtype == np.float16:
        out_v = np.empty(na + nb, np.float32)
        count, ok = _merge_add(ia, _as_sum_dtype(va), ib, _as_sum_dtype(vb), out_i, out_v)
    else:
        out_v = np.empty(na + nb, va.dtype)
        count, ok = _merge_add(ia, va, ib, vb, out_i, out_v)
    if not ok:
        for name, idx in (("ia", ia), ("ib", ib)):
            pos = _first_not_sorted_unique(idx)
            _validate.require(
                pos < 0,
                name,
                f"indices must be non-negative, sorted and unique (violated at position {pos})",
            )
    # views, not copies: trimming would cost another pass over the output
    out_i = out_i[:count]
    out_v = out_v[:count]
    if va.dtype == np.float16:
        if count > 0:
            # Unmatched entries came through float32 unchanged, so the cast back is exact for
            # them (NaN payloads aside) and rounds the sums once.
            out_v = out_v.astype(np.float16)
        else:
            out_v = np.empty(0, np.float16)
    return out_i, out_v


def coalesce(indices, values):
    """Sort by index and sum duplicates: a sorted unique sparse vector.

    Parameters
    ----------
    indices : ndarray of shape (m,), int32 or int64
        Non-negative, any order, duplicates allowed.
    values : ndarray of shape (m,), float16, float32 or float64

    Returns
    -------
    indices : ndarray of shape (u,), indices.dtype
        The distinct indices, ascending.
    values : ndarray of shape (u,), values.dtype
        For each distinct index, its values summed sequentially in order of original position
        (float16 in float32, rounded once); a single occurrence is copied bit for bit.

    Raises
    ------
    ValueError
        An argument not 1-D; lengths differ; a negative index.
    TypeError
        indices not int32/int64; values not float16/32/64.

    Notes
    -----
    DESIGN.md §3 kernel contract: coalescing float32 [1e8, 1, -1e8] at one index gives exactly
    0.0, because (1e8 + 1) rounds to 1e8 in float32. A stable merge sort keeps equal indices in
    position order; it is skipped when the input is already nondecreasing.
    """
    indices = as_indices("indices", indices)
    values = as_values("values", values)
    _validate.check_same_length("values", values.shape[0], "indices", indices.shape[0])
    _validate.require(_min_index(indices) >= 0, "indices", "must be non-negative")
    out_i, out_v = _coalesce(indices, _as_sum_dtype(values))
    if values.dtype == np.float16:
        out_v = out_v.astype(np.float16)
    return out_i, out_v


def scatter_add(dense, indices, values):
    """In place ``dense[indices] += values``, duplicates accumulating in position order.

    Parameters
    ----------
    dense : ndarray of shape (n,), float16, float32 or float64, writeable
    indices : ndarray of shape (m,), int32 or int64, each in [0, n)
    values : ndarray of shape (m,), dense.dtype

    Returns
    -------
    dense : the object passed in, updated in place
        (For a CPU torch tensor, the tensor itself: the kernel writes through a NumPy view.)

    Raises
    ------
    ValueError
        An argument not 1-D; lengths differ; an index outside [0, n); dense read-only.
        Nothing is written when an error is raised.
    TypeError
        Bad dtypes, or values' dtype differs from dense's.

    Notes
    -----
    DESIGN.md §3 kernel contract: for each touched i, ``dense[i] = ((dense[i] + v_1) + v_2) ...``
    with v_1, v_2, ... the values aimed at i in position order, in the value dtype. For float16
    the whole chain for one i runs in float32 and is rounded to float16 once.
    """
    target = dense
    dense = as_values("dense", dense)
    indices = as_indices("indices", indices)
    values = as_values("values", values)
    _validate.check_same_length("values", values.shape[0], "indices", indices.shape[0])
    _validate.check_same_dtype("values", values.dtype, "dense", dense.dtype)
    _validate.check_writeable("dense", dense.flags.writeable)
    n = dense.shape[0]
    _validate.require(
        _index_range_ok(indices, n), "indices", f"every index must lie in [0, n = {n})"
    )
    if indices.shape[0] == 0:
        return target
    if dense.dtype == np.float16:
        # accumulate per destination in float32, round once
        touched, where = np.unique(indices, return_inverse=True)
        acc = dense[touched].astype(np.float32)
        _scatter_add(acc, where.reshape(-1), values.astype(np.float32))
        dense[touched] = acc.astype(np.float16)
    else:
        _scatter_add(dense, indices, values)
    return target


def gather(dense, indices):
    """``dense[indices]``, bit for bit.

    Parameters
    ----------
    dense : ndarray of shape (n,), float16, float32 or float64
    indices : ndarray of shape (m,), int32 or int64, each in [0, n)

    Returns
    -------
    values : ndarray of shape (m,), dense.dtype

    Raises
    ------
    ValueError
        An argument not 1-D; an index outside [0, n).
    TypeError
        Bad dtypes.

    Notes
    -----
    DESIGN.md §3 kernel contract. Values are moved as bit patterns (float16 too).
    """
    dense = as_values("dense", dense)
    indices = as_indices("indices", indices)
    n = dense.shape[0]
    view = dense.view(_BITS[dense.dtype.name])
    out = np.empty(indices.shape[0], view.dtype)
    ok = True
    if indices.shape[0] > 0:
        _validate.require(n > 0, "indices", "every index must lie in [0, n = 0)")
        ok = _gather(view, indices, out)
    _validate.require(ok, "indices", f"every index must lie in [0, n = {n})")
    return out.view(dense.dtype)


_BITS = {"float16": np.int16, "float32": np.int32, "float64": np.int64}
