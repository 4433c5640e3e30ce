"""Selection kernels on the CPU: top-k by magnitude, thresholds and their estimates.

Everything here works on *keys*: the bit pattern of |x| as a signed integer of x's width with
the sign bit cleared, every NaN clamped to one key just above +inf
(``spardl_kernels._contract.KEY_INFO``).
Positive IEEE floats order like their bit patterns, so ordering keys is ordering |x| under the
contract's total order (docs/design.md §3): NaN above +inf, -0.0 == 0.0, ties to the lower index.
Working on bits also makes float16 first class although Numba's CPU target has no float16
arithmetic.
"""

import math

import numpy as np
from numba import njit, prange

from .. import _contract, _validate, config
from .._contract import (
    SPLITMIX64_GOLDEN,
    SPLITMIX64_MIX1,
    SPLITMIX64_MIX2,
    key_to_value,
    threshold_key,
)
from ._common import (
    JIT,
    JIT_PARALLEL,
    as_values,
    canonical,
    cpu_threads,
    key_view,
    numba_threads,
    part_bounds,
    scratch,
)
from ._simd import (
    float_bits,
    hit_mask,
    lowest_set_bit,
    not_below_mask,
    popcount64,
    store_fence,
    stream_head,
    sum_mask,
)

# ---------------------------------------------------------------------------------------------
# compiled workers
# ---------------------------------------------------------------------------------------------


@njit(**JIT)
def _key(b, mask, nan_key):
    # key = min(|x| bits, nan_key); widening to int64 first keeps the arithmetic in one type.
    return min(np.int64(b) & mask, nan_key)


@njit(**JIT)
def _small_select(bits, k, mask, nan_key):
    """Stable-sort path for small n: the k selected positions, ascending, and the k-th key."""
    n = bits.shape[0]
    rank = np.empty(n, np.int64)
    for i in range(n):
        # Larger key first; mergesort is stable, so equal keys keep ascending index order.
        rank[i] = nan_key - _key(bits[i], mask, nan_key)
    order = np.argsort(rank, kind="mergesort")
    sel = np.sort(order[:k])
    kth = nan_key - rank[order[k - 1]] if k > 0 else np.int64(-1)
    return sel, kth


@njit(**JIT)
def _top_histogram(bits, mask, nan_key, shift, nbins, lanes):
    """Histogram of the first digit (key >> shift) over all of x, in `lanes` sub-histograms."""
    n = bits.shape[0]
    hist = np.zeros(lanes * nbins, np.int64)
    m = n - n % lanes
    for i in range(0, m, lanes):
        for lane in range(lanes):
            hist[lane * nbins + (_key(bits[i + lane], mask, nan_key) >> shift)] += 1
    for i in range(m, n):
        hist[_key(bits[i], mask, nan_key) >> shift] += 1
    total = hist[:nbins].copy()
    for lane in range(1, lanes):
        total += hist[lane * nbins : (lane + 1) * nbins]
    return total


@njit(**JIT)
def _walk_down(hist, need):
    """Highest bucket b with sum(hist[b:]) >= need; returns (b, sum(hist[b+1:]))."""
    above = 0
    b = hist.shape[0] - 1
    while b > 0 and above + hist[b] < need:
        above += hist[b]
        b -= 1
    return b, above


@njit(**JIT)
def _refine(cand_key, m, bucket, shift, digits, need):
    """Resolve the remaining digits of the threshold key among the candidate keys.

    ``cand_key[:m]`` share the first digit ``bucket``; ``need`` >= 1 of them are to be selected.
    Returns (T, ties): the exact threshold key and how many keys == T are to be taken.
    """
    prefix = np.int64(bucket)
    sh = shift
    for d in range(1, digits.shape[0]):
        w = digits[d]
        sh -= w
        nb = np.int64(1) << w
        h = np.zeros(nb, np.int64)
        for c in range(m):
            key = cand_key[c]
            if (key >> (sh + w)) == prefix:
                h[(key >> sh) & (nb - 1)] += 1
        b, above = _walk_down(h, need)
        need -= above
        prefix = (prefix << w) | b
    return prefix, need


@njit(**JIT)
def _finish_topk(
    k, definite, def_bits, n_def, cand_idx, cand_key, cand_bits, m, T, ties, out_idx, out_bits
):  # fmt: skip
    """Write the top k: the ascending `definite[:n_def]` (keys above the candidates' range)
    merged with the candidates whose key > T plus the first `ties` with key == T. Every
    index comes with its value's bits, collected by the pass that found it, so nothing is read
    back from x (a gather at k scattered positions of x costs a cache miss each).
    ``definite`` has room for one entry beyond n_def: the merge's sentinel."""
    chosen = np.empty(k - n_def + 1, np.int64)
    chosen_bits = np.empty(k - n_def + 1, cand_bits.dtype)
    q = 0
    for c in range(m):
        key = cand_key[c]
        if key > T or (key == T and ties > 0):
            ties -= key == T
            chosen[q] = cand_idx[c]
            chosen_bits[q] = cand_bits[c]
            q += 1
    # Merge the two ascending lists without a branch on the data: each list ends in a
    # sentinel above every index, so both heads can always be read, and the smaller one is
    # taken by selects (the lists interleave at random, which a branch would mispredict).
    big = np.iinfo(np.int64).max
    definite[n_def] = big
    chosen[k - n_def] = big
    a = 0
    q = 0
    for o in range(k):
        d = definite[a]
        c = chosen[q]
        take = d < c
        out_idx[o] = d if take else c
        out_bits[o] = def_bits[a] if take else chosen_bits[q]
        a += take
        q += not take


