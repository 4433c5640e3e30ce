"""Sparse-vector kernels on the CPU: merge, coalesce, scatter-add and gather.

Sums are done in a fixed order and in the value dtype (docs/design.md §3): a before b in
``merge_add``, earlier position first in ``coalesce`` and ``scatter_add``. A sum that is NaN is
written as the canonical NaN (§3.4), whatever NaN the hardware made. Numba's CPU target has no
float16 arithmetic, so float16 values are widened to float32 exactly (bit manipulation, NaN
payloads kept), summed in float32 by the same compiled loops, and rounded to float16 once at the
end. Copies of values (gather, the unmatched entries of a merge, a lone occurrence in coalesce)
move bit patterns, so -0.0 and NaN payloads survive.
"""

import numpy as np
from numba import njit, prange

from .. import _contract, _validate, config
from ._common import (
    JIT,
    JIT_PARALLEL,
    as_indices,
    as_values,
    canonical,
    cpu_threads,
    in_place,
    narrow_half,
    numba_threads,
    scratch,
    widen_half,
)

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
def _merge_run(ia, va, ib, vb, a, a1, b, b1, out_i, out_v, o, last):
    """Merge ia[a:a1] and ib[b:b1] into out_i[o:], out_v[o:], summing a + b where they meet.

    Returns (o, last, bad): the end of the output, its last index, and whether the output was
    not strictly increasing from `last` on (which happens exactly when an input is not sorted
    unique, or is negative while last = -1). Positions are unsigned, so indexing needs no
    negative-index wraparound code.
    """
    one = np.uint64(1)
    a = np.uint64(a)
    a1 = np.uint64(a1)
    b = np.uint64(b)
    b1 = np.uint64(b1)
    o = np.uint64(o)
    bad = False
    # The loop body is branch-free on purpose: which list advances is data dependent and
    # unpredictable, so selects beat branches.
    while a < a1 and b < b1:
        x = np.int64(ia[a])
        y = np.int64(ib[b])
        take_a = x <= y
        take_b = y <= x
        m = min(x, y)
        u = va[a]
        w = vb[b]
        # v = va[a] + vb[b] if both (a NaN sum canonical), else the one taken (copied, not
        # added to 0: keeps -0.0 and NaN payloads)
        out_i[o] = m
        out_v[o] = canonical(u + w) if (take_a and take_b) else (u if take_a else w)
        bad |= m <= last
        last = m
        a += np.uint64(take_a)
        b += np.uint64(take_b)
        o += one
    while a < a1:
        m = np.int64(ia[a])
        out_i[o] = m
        out_v[o] = va[a]
        bad |= m <= last
        last = m
        a += one
        o += one
    while b < b1:
        m = np.int64(ib[b])
        out_i[o] = m
        out_v[o] = vb[b]
        bad |= m <= last
        last = m
        b += one
        o += one
    return np.int64(o), last, bad


