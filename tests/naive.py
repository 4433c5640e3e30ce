"""Slow, obviously correct NumPy references of every kernel in ``spardl_kernels``.

Same names and signatures as the kernels; no validation beyond what the formulas need. Each one
spells out the contract of docs/design.md §3 as directly as possible, so a fast kernel is tested by
comparing with it bit for bit.
"""

import math

import numpy as np


def _abs64(x):
    """|x| as float64 (exact for every value dtype); -0.0 becomes 0.0."""
    return np.abs(np.asarray(x).astype(np.float64)) + 0.0


def _order(x):
    """Positions of x in the contract's total order: larger |x| first, NaN above +inf,
    ties to the lower index."""
    a = _abs64(x)
    nan = np.isnan(a)
    key = np.where(nan, 0.0, a)
    # np.lexsort sorts by the last key first: NaN first, then larger |x|, then lower index
    return np.lexsort((np.arange(a.shape[0]), -key, ~nan))


def topk_abs(x, k, *, index_dtype=np.int64):
    x = np.asarray(x)
    idx = np.sort(_order(x)[:k]).astype(index_dtype)
    return idx, x[idx]


def kth_largest_abs(x, k):
    x = np.asarray(x)
    v = x[_order(x)[k - 1]]
    if np.isnan(v):
        return x.dtype.type(np.nan)
    return x.dtype.type(abs(v) + x.dtype.type(0))  # -0.0 -> 0.0


def _above(x, threshold):
    a = _abs64(x)
    return np.isnan(a) | (a >= float(threshold))


def select_above(x, threshold, *, index_dtype=np.int64):
    x = np.asarray(x)
    idx = np.flatnonzero(_above(x, threshold)).astype(index_dtype)
    return idx, x[idx]


def count_above(x, threshold):
    return int(np.count_nonzero(_above(x, threshold)))


def _splitmix64(seed, j):
    mask = (1 << 64) - 1
    z = (seed + (j + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def estimate_threshold(x, k, *, sample_size=None, seed=0):
    """The documented estimator, spelled out: k_s-th largest |x| of s positions drawn by
    SplitMix64 (with replacement), k_s = ceil(k s / n). Needs an explicit sample_size."""
    x = np.asarray(x)
    n = x.shape[0]
    if k == 0:
        return math.inf
    s = sample_size
    if s >= n:
        return float(kth_largest_abs(x, k))
    pos = [_splitmix64(seed % (1 << 64), j) % n for j in range(s)]
    k_s = min(s, max(1, math.ceil(k * s / n)))
    return float(kth_largest_abs(x[pos], k_s))


def _sum_dtype(dtype):
    """The scalar type sums are done in: float32 for float16, else the dtype itself."""
    return np.float32 if dtype == np.float16 else np.dtype(dtype).type


def merge_add(ia, va, ib, vb):
    acc = {}
    dt = np.asarray(va).dtype
    sd = _sum_dtype(dt)
    for i, v in zip(np.asarray(ia).tolist(), np.asarray(va).astype(sd), strict=True):
        acc[i] = v
    for i, v in zip(np.asarray(ib).tolist(), np.asarray(vb).astype(sd), strict=True):
        acc[i] = sd(acc[i] + v) if i in acc else v
    keys = sorted(acc)
    idt = np.result_type(np.asarray(ia).dtype, np.asarray(ib).dtype)
    vals = np.array([acc[i] for i in keys], dtype=sd).astype(dt)
    return np.array(keys, dtype=idt), vals


def coalesce(indices, values):
    indices = np.asarray(indices)
    values = np.asarray(values)
    sd = _sum_dtype(values.dtype)
    acc = {}
    for i, v in zip(indices.tolist(), values.astype(sd), strict=True):
        acc[i] = sd(acc[i] + v) if i in acc else v  # position order
    keys = sorted(acc)
    vals = np.array([acc[i] for i in keys], dtype=sd).astype(values.dtype)
    return np.array(keys, dtype=indices.dtype), vals


def uniform_bounds(n, P):
    q, r = divmod(n, P)
    return np.array([p * q + min(p, r) for p in range(P + 1)], dtype=np.int64)


def balanced_bounds(indices, n, P):
    s = sorted(np.asarray(indices).tolist())
    m = len(s)
    if m == 0:
        return uniform_bounds(n, P)
    return np.array([0] + [s[(p * m) // P] for p in range(1, P)] + [n], dtype=np.int64)


def block_offsets(indices, bounds):
    return np.searchsorted(np.asarray(indices), np.asarray(bounds), side="left").astype(np.int64)


def scatter_add(dense, indices, values):
    dense = np.asarray(dense)
    sd = _sum_dtype(dense.dtype)
    acc = {}
    for i, v in zip(np.asarray(indices).tolist(), np.asarray(values).astype(sd), strict=True):
        if i not in acc:
            acc[i] = sd(dense[i])
        acc[i] = sd(acc[i] + v)
    for i, v in acc.items():
        dense[i] = v
    return dense


def gather(dense, indices):
    return np.asarray(dense)[np.asarray(indices)]


def accumulate_topk(g, e, ks, bounds, *, out=None):
    x = np.asarray(g).astype(e.dtype) + e
    if out is not None:
        out[:] = x
        x = out
    parts = [topk_abs(x[lo:hi], k) for lo, hi, k in zip(bounds[:-1], bounds[1:], ks, strict=True)]
    idx = [i + lo for (i, _), lo in zip(parts, bounds[:-1], strict=True)]
    return (
        x,
        np.concatenate([np.empty(0, np.int64), *idx]),
        np.concatenate([np.empty(0, x.dtype), *(v for _, v in parts)]),
    )