@njit(**JIT)
def _radix_topk(bits, k, mask, nan_key, digits, lanes, out_idx, out_bits):
    """Exact radix select of the k largest keys into out_idx (ascending) and out_bits.

    Two passes over x: a histogram of the first digit, then one pass that writes every index
    whose first digit is above the threshold's ("definite") and collects the ones that share it
    ("candidates"). The remaining digits are resolved on the candidates only, and the two sorted
    index lists are merged.
    """
    n = bits.shape[0]
    shift = np.int64(0)
    for d in range(1, digits.shape[0]):
        shift += digits[d]
    total = _top_histogram(bits, mask, nan_key, shift, np.int64(1) << digits[0], lanes)
    bucket, n_def = _walk_down(total, k)
    m = total[bucket]
    definite = np.empty(n_def + 1, np.int64)  # + 1: _finish_topk's sentinel
    def_bits = np.empty(n_def + 1, bits.dtype)
    cand_idx = np.empty(m, np.int64)
    cand_key = np.empty(m, np.int64)
    cand_bits = np.empty(m, bits.dtype)
    j = 0
    c = 0
    for i in range(n):
        v = bits[i]
        key = _key(v, mask, nan_key)
        top = key >> shift
        if top > bucket:
            definite[j] = i
            def_bits[j] = v
            j += 1
        elif top == bucket:
            cand_idx[c] = i
            cand_key[c] = key
            cand_bits[c] = v
            c += 1
    T, ties = _refine(cand_key, m, bucket, shift, digits, k - n_def)
    _finish_topk(
        k, definite, def_bits, n_def, cand_idx, cand_key, cand_bits, m, T, ties, out_idx, out_bits
    )


@njit(**JIT)
def _sample_window(bits, k, mask, nan_key, s, sigmas):
    """Bracket the k-th largest key from a strided sample of s keys (Floyd-Rivest style).

    Returns (lo, hi, cap): with high probability count(key > hi) < k <= count(key >= lo), and
    about cap / 2 keys lie in [lo, hi]. lo = 0 means the sample could not bracket usefully.
    """
    n = bits.shape[0]
    keys = np.empty(s, np.int64)
    for j in range(s):
        keys[j] = _key(bits[_sample_position(j, n, s)], mask, nan_key)
    return _bracket(keys, n, k, nan_key, sigmas)


@njit(inline="always", **JIT)
def _sample_position(j, n, s):
    """Position of sample j of s strided samples of [0, n): (j * n) // s + (n // s) // 2,
    without overflowing j * n."""
    q = n // s
    return j * q + (j * (n % s)) // s + q // 2


@njit(**JIT)
def _bracket(keys, n, k, nan_key, sigmas):
    """(lo, hi, cap) of :func:`_sample_window` from the s sampled keys (sorted in place)."""
    s = keys.shape[0]
    keys.sort()
    # expected number of sample keys above the k-th largest key, and its spread (binomial)
    rank = k * s / n
    delta = sigmas * np.sqrt(rank + 1.0) + 2.0
    hi_rank = np.int64(np.floor(rank - delta))
    lo_rank = np.int64(np.ceil(rank + delta))
    hi = keys[s - 1 - hi_rank] if hi_rank >= 0 else nan_key + 1
    lo = keys[s - 1 - lo_rank] if lo_rank < s else np.int64(0)
    cap = np.int64(2.0 * (lo_rank - max(hi_rank, -1) + 1) * (n / s)) + 1024
    return lo, hi, cap


@njit(inline="always", **JIT)
def _low_bit(m):
    """(position of the lowest set bit of the non-zero uint64 m, m with that bit cleared)."""
    return lowest_set_bit(m)


@njit(inline="always", **JIT)
def _float_test(lo, bits, x, normal_key, inf_key):
    """(t, usable): t is the float of x's dtype whose bits are the key lo, and ``usable`` says
    whether ``not (|v| < t)`` tests key(v) >= lo exactly: for normal_key <= lo <= inf_key.

    Non-negative IEEE floats order like their bits, and a NaN fails every ``<``, so it hits, as
    its key (above inf's) does. A float compare runs 8 lanes per AVX instruction where an
    integer one runs 4 (no AVX2 on many hosts). Below the smallest normal number a flush-to-zero
    mode could make subnormals equal, so the integer test is kept there; and float16 (x then is
    the integer view itself, with normal_key > inf_key) always uses it.
    """
    a = np.empty(1, bits.dtype)
    a[0] = lo
    return a.view(x.dtype)[0], normal_key <= lo and lo <= inf_key