@njit(**JIT)
def _merge_two_parts(ia, va, ib, vb, sa, sb, p, out_i, out_v, counts, bad):
    """Merge parts p and p + 1 (part q: ia[sa[q]:sa[q+1]] with ib[sb[q]:sb[q+1]], written from
    out[sa[q] + sb[q]]) in one interleaved loop, into counts[q] and bad[q].

    One merge step is a chain of dependent loads and compares (the next read position depends
    on the last compare); two independent merges in one loop let the CPU overlap their chains,
    about 1.6x the speed of one.
    """
    one = np.uint64(1)
    a = np.uint64(sa[p])
    a1 = np.uint64(sa[p + 1])
    b = np.uint64(sb[p])
    b1 = np.uint64(sb[p + 1])
    c = np.uint64(sa[p + 1])
    c1 = np.uint64(sa[p + 2])
    d = np.uint64(sb[p + 1])
    d1 = np.uint64(sb[p + 2])
    o = a + b
    q = c + d
    last1 = np.int64(-1)
    last2 = np.int64(-1)
    bad1 = False
    bad2 = False
    # the same step as _merge_run, on both parts at once. A step moves each cursor by at most
    # one, so `steps` steps stay in range: the inner loop tests a counter, not four bounds.
    while True:
        steps = min(min(a1 - a, b1 - b), min(c1 - c, d1 - d))
        if steps == 0:
            break
        for _ in range(steps):
            x1 = np.int64(ia[a])
            y1 = np.int64(ib[b])
            x2 = np.int64(ia[c])
            y2 = np.int64(ib[d])
            ta = x1 <= y1
            tb = y1 <= x1
            tc = x2 <= y2
            td = y2 <= x2
            m1 = min(x1, y1)
            m2 = min(x2, y2)
            u1 = va[a]
            w1 = vb[b]
            u2 = va[c]
            w2 = vb[d]
            out_i[o] = m1
            out_v[o] = canonical(u1 + w1) if (ta and tb) else (u1 if ta else w1)
            out_i[q] = m2
            out_v[q] = canonical(u2 + w2) if (tc and td) else (u2 if tc else w2)
            bad1 |= m1 <= last1
            bad2 |= m2 <= last2
            last1 = m1
            last2 = m2
            a += np.uint64(ta)
            b += np.uint64(tb)
            c += np.uint64(tc)
            d += np.uint64(td)
            o += one
            q += one
    end1, _, more1 = _merge_run(ia, va, ib, vb, a, a1, b, b1, out_i, out_v, o, last1)
    end2, _, more2 = _merge_run(ia, va, ib, vb, c, c1, d, d1, out_i, out_v, q, last2)
    counts[p] = end1 - (sa[p] + sb[p])
    counts[p + 1] = end2 - (sa[p + 1] + sb[p + 1])
    bad[p] = bad1 | more1
    bad[p + 1] = bad2 | more2


