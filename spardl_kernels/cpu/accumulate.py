"""Accumulate and select in one pass: X = g + E and the top-k of chosen blocks of X, or every
entry of X above a threshold (CPU).

Error feedback (docs/design.md §4) starts every step with X = g + E over the whole gradient and
then selects the top-k of X (or of blocks of it). Done apart, that is three streams of n values
for the sum and one or two more reads of X for the selection. Here the selection's window pass
(:func:`spardl_kernels.cpu.select.topk_abs`: a sampled bracket of the k-th largest key, then one
pass collecting the keys inside and above it) runs inside the summing loop, on each block of 64
sums while they are still in registers and cache. The bracket is sampled from g + E at the
sample positions before the pass; if it missed (rare, and verified exactly), the block is
selected again from the finished X, so the result never depends on the sample.

:func:`accumulate_above` does the same for a threshold selection (a threshold reused between
exact top-k, as Ok-Topk's): the entries of X at or above it are collected 64 sums at a time in
the summing loop.
"""

import numpy as np
from numba import njit

from .. import _validate, config
from .._contract import threshold_key
from ._common import JIT, as_values, canonical, in_place, key_view, scratch
from ._simd import float_bits, store_fence, stream_head, sum_mask
from .select import (
    _bracket,
    _digits,
    _float_args,
    _float_test,
    _key,
    _low_bit,
    _sample_position,
    _select_ge,
    _topk_into,
    _window_buffers,
    _window_finish,
    _window_sample_size,
    _window_scan,
)


@njit(**JIT)
def _add(g, e, x, start, stop):
    # slices indexed from 0: Numba then drops the negative-index test and the loop vectorises
    # (the canonical NaN is a compare and a select: it vectorises too)
    gp = g[start:stop]
    ep = e[start:stop]
    xp = x[start:stop]
    for i in range(stop - start):
        xp[i] = canonical(gp[i] + ep[i])


# float16 gradients are widened to float32 in chunks of this many entries (a buffer that stays
# in cache) before the compiled sum.
_WIDEN_CHUNK = 1 << 15


def _add_widened(g, e, x):
    """x = float32(g) + e for a float16 g, in cache-sized chunks (Numba has no float16 on the
    CPU). The widening's NaN payload does not matter: a NaN sum is written canonical."""
    n = g.shape[0]
    buf = np.empty(min(n, _WIDEN_CHUNK), np.float32)
    for lo in range(0, n, _WIDEN_CHUNK):
        hi = min(n, lo + _WIDEN_CHUNK)
        w = buf[: hi - lo]
        np.copyto(w, g[lo:hi])
        _add(w, e[lo:hi], x[lo:hi], 0, hi - lo)


@njit(**JIT)
def _sample_sums(g, e, start, stop, s, nan_key, mask, key_dtype):
    """Keys of g + e at the s strided sample positions of [start, stop)."""
    n = stop - start
    sums = np.empty(s, e.dtype)
    for j in range(s):
        p = start + _sample_position(j, n, s)
        sums[j] = g[p] + e[p]
    bits = sums.view(key_dtype)
    keys = np.empty(s, np.int64)
    for j in range(s):
        keys[j] = _key(bits[j], mask, nan_key)
    return keys


def _output(out, g, e, n, work):
    """Where X goes: ``out`` once checked (shape (n,), the work dtype, writeable, sharing no
    memory with g or e), or a new array."""
    if out is None:
        return np.empty(n, work)
    x = as_values("out", in_place(out, "out"))
    overlaps = np.shares_memory(x, g) or np.shares_memory(x, e)
    _validate.check_accumulate_out(x.shape, x.dtype, n, work, x.flags.writeable, overlaps)
    return x