@njit(**JIT)
def _window_pass(bits, x, k, mask, nan_key, lo, hi, cap, normal_key, inf_key, found):
    """One pass over x: indices with key > hi ("definite"), and (index, key) with lo <= key <= hi
    ("candidates"), each with its bits. Returns (ok, n_def, m, found) with found = (definite,
    def_bits, cand_idx, cand_key, cand_bits); ok is False when the window missed: k or more
    keys above hi, or more than cap candidates. ``x``: the values as floats (float32/float64),
    or ``bits`` itself for float16 (:func:`_float_test`); ``found``: the lists to fill
    (:func:`_window_buffers`).
    """
    t, usable = _float_test(lo, bits, x, normal_key, inf_key)
    # Nothing is written without summing; the store target is an empty array of its own, so
    # that a read-only x compiles (the summing branch's store is typed all the same).
    return _window_scan(
        x, x, x[:0].copy(), x, bits, 0, bits.shape[0], False, False, k, mask, nan_key, lo, hi,
        cap, t, usable, found,
    )  # fmt: skip


@njit(inline="always", **JIT)
def _file_hits(
    m, s, gp, ep, bp, summing, mask, nan_key, hi, k, cap, j, c,
    definite, def_bits, cand_idx, cand_key, cand_bits,
):  # fmt: skip
    """File the hits of mask ``m`` (block at s) into the window lists ``found``; returns the new
    (j, c). Each hit is written to both lists and only the right count moves (the lists have
    one slot more than they hold, and a full list keeps overwriting that slot while counting
    on), so there is no unpredictable branch. A hit's bits: those of the sum g + e, recomputed
    (``summing``), else bp's. Inlined into the scans (a called helper's array arguments cost
    reference-count updates on every call: twice the time of the whole pass at density 1 %;
    the lists come as five arrays, unpacked once by the caller, for the same reason)."""
    while m:
        l, m = _low_bit(m)
        i = s + l
        if summing:
            v = float_bits(canonical(gp[i] + ep[i]))
        else:
            v = bp[i]
        key = _key(v, mask, nan_key)
        above = key > hi
        jj = min(j, k)
        cc = min(c, cap)
        definite[jj] = i
        def_bits[jj] = v
        cand_idx[cc] = i
        cand_key[cc] = key
        cand_bits[cc] = v
        j += above
        c += not above
    return j, c


