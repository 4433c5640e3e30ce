"""Slow, obviously correct single-process references of one step of the peers.

All P ranks are simulated in one loop with plain NumPy and the kernel references of
``tests/naive.py``. Each function takes every rank's accumulated gradient X_r = g_r + E_r,old
(work dtype: float32 or float64) and returns the SUM over ranks (before ``op`` divides), with the
ranks' new residuals, so an MPI run can be compared with it bit for bit.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import naive
import numpy as np


def _zeroed(x, positions):
    e = np.array(x, copy=True)
    e[np.asarray(positions, dtype=np.int64)] = 0
    return e


def ref_topka(xs, k):
    """TopkA: every rank's top-k, summed in rank order; E_r = X_r with its top-k zeroed."""
    sel = [naive.topk_abs(x, k) for x in xs]
    idx, val = naive.coalesce(
        np.concatenate([s[0] for s in sel]), np.concatenate([s[1] for s in sel])
    )
    return idx, val, [_zeroed(x, s[0]) for x, s in zip(xs, sel, strict=True)]


def ref_gaussiank_threshold(x, k, corrections=4):
    """The documented Gaussian-k threshold, with the folded-normal quantile from NormalDist."""
    n = len(x)
    mu = float(np.mean(np.asarray(x, np.float64)))
    sigma = float(np.std(np.asarray(x, np.float64)))
    if not (math.isfinite(mu) and math.isfinite(sigma)):
        return None
    q = k / n
    if q >= 1:
        t = 0.0
    elif sigma == 0:
        t = abs(mu)
    else:
        nd = NormalDist(mu, sigma)

        def tail(t):
            return (1 - nd.cdf(t)) + nd.cdf(-t)

        lo, hi = 0.0, abs(mu) + 40 * sigma
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if tail(mid) > q else (lo, mid)
    if q < 1 and sigma != 0:
        t = hi
    few = many = None
    for _ in range(corrections):
        c = naive.count_above(x, t)
        if c < 2 * k / 3:
            few = t
            t = math.sqrt(t * many) if many is not None else t / 2
        elif c > 4 * k / 3:
            many = t
            t = math.sqrt(t * few) if few is not None else 1.5 * t
        else:
            break
    return t


def ref_gaussiank_select(x, k, corrections=4):
    """What one rank sends under Gaussian-k (threshold, or the exact top-k above 2k)."""
    t = ref_gaussiank_threshold(x, k, corrections)
    if t is None or naive.count_above(x, t) > 2 * k:
        return naive.topk_abs(x, k)
    return naive.select_above(x, t)


def ref_gaussiank(xs, k, corrections=4):
    """Gaussian-k: each rank's threshold selection, then as TopkA."""
    sel = [ref_gaussiank_select(x, k, corrections) for x in xs]
    idx, val = naive.coalesce(
        np.concatenate([s[0] for s in sel]), np.concatenate([s[1] for s in sel])
    )
    return idx, val, [_zeroed(x, s[0]) for x, s in zip(xs, sel, strict=True)]


def ref_topkdsa(xs, k):
    """SparCML DSA: region b sums contributions in the order b, b−1, …, b−P+1 (mod P), sparse
    until nnz·(isz + vsz) ≥ len·vsz (isz = 4), then dense (all coordinates of the region)."""
    P, n = len(xs), len(xs[0])
    sel = [naive.topk_abs(x, k) for x in xs]
    bounds = naive.uniform_bounds(n, P)
    vsz = xs[0].dtype.itemsize
    out_i, out_v = [], []
    for b in range(P):
        lo, hi = int(bounds[b]), int(bounds[b + 1])

        def part(r, lo=lo, hi=hi):
            i, v = sel[r]
            m = (i >= lo) & (i < hi)
            return i[m], v[m]

        acc_i, acc_v = part(b)
        dense = None
        for s in range(P):
            if s > 0:
                got_i, got_v = part((b - s) % P)
                if dense is None:
                    acc_i, acc_v = naive.merge_add(acc_i, acc_v, got_i, got_v)
                else:
                    dense = naive.scatter_add(dense, got_i - lo, got_v)
            if dense is None and len(acc_i) * (4 + vsz) >= (hi - lo) * vsz:
                dense = naive.scatter_add(np.zeros(hi - lo, xs[0].dtype), acc_i - lo, acc_v)
        if dense is None:
            out_i.append(np.asarray(acc_i, np.int64))
            out_v.append(np.asarray(acc_v, xs[0].dtype))
        else:
            out_i.append(np.arange(lo, hi, dtype=np.int64))
            out_v.append(dense)
    res = [_zeroed(x, s[0]) for x, s in zip(xs, sel, strict=True)]
    return np.concatenate(out_i), np.concatenate(out_v), res


def ref_gtopk(xs, k):
    """gTop-k: binomial tree to rank 0 (round j: r receives from r + 2^j), merge with the
    receiver's pairs first, keep top-k; returns (indices, sums, residuals, dropped mass).

    Residual: X_r with r's own top-k zeroed only where the coordinate is in the final output."""
    P = len(xs)
    sel = [naive.topk_abs(x, k) for x in xs]
    held = {r: sel[r] for r in range(P)}
    dropped = 0.0
    d = 1
    while d < P:
        for r in range(0, P, 2 * d):
            if r + d < P:
                (ia, va), (ib, vb) = held[r], held.pop(r + d)
                mi, mv = naive.merge_add(ia, va, ib, vb)
                pos, _ = naive.topk_abs(mv, k)
                gone = np.setdiff1d(np.arange(len(mv)), pos)
                dropped += float(np.sum(np.abs(mv[gone].astype(np.float64))))
                held[r] = (mi[pos], mv[pos])
        d *= 2
    idx, val = held[0]
    final = set(idx.tolist())
    res = [
        _zeroed(x, [i for i in s[0].tolist() if i in final]) for x, s in zip(xs, sel, strict=True)
    ]
    return idx, val, res, dropped


REFERENCES = {
    "topka": ref_topka,
    "gaussiank": ref_gaussiank,
    "topkdsa": ref_topkdsa,
    "gtopk": lambda xs, k: ref_gtopk(xs, k)[:3],
}