def accumulate_topk(g, e, ks, bounds, *, out=None):
    """X = g + E, and the top-k of chosen blocks of X, in one pass over the gradient.

    Parameters
    ----------
    g : ndarray of shape (n,), float16, float32 or float64
        The gradient (anything NumPy views without copying).
    e : ndarray of shape (n,)
        The residual, in g's work dtype: float32 for a float16 g, else g's dtype.
    ks : int array of shape (B,)
        ks[b] entries are selected from block b = [bounds[b], bounds[b+1]); 0 selects nothing.
    bounds : int array of shape (B + 1,)
        Block boundaries, rising from 0 to n.
    out : ndarray of shape (n,), e.dtype, optional
        Where X is written (sharing no memory with g or e); a new array when None.

    Returns
    -------
    x : ndarray of shape (n,), e.dtype
        g converted exactly to e.dtype, plus e (one rounding per entry); a NaN sum is the
        canonical NaN (docs/design.md §3.4).
    indices : int64 ndarray of shape (sum(ks),)
        Absolute positions, block by block, ascending within each block (so ascending).
    values : ndarray of shape (sum(ks),), e.dtype
        ``x[indices]``, bit for bit.

    Raises
    ------
    TypeError
        g or e not float16/32/64, or e's dtype not g's work dtype; ks or bounds not integer
        arrays.
    ValueError
        g or e not 1-D, lengths differ; bounds not rising from 0 to n; ks of another length or
        outside [0, block length]; out of another shape or dtype, or sharing memory with g or e.

    Notes
    -----
    The same result as ``x = g.astype(e.dtype) + e`` (a NaN made canonical) followed by
    ``topk_abs(x[lo:hi], ks[b])`` (shifted by lo) for every block, bit for bit, under the kernel
    contract's order (docs/design.md §3: larger |x| first, NaN above +inf, ties to the lower
    index). Blocks of at
    least ``config.WINDOW_MIN_N`` entries select inside the summing loop; float16 gradients,
    small blocks and blocks whose sampled window missed are summed first and then selected by
    :func:`topk_abs`'s own path.
    """
    g = as_values("g", g)
    e = as_values("e", e)
    n = g.shape[0]
    work, ks, bounds = _validate.check_accumulate(g.dtype, e.dtype, e.shape[0], n, ks, bounds)
    x = _output(out, g, e, n, work)
    total = int(ks.sum())
    indices = np.empty(total, np.int64)
    values = np.empty(total, work)
    fused = g.dtype == work and config.WINDOW_SELECT
    stream = x.nbytes >= config.STREAM_STORE_MIN_BYTES
    if not fused:
        if g.dtype == work:
            _add(g, e, x, 0, n)
        else:
            _add_widened(g, e, x)
    xb, mask, _, nan_key = key_view(x)
    _, normal_key, inf_key = _float_args(xb, work)
    digits = _digits(work)
    lanes = int(config.HIST_LANES)
    cutoff = int(config.SMALL_N_CUTOFF)
    vbits = values.view(xb.dtype)
    o = 0
    for b in range(ks.shape[0]):
        lo_b, hi_b, k = int(bounds[b]), int(bounds[b + 1]), int(ks[b])
        length = hi_b - lo_b
        sel_i, sel_v = indices[o : o + k], vbits[o : o + k]
        o += k
        done = False
        if fused and 0 < k < length and length >= config.WINDOW_MIN_N:
            s = _window_sample_size(length)
            keys = _sample_sums(g, e, lo_b, hi_b, s, nan_key, mask, xb.dtype)
            lo, hi, cap = _bracket(keys, length, k, nan_key, config.WINDOW_SIGMAS)
            if lo != 0 and cap <= length // 4:
                t, usable = _float_test(lo, xb, x, normal_key, inf_key)
                found = _window_buffers(k, cap, xb.dtype)
                ok, n_def, m, found = _window_scan(
                    g, e, x, x, xb, lo_b, hi_b, True, stream, k, mask, nan_key, lo, hi, cap, t,
                    usable, found,
                )  # fmt: skip
                if ok:
                    _window_finish(k, nan_key, digits, lanes, cutoff, n_def, m, found, sel_i, sel_v)
                    sel_i += lo_b
                    continue
                done = True  # summed, but the window missed
        if fused and not done:
            _add(g, e, x, lo_b, hi_b)
        if k == length:
            sel_i[:] = np.arange(lo_b, hi_b)
            sel_v[:] = xb[lo_b:hi_b]
        elif k > 0:
            _topk_into(xb[lo_b:hi_b], k, mask, nan_key, work, sel_i, sel_v)
            sel_i += lo_b
    return x, indices, values