@njit(**JIT)
def _merge_splits(ia, ib, parts):
    """Split the merge of ia and ib into `parts` independent parts of near-equal output.

    Returns (sa, sb), int64 arrays of length parts + 1: part q merges ia[sa[q]:sa[q+1]] with
    ib[sb[q]:sb[q+1]]. Merge path (Odeh et al., "Merge Path", IPDPSW 2012): on diagonal
    D = sa + sb of the (a before b on ties) merge order, binary search for the number of entries of
    ia among the first D merged. A split between a matching pair (ia[a-1] == ib[b]) moves ib[b]
    into the earlier part, so each index lives in one part. On invalid (unsorted) input the
    splits are still monotone and in range; the merge then reports the error.
    """
    na = ia.shape[0]
    nb = ib.shape[0]
    total = na + nb
    sa = np.zeros(parts + 1, np.int64)
    sb = np.zeros(parts + 1, np.int64)
    for p in range(1, parts):
        diag = (total // parts) * p + min(p, total % parts)
        lo = max(0, diag - nb)
        hi = min(diag, na)
        # smallest a in [lo, hi] with not (ia[a] <= ib[diag - a - 1])
        while lo < hi:
            mid = (lo + hi) // 2
            if np.int64(ia[mid]) <= np.int64(ib[diag - mid - 1]):
                lo = mid + 1
            else:
                hi = mid
        a = lo
        b = diag - a
        if a > 0 and b < nb and np.int64(ia[a - 1]) == np.int64(ib[b]):
            b += 1
        sa[p] = max(a, sa[p - 1])
        sb[p] = max(b, sb[p - 1])
    sa[parts] = na
    sb[parts] = nb
    return sa, sb


@njit(**JIT)
def _merge_run_down(ia, va, ib, vb, a, b, out_i, out_v, o, top):
    """Merge ia[:a] and ib[:b] from their largest index down, writing out[o - 1], out[o - 2], ...

    The mirror of `_merge_run`: returns (o, top, bad), the lowest position written, the last
    (smallest) index written, and whether the output was not strictly decreasing from `top`.
    """
    one = np.uint64(1)
    a = np.uint64(a)
    b = np.uint64(b)
    o = np.uint64(o)
    bad = False
    while a > 0 and b > 0:
        x = np.int64(ia[a - one])
        y = np.int64(ib[b - one])
        take_a = x >= y
        take_b = y >= x
        m = max(x, y)
        u = va[a - one]
        w = vb[b - one]
        o -= one
        out_i[o] = m
        out_v[o] = canonical(u + w) if (take_a and take_b) else (u if take_a else w)
        bad |= m >= top
        top = m
        a -= np.uint64(take_a)
        b -= np.uint64(take_b)
    while a > 0:
        a -= one
        o -= one
        m = np.int64(ia[a])
        out_i[o] = m
        out_v[o] = va[a]
        bad |= m >= top
        top = m
    while b > 0:
        b -= one
        o -= one
        m = np.int64(ib[b])
        out_i[o] = m
        out_v[o] = vb[b]
        bad |= m >= top
        top = m
    return np.int64(o), top, bad


@njit(**JIT)
def _merge_add(ia, va, ib, vb, out_i, out_v):
    """Serial merge in two merge-path parts run interleaved in one loop, meeting at the split
    diagonal s: part 0 merged downwards from its largest index into out[:s], part 1 upwards
    into out[s:], so the union is contiguous, out[lo:hi], and nothing has to be moved over the
    gaps that matched pairs leave.

    Returns (lo, hi, ok); ok is False if the output is not strictly increasing from a
    non-negative start, which happens exactly when an input is not sorted unique and >= 0.
    """
    one = np.uint64(1)
    sa, sb = _merge_splits(ia, ib, 2)
    s = np.uint64(sa[1] + sb[1])
    # part 0 (ia[:a], ib[:b] left to merge) downwards from out[s - 1]
    a = np.uint64(sa[1])
    b = np.uint64(sb[1])
    o = s
    top = np.iinfo(np.int64).max
    # part 1 (ia[c:c1], ib[d:d1]) upwards from out[s]
    c = a
    c1 = np.uint64(ia.shape[0])
    d = b
    d1 = np.uint64(ib.shape[0])
    q = s
    last = np.int64(-1)
    bad = False
    # A step moves each cursor by at most one, so `steps` steps stay in range: the inner loop
    # tests a counter, not four bounds.
    while True:
        steps = min(min(a, b), min(c1 - c, d1 - d))
        if steps == 0:
            break
        for _ in range(steps):
            x1 = np.int64(ia[a - one])
            y1 = np.int64(ib[b - one])
            x2 = np.int64(ia[c])
            y2 = np.int64(ib[d])
            ta = x1 >= y1
            tb = y1 >= x1
            tc = x2 <= y2
            td = y2 <= x2
            m1 = max(x1, y1)
            m2 = min(x2, y2)
            u1 = va[a - one]
            w1 = vb[b - one]
            u2 = va[c]
            w2 = vb[d]
            o -= one
            out_i[o] = m1
            out_v[o] = canonical(u1 + w1) if (ta and tb) else (u1 if ta else w1)
            out_i[q] = m2
            out_v[q] = canonical(u2 + w2) if (tc and td) else (u2 if tc else w2)
            bad |= (m1 >= top) | (m2 <= last)
            top = m1
            last = m2
            a -= np.uint64(ta)
            b -= np.uint64(tb)
            c += np.uint64(tc)
            d += np.uint64(td)
            q += one
    lo, top, bad0 = _merge_run_down(ia, va, ib, vb, a, b, out_i, out_v, o, top)
    hi, _, bad1 = _merge_run(ia, va, ib, vb, c, c1, d, d1, out_i, out_v, q, last)
    s = np.int64(s)
    ok = not (bad or bad0 or bad1)
    if lo < s:
        # part 0's smallest index is non-negative and below part 1's smallest
        ok &= out_i[lo] >= 0
        if hi > s:
            ok &= out_i[s - 1] < out_i[s]
    return lo, hi, ok


@njit(**JIT_PARALLEL)
def _merge_pairs_parallel(ia, va, ib, vb, sa, sb, out_i, out_v, counts, bad):
    """Every pair of parts (2t, 2t + 1) on its own thread; parts write disjoint ranges."""
    for t in prange(counts.shape[0] // 2):
        _merge_two_parts(ia, va, ib, vb, sa, sb, 2 * t, out_i, out_v, counts, bad)


def _merge_add_parallel(ia, va, ib, vb, out_i, out_v, threads):
    """Merge on `threads` threads: 2 * threads merge-path parts, interleaved in pairs; each part
    writes at its diagonal (an upper bound of its output position), then parts are moved down
    over the gaps that matched pairs left. Returns (indices, values, ok), views of out_i, out_v."""
    parts = 2 * threads
    sa, sb = _merge_splits(ia, ib, parts)
    counts = np.zeros(parts, np.int64)
    bad = np.zeros(parts, np.bool_)
    with numba_threads(threads):
        _merge_pairs_parallel(ia, va, ib, vb, sa, sb, out_i, out_v, counts, bad)
    starts = sa + sb
    ok = not bad.any()
    # strictly increasing across part boundaries too
    ends = starts[:-1] + counts
    nonempty = np.flatnonzero(counts)
    if nonempty.shape[0] > 1:
        ok &= bool((out_i[ends[nonempty[:-1]] - 1] < out_i[starts[nonempty[1:]]]).all())
    total = int(counts.sum())
    # Move each part down to its final offset, in part order (a second parallel region costs a
    # thread wake-up, often more than these moves; NumPy copies overlapping ranges correctly).
    o = int(counts[0])
    for q in range(1, parts):
        c = int(counts[q])
        if o < starts[q]:
            out_i[o : o + c] = out_i[starts[q] : starts[q] + c]
            out_v[o : o + c] = out_v[starts[q] : starts[q] + c]
        o += c
    return out_i[:total], out_v[:total], ok


@njit(**JIT)
def _merge_step(src_i, src_v, a, b):
    """The next pair of a stable merge of two ascending runs at a (left) and b (right): the
    smaller index, the left one on a tie. Branch-free (on real data the comparison is a coin
    toss). Returns (index as int64, value, a, b) with the taken run's position advanced."""
    ka = np.int64(src_i[a])
    kb = np.int64(src_i[b])
    take_b = kb < ka
    k = kb if take_b else ka
    v = src_v[b] if take_b else src_v[a]
    return k, v, a + np.int64(not take_b), b + np.int64(take_b)


@njit(**JIT)
def _merge_runs(src_i, src_v, dst_i, dst_v, bounds, nruns):
    """One pass of a bottom-up natural merge: merge runs 2j and 2j+1 (stable: on equal indices
    the left run's entries come first). Returns the number of runs left; ``bounds`` updated."""
    out = 0
    r = 0
    while r < nruns:
        lo = bounds[r]
        if r + 1 == nruns:  # an odd run out: copied
            hi = bounds[r + 1]
            dst_i[lo:hi] = src_i[lo:hi]
            dst_v[lo:hi] = src_v[lo:hi]
            bounds[out] = lo
            out += 1
            r += 1
            continue
        mid = bounds[r + 1]
        hi = bounds[r + 2]
        a = lo
        b = mid
        o = lo
        while a < mid and b < hi:
            dst_i[o], dst_v[o], a, b = _merge_step(src_i, src_v, a, b)
            o += 1
        while a < mid:
            dst_i[o] = src_i[a]
            dst_v[o] = src_v[a]
            a += 1
            o += 1
        while b < hi:
            dst_i[o] = src_i[b]
            dst_v[o] = src_v[b]
            b += 1
            o += 1
        bounds[out] = lo
        out += 1
        r += 2
    bounds[out] = bounds[nruns]
    return out


@njit(**JIT)
def _emit(out_i, out_v, o, prev, i, v):
    """Append (i, v) to the summed output whose last entry is at o with index prev (o = -1:
    empty): added into it when i == prev (a NaN sum canonical), else a new entry. Returns
    the new (o, prev)."""
    if o >= 0 and i == prev:
        out_v[o] = canonical(out_v[o] + v)
        return o, prev
    o += 1
    out_i[o] = i
    out_v[o] = v
    return o, i


@njit(**JIT)
def _sum_sorted(idx, val, out_i, out_v):
    """Sum each run of equal indices of a sorted (idx, val), left to right (a NaN sum canonical,
    a lone entry copied); the length used."""
    o = -1
    prev = np.int64(-1)
    for p in range(idx.shape[0]):
        o, prev = _emit(out_i, out_v, o, prev, np.int64(idx[p]), val[p])
    return o + 1


@njit(**JIT)
def _runs_and_min(indices):
    """(R, smallest index): R the number of ascending runs (a run ends where an index is below
    the one before it; 0 for no entries)."""
    n = indices.shape[0]
    if n == 0:
        return 0, np.int64(0)
    runs = 1
    low = np.int64(indices[0])
    for i in range(1, n):
        runs += np.int64(indices[i] < indices[i - 1])
        low = min(low, np.int64(indices[i]))
    return runs, low


@njit(**JIT)
def _run_bounds(indices, nruns):
    """nruns + 1 int64 bounds: where each ascending run starts, then the length."""
    bounds = np.empty(nruns + 1, np.int64)
    bounds[0] = 0
    r = 1
    for i in range(1, indices.shape[0]):
        if indices[i] < indices[i - 1]:
            bounds[r] = i
            r += 1
    bounds[nruns] = indices.shape[0]
    return bounds


@njit(**JIT)
def _merge_sum(src_i, src_v, lo, mid, hi, out_i, out_v):
    """Stable merge of the ascending runs [lo, mid) and [mid, hi) (equal indices: the left
    run's first) straight into the summed output: each run of equal indices is summed in the
    merged order, which is the order of original position. Returns the output length."""
    o = -1
    prev = np.int64(-1)
    a = lo
    b = mid
    while a < mid and b < hi:
        k, v, a, b = _merge_step(src_i, src_v, a, b)
        o, prev = _emit(out_i, out_v, o, prev, k, v)  # a duplicate is the rare branch
    while a < mid:
        o, prev = _emit(out_i, out_v, o, prev, np.int64(src_i[a]), src_v[a])
        a += 1
    while b < hi:
        o, prev = _emit(out_i, out_v, o, prev, np.int64(src_i[b]), src_v[b])
        b += 1
    return o + 1


@njit(**JIT)
def _coalesce_runs(indices, values, bounds, nruns, t_i, t_v, u_i, u_v, out_i, out_v):
    """Coalesce R = nruns ≥ 2 ascending runs: merge passes pairing runs (a bottom-up natural
    merge sort) from the input into t, then between t and u (needed from R > 4 on), until two
    runs are left, whose merge writes the summed output. Returns its length."""
    if nruns == 2:
        return _merge_sum(indices, values, 0, bounds[1], bounds[2], out_i, out_v)
    nruns = _merge_runs(indices, values, t_i, t_v, bounds, nruns)
    a_i, a_v, b_i, b_v = t_i, t_v, u_i, u_v
    while nruns > 2:
        nruns = _merge_runs(a_i, a_v, b_i, b_v, bounds, nruns)
        a_i, b_i = b_i, a_i
        a_v, b_v = b_v, a_v
    return _merge_sum(a_i, a_v, 0, bounds[1], bounds[2], out_i, out_v)


def _coalesce(indices, values, nruns):
    """Stable sort by index (a bottom-up natural merge sort: ⌈log₂R⌉ passes for R ascending
    runs, the last one summing as it merges) and the sum of each run of equal indices in
    original-position order. The merge passes before the last write into per-thread scratch;
    the result is fresh (a copy of its used part when duplicates left less than half)."""
    n = indices.shape[0]
    out_i = np.empty(n, indices.dtype)
    out_v = np.empty(n, values.dtype)
    if nruns <= 1:
        m = _sum_sorted(indices, values, out_i, out_v)
    else:
        bounds = _run_bounds(indices, nruns)
        t_i = scratch("coalesce t_i", n, indices.dtype)
        t_v = scratch("coalesce t_v", n, values.dtype)
        deep = nruns > 4  # a third pass or more: a second pair of buffers
        u_i = scratch("coalesce u_i", n if deep else 0, indices.dtype)
        u_v = scratch("coalesce u_v", n if deep else 0, values.dtype)
        m = _coalesce_runs(indices, values, bounds, nruns, t_i, t_v, u_i, u_v, out_i, out_v)
    if 2 * m < n:
        return out_i[:m].copy(), out_v[:m].copy()
    return out_i[:m], out_v[:m]


@njit(**JIT)
def _index_range_ok(indices, n):
    ok = True
    for i in range(indices.shape[0]):
        j = np.int64(indices[i])
        ok &= (j >= 0) & (j < n)
    return ok


@njit(**JIT)
def _scatter_add(dense, indices, values):
    # dense[indices[j]] += values[j] for j = 0, 1, ... in order (duplicates accumulate); a NaN
    # sum is written as the canonical NaN
    for j in range(indices.shape[0]):
        i = indices[j]
        dense[i] = canonical(dense[i] + values[j])


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
    """float16 values are summed in float32 (docs/design.md §3): widened exactly, bit for bit."""
    return widen_half(v) if v.dtype == np.float16 else v


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
        bit. float16 sums are computed in float32 and rounded once. A NaN sum is the canonical
        NaN (docs/design.md §3.4); an unmatched NaN keeps its payload.

    Raises
    ------
    ValueError
        An argument not 1-D; len(va) != len(ia) or len(vb) != len(ib); ia or ib unsorted,
        duplicated or negative.
    TypeError
        Index arrays not int32/int64, value arrays not float16/32/64, or va, vb dtypes differ.

    Notes
    -----
    docs/design.md §3 kernel contract. One branch-free merge pass, split at the merge-path diagonal
    (Odeh et al., IPDPSW 2012) into two parts that run interleaved in one loop so that their
    dependency chains overlap, the first from its largest index down and the second up from the
    diagonal, so they meet without a gap to close; each index (and each matched pair) lives in
    exactly one part, so the result is that of one sequential merge. The sorted-unique check is
    fused into it (the output is strictly increasing iff both inputs are), so valid input is
    read once. From ``config.MERGE_PARALLEL_MIN`` pairs (off by default) 2 x
    ``config.CPU_THREADS`` parts run on threads, with the same result.
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
    out_v = np.empty(na + nb, np.float32 if va.dtype == np.float16 else va.dtype)
    threads = cpu_threads(na + nb, config.MERGE_PARALLEL_MIN)
    if threads == 1:
        lo, hi, ok = _merge_add(ia, _as_sum_dtype(va), ib, _as_sum_dtype(vb), out_i, out_v)
        out_i = out_i[lo:hi]
        out_v = out_v[lo:hi]
        count = hi - lo
    else:
        out_i, out_v, ok = _merge_add_parallel(
            ia, _as_sum_dtype(va), ib, _as_sum_dtype(vb), out_i, out_v, threads
        )
        count = out_i.shape[0] if ok else 0
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
            # Unmatched entries came through float32 unchanged, so the way back is exact for
            # them (NaN payloads too), and rounds the sums once.
            out_v = narrow_half(out_v)
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
        (float16 in float32, rounded once; a NaN sum is the canonical NaN, docs/design.md §3.4);
        a single occurrence is copied bit for bit.

    Raises
    ------
    ValueError
        An argument not 1-D; lengths differ; a negative index.
    TypeError
        indices not int32/int64; values not float16/32/64.

    Notes
    -----
    docs/design.md §3 kernel contract: coalescing float32 [1e8, 1, -1e8] at one index gives exactly
    0.0, because (1e8 + 1) rounds to 1e8 in float32. Equal indices stay in position order: the
    sort is a stable bottom-up natural merge, O(m log R) for an input made of R ascending runs
    (a sorted input is summed in one pass; a concatenation of P sorted vectors, what an
    all-gather returns, takes ⌈log₂P⌉ merge passes).
    """
    indices = as_indices("indices", indices)
    values = as_values("values", values)
    _validate.check_same_length("values", values.shape[0], "indices", indices.shape[0])
    nruns, low = _runs_and_min(indices)
    _validate.require(low >= 0, "indices", "must be non-negative")
    out_i, out_v = _coalesce(indices, _as_sum_dtype(values), nruns)
    if values.dtype == np.float16:
        out_v = narrow_half(out_v)
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
    docs/design.md §3 kernel contract: for each touched i,
    ``dense[i] = ((dense[i] + v_1) + v_2) ...`` with v_1, v_2, ... the values aimed at i in
    position order, in the value dtype. For float16 the whole chain for one i runs in float32 and
    is rounded to float16 once. A touched entry that ends NaN is the canonical NaN (§3.4);
    untouched entries keep their bits.
    """
    target = dense
    dense = as_values("dense", in_place(dense, "dense"))
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
        dense[touched] = narrow_half(acc)
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
    docs/design.md §3 kernel contract. Values are moved as bit patterns (float16 too).
    """
    dense = as_values("dense", dense)
    indices = as_indices("indices", indices)
    n = dense.shape[0]
    view = dense.view(_contract.BITS[dense.dtype.name])
    out = np.empty(indices.shape[0], view.dtype)
    ok = True
    if indices.shape[0] > 0:
        _validate.require(n > 0, "indices", "every index must lie in [0, n = 0)")
        ok = _gather(view, indices, out)
    _validate.require(ok, "indices", f"every index must lie in [0, n = {n})")
    return out.view(dense.dtype)