@njit(**JIT)
def _window_scan(
    g, e, out, x, bits, start, stop, summing, stream, k, mask, nan_key, lo, hi, cap, t, usable,
    found,
):  # fmt: skip
    """The window pass over [start, stop) of ``bits`` (indices relative to start); with
    ``summing``, out = g + e is written there first, 64 entries at a time (a NaN sum as the
    canonical NaN), where ``out`` is x itself and ``bits`` its memory as integers, and the keys
    tested are those of the sums in registers (without summing ``out`` is not touched). With
    ``stream`` the blocks start at out's first 64-byte boundary (the entries before it are a
    short block of their own) and are written with non-temporal stores (:mod:`._simd`,
    ``sum_mask``): the pass then never reads X, a hit's bits are recomputed from g and e.

    Keys >= lo are found 64 at a time as a bit mask (one vector compare, :mod:`._simd`): with
    ``usable``, by the float compare ``not (|v| < t)`` on the values (:func:`_float_test`;
    while summing, on the block of sums just written), otherwise by the integer compare of the
    keys. Each hit is filed without a branch (:func:`_file_hits`). ``found``: the lists
    (:func:`_window_buffers`), returned filled.
    """
    gp = g[start:stop]
    ep = e[start:stop]
    op = out[start:stop]
    xp = x[start:stop]
    bp = bits[start:stop]
    n = stop - start
    mask_t = bits.dtype.type(mask)
    lo_t = bits.dtype.type(lo)
    definite, def_bits, cand_idx, cand_key, cand_bits = found
    j = 0
    c = 0
    if summing:
        # Its own loop: with the plain scans' reads of X in the same loop body (never taken
        # while summing), the streamed pass ran at a third of its speed (measured).
        head = stream_head(op, n, stream)
        first = 1 if head > 0 else 0
        # the head's mask before the loop, for the same reason (a sixth of the speed)
        m_head = sum_mask(gp, ep, op, 0, head, stream, usable, t, lo_t, mask_t)
        for b in range(first + (n - head + 63) // 64):
            if b < first:
                s = 0
                m = m_head
            else:
                s = head + (b - first) * 64
                m = sum_mask(gp, ep, op, s, min(s + 64, n), stream, usable, t, lo_t, mask_t)
            j, c = _file_hits(
                m, s, gp, ep, bp, True, mask, nan_key, hi, k, cap, j, c, definite, def_bits,
                cand_idx, cand_key, cand_bits,
            )  # fmt: skip
        store_fence()
    else:
        for b in range((n + 63) // 64):
            s = b * 64
            stop_b = min(s + 64, n)
            if usable:
                m = not_below_mask(xp, s, stop_b, t)
            else:
                m = hit_mask(bp, s, stop_b, lo_t, mask_t)
            j, c = _file_hits(
                m, s, gp, ep, bp, False, mask, nan_key, hi, k, cap, j, c, definite, def_bits,
                cand_idx, cand_key, cand_bits,
            )  # fmt: skip
    ok = j < k and c <= cap and j + c >= k
    return ok, min(j, k), min(c, cap), found


def _window_buffers(k, cap, bits_dtype):
    """(definite, def_bits, cand_idx, cand_key, cand_bits) of a window pass: room for k and cap
    entries, plus the one slot that the branch-free filing overwrites once a list is full.
    Per-thread scratch (:func:`scratch`): a window pass at n = 25 M, ρ = 1 % fills about 6 MB
    of them, whose page faults a fresh allocation would pay on every call."""
    return (
        scratch("window definite", k + 1, np.int64),
        scratch("window def_bits", k + 1, bits_dtype),
        scratch("window cand_idx", cap + 1, np.int64),
        scratch("window cand_key", cap + 1, np.int64),
        scratch("window cand_bits", cap + 1, bits_dtype),
    )


@njit(**JIT)
def _keys_kth(keys, m, need, nan_key, digits, lanes, cutoff):
    """The need-th largest of keys[:m] (clamped keys, so any mask works)."""
    sub = keys[:m]
    if m <= cutoff:
        return _small_select(sub, need, np.int64(0x7FFFFFFFFFFFFFFF), nan_key)[1]
    return _radix_kth(sub, need, np.int64(0x7FFFFFFFFFFFFFFF), nan_key, digits, lanes)


def _window_topk(bits, k, mask, nan_key, digits, lanes, cutoff, s, sigmas, out_idx, out_bits, fx):
    """Top k through a sampled window; False if the window missed (then nothing is written).
    ``fx``: (x, normal_key, inf_key) of :func:`_float_args`."""
    lo, hi, cap = _sample_window(bits, k, mask, nan_key, s, sigmas)
    if lo == 0 or cap > bits.shape[0] // 4:
        return False
    found = _window_buffers(k, cap, bits.dtype)
    ok, n_def, m, found = _window_pass(
        bits, fx[0], k, mask, nan_key, lo, hi, cap, fx[1], fx[2], found
    )
    if not ok:
        return False
    _window_finish(k, nan_key, digits, lanes, cutoff, n_def, m, found, out_idx, out_bits)
    return True


@njit(**JIT)
def _window_finish(k, nan_key, digits, lanes, cutoff, n_def, m, found, out_idx, out_bits):
    """The top k from a window pass that hit: the n_def definite entries and the threshold key
    T resolved among the m candidates (all with key > T, then the lowest-index ties)."""
    definite, def_bits, cand_idx, cand_key, cand_bits = found
    need = k - n_def
    T = _keys_kth(cand_key, m, need, nan_key, digits, lanes, cutoff)
    above = 0
    for c in range(m):
        above += cand_key[c] > T
    _finish_topk(
        k, definite, def_bits, n_def, cand_idx, cand_key, cand_bits, m, T, need - above,
        out_idx, out_bits,
    )  # fmt: skip


def _window_kth(bits, k, mask, nan_key, digits, lanes, cutoff, s, sigmas, fx):
    """k-th largest key through a sampled window; -1 if the window missed. ``fx`` as for
    :func:`_window_topk`."""
    lo, hi, cap = _sample_window(bits, k, mask, nan_key, s, sigmas)
    if lo == 0 or cap > bits.shape[0] // 4:
        return -1
    found = _window_buffers(k, cap, bits.dtype)
    ok, n_def, m, found = _window_pass(
        bits, fx[0], k, mask, nan_key, lo, hi, cap, fx[1], fx[2], found
    )
    if not ok:
        return -1
    return _keys_kth(found[3], m, k - n_def, nan_key, digits, lanes, cutoff)


@njit(**JIT)
def _radix_kth(bits, k, mask, nan_key, digits, lanes):
    """The k-th largest key: first-digit histogram, then the candidates' remaining digits."""
    n = bits.shape[0]
    shift = np.int64(0)
    for d in range(1, digits.shape[0]):
        shift += digits[d]
    total = _top_histogram(bits, mask, nan_key, shift, np.int64(1) << digits[0], lanes)
    bucket, n_def = _walk_down(total, k)
    m = total[bucket]
    cand_key = np.empty(m, np.int64)
    c = 0
    for i in range(n):
        key = _key(bits[i], mask, nan_key)
        if (key >> shift) == bucket:
            cand_key[c] = key
            c += 1
    T, _ = _refine(cand_key, m, bucket, shift, digits, k - n_def)
    return T


@njit(**JIT)
def _small_topk(bits, k, mask, nan_key, out_idx, out_bits):
    sel, _ = _small_select(bits, k, mask, nan_key)
    for o in range(k):
        out_idx[o] = sel[o]
        out_bits[o] = bits[sel[o]]


@njit(**JIT)
def _compact_range(bits, start, stop, K_t, mask_t, idx, vals, j):
    """Append (i, bits[i]) for every i in [start, stop) with key(x_i) >= K to idx[j:], vals[j:].

    Returns the new j; idx and vals need room for the count from j (callers keep one slot
    more).
    """
    # Index a slice from 0: loop indices are then provably >= 0 and Numba drops its
    # negative-index wraparound test.
    part = bits[start:stop]
    m = part.shape[0]
    for b in range((m + 63) // 64):
        s = b * 64
        hits = hit_mask(part, s, m, K_t, mask_t)
        while hits:
            l, hits = _low_bit(hits)
            idx[j] = start + s + l
            vals[j] = part[s + l]
            j += 1
    return j


@njit(**JIT)
def _count_range(bits, start, stop, K_t, mask_t):
    """sum(key(x_i) >= K for i in [start, stop)): the set bits of each 64-entry hit mask.

    One vector compare and one ``popcnt`` per 64 entries. A plain ``c += test`` loop, even
    with int32 partial sums to keep the vectoriser's lanes narrow, took 2.2x as long at
    n = 2**20 on an AVX-512 CPU (docs/performance.md, "An AVX-512 machine").
    """
    part = bits[start:stop]
    m = part.shape[0]
    total = np.uint64(0)
    for b in range((m + 63) // 64):
        total += popcount64(hit_mask(part, b * 64, m, K_t, mask_t))
    return np.int64(total)


@njit(**JIT)
def _select_part(bits, start, stop, K, mask, chunk, idx, vals, j, end):
    """Compact [start, stop) into idx[j:end], vals[j:end] chunk by chunk.

    Returns the number of pairs written, or -1 if they (plus the one slot of slack the
    branch-free store needs) do not fit. key >= K needs no NaN clamp: NaN keys exceed
    nan_key >= K; the test runs in x's own integer width.
    """
    mask_t = bits.dtype.type(mask)
    K_t = bits.dtype.type(K)
    j0 = j
    for c0 in range(start, stop, chunk):
        c1 = min(c0 + chunk, stop)
        # count only when the chunk might not fit (near the end of the buffer)
        if j + (c1 - c0) >= end and j + _count_range(bits, c0, c1, K_t, mask_t) >= end:
            return -1
        j = _compact_range(bits, c0, c1, K_t, mask_t, idx, vals, j)
    return j - j0


@njit(**JIT_PARALLEL)
def _select_parts_parallel(bits, K, mask, bounds, room, chunk, idx, vals, counts):
    """Part p = [bounds[p], bounds[p+1]) into its buffer range [room[p], room[p+1]), one part
    per thread (the parts touch disjoint ranges only); counts[p] as :func:`_select_part`
    returns it."""
    for p in prange(counts.shape[0]):
        counts[p] = _select_part(
            bits, bounds[p], bounds[p + 1], K, mask, chunk, idx, vals, room[p], room[p + 1]
        )


@njit(**JIT)
def _count_ge(bits, K, mask):
    return _count_range(bits, 0, bits.shape[0], bits.dtype.type(K), bits.dtype.type(mask))


@njit(**JIT_PARALLEL)
def _count_ge_parallel(bits, K, mask, bounds):
    """count_above with one contiguous part per thread; integer sums, so order does not matter."""
    parts = bounds.shape[0] - 1
    counts = np.zeros(parts, np.int64)
    K_t = bits.dtype.type(K)
    mask_t = bits.dtype.type(mask)
    for p in prange(parts):
        counts[p] = _count_range(bits, bounds[p], bounds[p + 1], K_t, mask_t)
    return counts.sum()


_U1 = np.uint64(1)
_GOLDEN = SPLITMIX64_GOLDEN
_MIX1 = SPLITMIX64_MIX1
_MIX2 = SPLITMIX64_MIX2
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


@njit(**JIT)
def _sample_bits(bits, s, seed):
    """s positions drawn with replacement by SplitMix64(seed + (j + 1) * golden) mod n.

    A counter-based generator: sample j depends only on (seed, j), so the CUDA twin draws the
    same positions in parallel. The modulo bias (n / 2**64) is negligible.
    """
    n = np.uint64(bits.shape[0])
    out = np.empty(s, bits.dtype)
    for j in range(s):
        z = seed + (np.uint64(j) + _U1) * _GOLDEN
        z = (z ^ (z >> _S30)) * _MIX1
        z = (z ^ (z >> _S27)) * _MIX2
        z = z ^ (z >> _S31)
        out[j] = bits[np.int64(z % n)]
    return out


# ---------------------------------------------------------------------------------------------
# helpers of the public functions
# ---------------------------------------------------------------------------------------------


def _digits(dtype):
    digits = np.asarray(config.RADIX_DIGITS[_contract.dtype_name(dtype)], dtype=np.int64)
    return digits


def _float_args(bits, dtype):
    """(x, normal_key, inf_key) for the float compares of a window pass (:func:`_float_test`):
    x the values as float32/float64 and the keys of the smallest normal number and of inf;
    for float16 (no float type in Numba's CPU target) x is ``bits`` and the compares stay
    integer (normal_key above inf_key)."""
    dtype = np.dtype(dtype)
    _, _, inf_key, nan_key = _contract.key_info(dtype)
    if dtype == np.float16:
        return bits, nan_key + 1, inf_key
    normal = np.array([np.finfo(dtype).smallest_normal], dtype).view(bits.dtype)[0]
    return bits.view(dtype), int(normal), inf_key


def _window_sample_size(n):
    if not config.WINDOW_SELECT or n < config.WINDOW_MIN_N:
        return 0
    return min(config.WINDOW_SAMPLE_MAX, max(config.WINDOW_SAMPLE_MIN, n // 128))


def _kth_key(bits, k, mask, nan_key, dtype):
    """The k-th largest key (1 <= k <= n) by the small-n, sampled-window or radix path."""
    n = bits.shape[0]
    if n <= config.SMALL_N_CUTOFF:
        return int(_small_select(bits, k, mask, nan_key)[1])
    digits = _digits(dtype)
    lanes = int(config.HIST_LANES)
    s = _window_sample_size(n)
    if s:
        cutoff = int(config.SMALL_N_CUTOFF)
        fx = _float_args(bits, dtype)
        T = _window_kth(bits, k, mask, nan_key, digits, lanes, cutoff, s, config.WINDOW_SIGMAS, fx)
        if T >= 0:
            return int(T)
    return int(_radix_kth(bits, k, mask, nan_key, digits, lanes))


def _topk_into(bits, k, mask, nan_key, dtype, out_idx, out_bits):
    """Top k (0 < k < n) by the small-n, sampled-window or radix path."""
    n = bits.shape[0]
    if n <= config.SMALL_N_CUTOFF:
        _small_topk(bits, k, mask, nan_key, out_idx, out_bits)
        return
    digits = _digits(dtype)
    lanes = int(config.HIST_LANES)
    s = _window_sample_size(n)
    if s and _window_topk(
        bits,
        k,
        mask,
        nan_key,
        digits,
        lanes,
        int(config.SMALL_N_CUTOFF),
        s,
        config.WINDOW_SIGMAS,
        out_idx,
        out_bits,
        _float_args(bits, dtype),
    ):
        return
    _radix_topk(bits, k, mask, nan_key, digits, lanes, out_idx, out_bits)


def _select_ge(bits, K, mask, index_dtype):
    """(indices, bits) of every key >= K, ascending: one pass over x, split into one contiguous
    part per thread; each part compacts into its own buffer range, and the ranges are joined in
    part order, so the result is the same for every thread count."""
    n = bits.shape[0]
    threads = cpu_threads(n, config.SELECT_PARALLEL_MIN_N)
    chunk = max(16, int(config.SELECT_CHUNK))
    if threads == 1:
        # The same rooms for the one part, in Python integers (small NumPy arrays cost µs
        # each). The first try writes into per-thread scratch (a fresh buffer of n/32 entries
        # pays its page faults on every call: 0.7 ms at n = 2**20 in bench/kernels.py), the
        # rare second one, with room for every entry, into a new array that is not kept.
        room = min(n, int(n * config.SELECT_INITIAL_FRACTION) + chunk) + 1
        idx = scratch("select_above idx", room, index_dtype)
        vals = scratch("select_above vals", room, bits.dtype)
        c = _select_part(bits, 0, n, K, mask, chunk, idx, vals, 0, room)
        if c < 0:
            idx, vals = np.empty(n + 1, index_dtype), np.empty(n + 1, bits.dtype)
            c = _select_part(bits, 0, n, K, mask, chunk, idx, vals, 0, n + 1)
        return idx[:c].copy(), vals[:c].copy()
    bounds = part_bounds(n, threads)
    length = np.diff(bounds)
    # room per part: a guess from SELECT_INITIAL_FRACTION, +1 for the branch-free store's slack
    guess = np.minimum(length, (length * config.SELECT_INITIAL_FRACTION).astype(np.int64) + chunk)
    counts = np.zeros(threads, np.int64)
    for room_per_part in (guess + 1, length + 1):
        room = np.concatenate(([0], np.cumsum(room_per_part)))
        # np.empty of the larger size commits only the pages the parts write
        idx = np.empty(room[-1], index_dtype)
        vals = np.empty(room[-1], bits.dtype)
        with numba_threads(threads):
            _select_parts_parallel(bits, K, mask, bounds, room, chunk, idx, vals, counts)
        if (counts >= 0).all():
            break
    pieces = [slice(room[p], room[p] + counts[p]) for p in range(threads)]
    return np.concatenate([idx[s] for s in pieces]), np.concatenate([vals[s] for s in pieces])


# ---------------------------------------------------------------------------------------------
# public functions
# ---------------------------------------------------------------------------------------------


def topk_abs(x, k, *, index_dtype=np.int64):
    """The k entries of largest magnitude, by an exact radix select (no sort).

    Parameters
    ----------
    x : ndarray of shape (n,), float16, float32 or float64
        Anything NumPy can view without copying (e.g. a CPU torch tensor) is accepted.
    k : int
        Number of entries to select, 0 <= k <= n.
    index_dtype : {np.int64, np.int32}, optional
        Dtype of the returned indices. int32 needs n <= 2**31.

    Returns
    -------
    indices : ndarray of shape (k,), index_dtype
        Positions of the selected entries, ascending.
    values : ndarray of shape (k,), x.dtype
        ``x[indices]``, with their sign (bit for bit, including -0.0 and NaN payloads).

    Raises
    ------
    ValueError
        x not 1-D; k < 0 or k > n; int32 requested but n > 2**31.
    TypeError
        x's dtype is not float16/32/64; k not an integer; index_dtype not int32/int64.

    Notes
    -----
    Order (docs/design.md §3 kernel contract): larger |x| first, NaN above +inf (so any NaN is
    selected when k >= 1), ties to the lower index, -0.0 == 0.0. The result is therefore unique
    and equal on every rank and on the CUDA twin.

    Algorithm: keys are the bit patterns of |x| (sign bit cleared, NaN clamped above +inf). One
    pass histograms the first radix digit (``config.RADIX_DIGITS``: 11 bits of the 31 for
    float32, covering the exponent), a second pass writes every index above the threshold's
    bucket and collects the bucket's candidates; the lower digits are resolved on the candidates
    alone, the lowest-index ties are taken and the two ascending lists are merged. Cost: two
    reads of x plus O(candidates). Inputs with n <= ``config.SMALL_N_CUTOFF`` use a stable sort
    of the keys instead.
    """
    x = as_values("x", x)
    n = x.shape[0]
    k = _validate.check_k(k, n)
    idt = _validate.check_index_dtype(index_dtype, n)
    bits, mask, _, nan_key = key_view(x)
    out_idx = np.empty(k, idt)
    out_bits = np.empty(k, bits.dtype)
    if k == n:
        out_idx[:] = np.arange(n, dtype=idt)
        out_bits[:] = bits
    elif k > 0:
        _topk_into(bits, k, mask, nan_key, x.dtype, out_idx, out_bits)
    return out_idx, out_bits.view(x.dtype)


def kth_largest_abs(x, k):
    """The exact k-th largest |x|: the threshold that selects the top k.

    Parameters
    ----------
    x : ndarray of shape (n,), float16, float32 or float64
    k : int
        1 <= k <= n.

    Returns
    -------
    threshold : scalar of x.dtype
        Non-negative (``-0.0`` is returned as ``0.0``), ``inf``, or ``nan`` when at least k
        entries of x are NaN.

    Raises
    ------
    ValueError
        x not 1-D; k < 1 or k > n (in particular for empty x).
    TypeError
        x's dtype is not float16/32/64; k not an integer.

    Notes
    -----
    Same total order and radix select as :func:`topk_abs` (docs/design.md §3 kernel contract),
    without the output pass, so ``select_above(x, kth_largest_abs(x, k))`` holds every entry of
    ``topk_abs(x, k)``, plus any ties.
    """
    x = as_values("x", x)
    n = x.shape[0]
    k = _validate.check_k_positive(k, n)
    bits, mask, _, nan_key = key_view(x)
    T = _kth_key(bits, k, mask, nan_key, x.dtype)
    return key_to_value(T, x.dtype)


def select_above(x, threshold, *, index_dtype=np.int64):
    """Every entry with |x_i| >= threshold, in one pass over x.

    Parameters
    ----------
    x : ndarray of shape (n,), float16, float32 or float64
    threshold : float
        Compared with |x_i| as a float64 number. NaN entries of x count as above every
        threshold; a NaN threshold selects the NaN entries only; threshold <= 0 selects all.
    index_dtype : {np.int64, np.int32}, optional
        Dtype of the returned indices. int32 needs n <= 2**31.

    Returns
    -------
    indices : ndarray of shape (m,), index_dtype
        Ascending positions of the selected entries.
    values : ndarray of shape (m,), x.dtype
        ``x[indices]``, bit for bit.

    Raises
    ------
    ValueError
        x not 1-D; int32 requested but n > 2**31.
    TypeError
        x's dtype is not float16/32/64; threshold not a real number; bad index_dtype.

    Notes
    -----
    docs/design.md §3 kernel contract. The threshold is turned once into the smallest key of x's
    dtype whose value is >= threshold (exact, no float rounding of x), so the test per element
    is one integer comparison of the bit pattern. Groups of 128 without a hit are skipped after a
    vectorised count; (index, value) pairs are written branch-free. For n >=
    ``config.SELECT_PARALLEL_MIN_N`` x is cut into one contiguous part per thread
    (``config.CPU_THREADS``) and the parts' outputs are joined in order, so the result does not
    depend on the thread count.
    """
    x = as_values("x", x)
    n = x.shape[0]
    t = _validate.check_threshold(threshold)
    idt = _validate.check_index_dtype(index_dtype, n)
    bits, mask, _, _ = key_view(x)
    K = threshold_key(t, x.dtype)
    idx, vbits = _select_ge(bits, K, mask, idt)
    return idx, vbits.view(x.dtype)


def count_above(x, threshold):
    """How many entries have |x_i| >= threshold (same comparison as :func:`select_above`).

    Parameters
    ----------
    x : ndarray of shape (n,), float16, float32 or float64
    threshold : float
        Compared as float64; NaN entries count as above every threshold.

    Returns
    -------
    count : int

    Raises
    ------
    ValueError
        x not 1-D.
    TypeError
        x's dtype is not float16/32/64; threshold not a real number.

    Notes
    -----
    docs/design.md §3 kernel contract; one vectorised pass of integer comparisons on the bits of x,
    on ``config.CPU_THREADS`` threads (contiguous parts) for n >= ``config.SELECT_PARALLEL_MIN_N``.
    """
    x = as_values("x", x)
    t = _validate.check_threshold(threshold)
    bits, mask, _, _ = key_view(x)
    K = threshold_key(t, x.dtype)
    threads = cpu_threads(bits.shape[0], config.SELECT_PARALLEL_MIN_N)
    if threads == 1:
        return int(_count_ge(bits, K, mask))
    with numba_threads(threads):
        return int(_count_ge_parallel(bits, K, mask, part_bounds(bits.shape[0], threads)))


def estimate_threshold(x, k, *, sample_size=None, seed=0):
    """A sampled estimate of ``kth_largest_abs(x, k)``, as in Deep Gradient Compression.

    Parameters
    ----------
    x : ndarray of shape (n,), float16, float32 or float64
    k : int
        0 <= k <= n.
    sample_size : int, optional
        Number of sampled entries s >= 1. Default
        ``max(config.THRESHOLD_SAMPLE_MIN, ceil(config.THRESHOLD_SAMPLE_FRACTION * n))``.
        When s >= n the exact ``kth_largest_abs(x, k)`` is returned.
    seed : int, optional
        The same (x, k, sample_size, seed) always gives the same estimate.

    Returns
    -------
    threshold : float
        ``+inf`` for k = 0; otherwise a non-negative float (or NaN, see kth_largest_abs).

    Raises
    ------
    ValueError
        x not 1-D; k < 0 or k > n; sample_size < 1.
    TypeError
        x's dtype is not float16/32/64; k, sample_size or seed not an integer.

    Notes
    -----
    Estimator (DGC, Lin et al., arXiv 1712.01887: "sample 0.1% to 1% of the gradients
    and perform top-k selection on the samples"): draw s positions uniformly with replacement
    (position j = SplitMix64(seed + (j + 1) * 0x9E3779B97F4A7C15) mod n, reproducible on the
    CUDA twin) and return the k_s-th largest |x| of the sample with k_s = ceil(k * s / n), the
    same quantile of the sample as k is of x. Rounding k_s up biases the estimate slightly low,
    so it selects at least about k entries.

    Measured error (bench/kernels.py: float32 gradients of a 563,818-parameter MLP+CNN after one
    backward pass, tiled to n; density 1 %; default sample; 20 seeds):

    ============  ========  ===========================  ==============================
    n             s         median (max) |est/exact - 1|  count_above(x, est) / k
    ============  ========  ===========================  ==============================
    2**20         10,486    1.6 % (4.7 %)                0.86 - 1.17 (median 1.01)
    25,000,000    250,000   0.46 % (1.3 %)               0.97 - 1.04 (median 1.00)
    ============  ========  ===========================  ==============================

    The spread of the selected count shrinks like sqrt(1 / (ρ s)). See docs/performance.md
    ("Kernels").
    """
    x = as_values("x", x)
    n = x.shape[0]
    k = _validate.check_k(k, n)
    s = _validate.check_sample_size(sample_size)
    seed = _validate.check_seed(seed)
    if k == 0:
        return math.inf
    if s is None:
        s = max(int(config.THRESHOLD_SAMPLE_MIN), math.ceil(config.THRESHOLD_SAMPLE_FRACTION * n))
    bits, mask, _, nan_key = key_view(x)
    if s >= n:
        T = _kth_key(bits, k, mask, nan_key, x.dtype)
    else:
        sample = _sample_bits(bits, s, np.uint64(seed))
        k_s = min(s, max(1, -((-k * s) // n)))  # ceil(k * s / n)
        T = _kth_key(sample, k_s, mask, nan_key, x.dtype)
    return float(key_to_value(T, x.dtype))