@njit(**JIT)
def _sum_above(g, e, x, bits, K, mask, t, usable, stream, idx, vals):
    """x = g + e (a NaN sum canonical) and, in the same loop, every (i, bits[i]) with
    key(x_i) >= K into idx, vals (their length is the room); returns the number of such
    entries, which may exceed the room (then only the first ones are written). The key test is
    the float compare ``not (|x_i| < t)`` with ``usable`` (see select.py's ``_float_test``),
    else the integer one, on the sums in registers; each hit is filed without a branch into
    one slot more than the room holds. ``stream``: non-temporal stores, blocks from x's first
    64-byte boundary (select.py's ``_window_scan``)."""
    n = g.shape[0]
    room = idx.shape[0] - 1
    K_t = bits.dtype.type(K)
    mask_t = bits.dtype.type(mask)
    c = 0
    head = stream_head(x, n, stream)
    first = 1 if head > 0 else 0
    # the head's mask before the loop, as in _window_scan (a sixth of the speed otherwise)
    m_head = sum_mask(g, e, x, 0, head, stream, usable, t, K_t, mask_t)
    for b in range(first + (n - head + 63) // 64):
        if b < first:
            s = 0
            m = m_head
        else:
            s = head + (b - first) * 64
            m = sum_mask(g, e, x, s, min(s + 64, n), stream, usable, t, K_t, mask_t)
        while m:
            l, m = _low_bit(m)
            j = min(c, room)
            i = s + l
            idx[j] = i
            vals[j] = float_bits(canonical(g[i] + e[i]))
            c += 1
    store_fence()
    return c


def accumulate_above(g, e, threshold, *, out=None):
    """X = g + E, and every entry of X with |x_i| >= threshold, in one pass over the gradient.

    Parameters
    ----------
    g : ndarray of shape (n,), float16, float32 or float64
        The gradient (anything NumPy views without copying).
    e : ndarray of shape (n,)
        The residual, in g's work dtype: float32 for a float16 g, else g's dtype.
    threshold : float
        Compared with |x_i| as a float64 number, as :func:`select_above` compares it: NaN
        entries count as above every threshold, a NaN threshold selects the NaN entries only,
        threshold <= 0 selects all.
    out : ndarray of shape (n,), e.dtype, optional
        Where X is written (sharing no memory with g or e); a new array when None.

    Returns
    -------
    x : ndarray of shape (n,), e.dtype
        g converted exactly to e.dtype, plus e (one rounding per entry); a NaN sum is the
        canonical NaN (docs/design.md §3.4).
    indices : int64 ndarray of shape (m,)
        Ascending positions of the selected entries of x.
    values : ndarray of shape (m,), e.dtype
        ``x[indices]``, bit for bit.

    Raises
    ------
    TypeError
        g or e not float16/32/64, or e's dtype not g's work dtype; threshold not a real number.
    ValueError
        g or e not 1-D, lengths differ; out of another shape or dtype, or sharing memory with g
        or e.

    Notes
    -----
    The same result as ``x = g.astype(e.dtype) + e`` (a NaN made canonical) followed by
    ``select_above(x, threshold)``, bit for bit (docs/design.md §3). The entries are collected
    while each block of 64 sums is in cache, into room for ``config.SELECT_INITIAL_FRACTION``
    of n; if more pass, they are selected from the finished X by :func:`select_above`'s own
    path (one more read of X). Float16 gradients are summed first, then selected.
    """
    g = as_values("g", g)
    e = as_values("e", e)
    n = g.shape[0]
    t = _validate.check_threshold(threshold)
    work = _validate.check_accumulated(g.dtype, e.dtype, e.shape[0], n)
    x = _output(out, g, e, n, work)
    xb, mask, _, _ = key_view(x)
    K = threshold_key(t, work)
    if g.dtype != work:  # float16: no fused path (Numba has no float16 on the CPU)
        _add_widened(g, e, x)
        idx, vb = _select_ge(xb, K, mask, np.dtype(np.int64))
        return x, idx, vb.view(work)
    _, normal_key, inf_key = _float_args(xb, work)
    tf, usable = _float_test(K, xb, x, normal_key, inf_key)
    room = int(min(n, n * config.SELECT_INITIAL_FRACTION + config.SELECT_CHUNK))
    # per-thread scratch, as select_above's first try: no page faults on every call
    idx = scratch("accumulate_above idx", room + 1, np.int64)
    vb = scratch("accumulate_above vals", room + 1, xb.dtype)
    stream = x.nbytes >= config.STREAM_STORE_MIN_BYTES
    c = int(_sum_above(g, e, x, xb, K, mask, tf, usable, stream, idx, vb))
    if c > room:  # more than the room: select from the finished X
        idx, vb = _select_ge(xb, K, mask, np.dtype(np.int64))
        return x, idx, vb.view(work)
    return x, idx[:c].copy(), vb[:c].view(work).copy()
