"""Slow, obviously correct NumPy references of every kernel in ``spardl_kernels``.

Same names and signatures as the kernels; no validation beyond what the formulas need. Each one
spells out the contract of docs/design.md §3 as directly as possible, so a fast kernel is tested by
comparing with it bit for bit.

NaN (docs/design.md §3.4): a value the contract computes by arithmetic (a sum, a quotient, the
float16 rounding of a float32 sum) that is NaN is the canonical NaN of its dtype, spelled out
below as bits; a value the contract copies keeps its bits. The references therefore keep copies
as bit patterns and round sums explicitly, so that NumPy's own float16 conversions (which may
quiet a signalling NaN) never touch a copied value.
"""

import math

import numpy as np

# The canonical NaN of each value dtype (quiet, positive, zero payload), as unsigned bits.
CANONICAL_NAN_BITS = {
    np.dtype(np.float16): 0x7E00,
    np.dtype(np.float32): 0x7FC00000,
    np.dtype(np.float64): 0x7FF8000000000000,
}
UNSIGNED = {
    np.dtype(np.float16): np.uint16,
    np.dtype(np.float32): np.uint32,
    np.dtype(np.float64): np.uint64,
}


def canonical_nan(dtype):
    """The canonical NaN of ``dtype`` as a NumPy scalar."""
    dtype = np.dtype(dtype)
    return np.array([CANONICAL_NAN_BITS[dtype]], UNSIGNED[dtype]).view(dtype)[0]


def bits(a):
    """The bit patterns of a float array, as unsigned integers (a new array)."""
    a = np.ascontiguousarray(a)
    return a.view(UNSIGNED[a.dtype]).copy()


def _computed(s, dtype):
    """The bits of a computed value s (a sum in the sum dtype) stored as ``dtype``: rounded once
    to nearest, the canonical NaN if NaN."""
    dtype = np.dtype(dtype)
    if np.isnan(s):
        return CANONICAL_NAN_BITS[dtype]
    with np.errstate(over="ignore"):
        return int(np.array([s]).astype(dtype).view(UNSIGNED[dtype])[0])


def canonicalize(a):
    """A copy of the float array a with every NaN replaced by the canonical NaN."""
    a = np.array(a)
    a[np.isnan(a)] = canonical_nan(a.dtype)
    return a


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


# -- the compact wire codec (spardl_kernels/cpu/wire.py; docs/design.md §2.1) ------------------
# Exact arithmetic (Fraction) and byte strings, straight from the format's description.


def _ladder(v, w):
    out = b""
    while w < 8:
        if v < 2 ** (8 * w) - 1:
            return out + v.to_bytes(w, "little")
        out += (2 ** (8 * w) - 1).to_bytes(w, "little")
        w *= 2
    return out + v.to_bytes(8, "little")


def _read_ladder(buf, p, w):
    while True:
        if p + w > len(buf):
            raise ValueError("truncated")
        v = int.from_bytes(bytes(buf[p : p + w]), "little")
        p += w
        if w == 8 or v < 2 ** (8 * w) - 1:
            return v, p
        w *= 2


_WIRE_FORMATS = {1: (10, 15, 15), 2: (7, 127, 127)}  # code -> (fraction bits, bias, T)


def _code16(v, M, B, s):
    """The 16-bit code of the float v·2^s, rounded to nearest even."""
    from fractions import Fraction

    sign = 0x8000 if math.copysign(1.0, v) < 0 else 0
    y = abs(Fraction(v)) * Fraction(2) ** s
    if y == 0:
        return sign
    emin = 1 - B
    E = y.numerator.bit_length() - y.denominator.bit_length()  # within one of ⌊log₂ y⌋
    while Fraction(2) ** E > y:
        E -= 1
    while Fraction(2) ** (E + 1) <= y:
        E += 1
    q = Fraction(2) ** (max(E, emin) - M)
    r = round(y / q)  # Fraction rounds half to even
    if E < emin:
        return sign | r
    return sign | (((E + B) << M) + r - (1 << M))


def _magnitude16(h, M, B, s):
    """|value| of the 16-bit code h times 2^−s, exactly (a Fraction)."""
    from fractions import Fraction

    eb, man = (h >> M) & ((1 << (15 - M)) - 1), h & ((1 << M) - 1)
    if eb == 0:
        return Fraction(man) * Fraction(2) ** (1 - B - M - s)
    return Fraction(man + (1 << M)) * Fraction(2) ** (eb - B - M - s)


def _value16(h, M, B, s):
    f = float(_magnitude16(h, M, B, s))  # correctly rounded
    return -f if h & 0x8000 else f


def encode_blocks(indices, values, counts, *, quantise=True):
    from fractions import Fraction

    indices = np.asarray(indices).astype(np.int64)
    values = np.asarray(values)
    dt = values.dtype
    out = bytearray()
    dec = []
    pos = 0
    for c in np.asarray(counts).tolist():
        rel = indices[pos : pos + c].tolist()
        val = values[pos : pos + c]
        pos += c
        out += _ladder(c, 1)
        if c == 0:
            continue
        gaps = [rel[0]] + [b - a - 1 for a, b in zip(rel, rel[1:], strict=False)]
        if any(g < 0 for g in gaps):
            raise ValueError("indices")
        if rel == list(range(c)):
            icode, ibytes = 5, b""
        else:
            options = [b"".join(_ladder(g, 1 << w) for g in gaps) for w in range(4)]
            icode = min(range(4), key=lambda i: (len(options[i]), i))
            if rel[-1] // 8 + 1 < len(options[icode]):
                bitmap = bytearray(rel[-1] // 8 + 1)
                for r in rel:
                    bitmap[r // 8] |= 1 << (r % 8)
                options.append(bytes(bitmap))
                icode = 4
            ibytes = options[icode]
        mags = [abs(float(v)) for v in val]
        if not quantise or not all(math.isfinite(a) for a in mags):
            vcode, s = 0, 0
        elif max(mags) == 0:
            vcode, s = 1, 0
        else:
            amax = Fraction(max(mags))
            e = 0
            while Fraction(2) ** e < amax:
                e += 1
            while Fraction(2) ** (e - 1) >= amax:
                e -= 1
            amin = min(Fraction(a) for a in mags if a > 0)
            normal = amin * Fraction(2) ** (15 - e) >= Fraction(2) ** -14
            vcode, s = (1, 15 - e) if normal else (2, 127 - e)
        out += bytes([icode | (vcode << 4)])
        if vcode:
            out += (s & 0xFFFF).to_bytes(2, "little")
        out += ibytes
        if vcode == 0:
            out += val.astype(dt.newbyteorder("<")).tobytes()
            dec += val.tolist()
        else:
            M, B, _ = _WIRE_FORMATS[vcode]
            top = Fraction(float(np.finfo(dt).max))
            for v in val.tolist():
                h = _code16(v, M, B, s)
                if _magnitude16(h, M, B, s) > top:
                    h -= 1  # it would decode past the dtype's largest value: toward zero
                out += h.to_bytes(2, "little")
                dec.append(_value16(h, M, B, s))
    return np.frombuffer(bytes(out), np.uint8), np.array(dec, dtype=dt)


def decode_blocks(buf, nblocks, value_dtype):
    buf = bytes(np.asarray(buf, np.uint8))
    dt = np.dtype(value_dtype)
    counts, rel, vals = [], [], []
    p = 0
    for _ in range(nblocks):
        c, p = _read_ladder(buf, p, 1)
        counts.append(c)
        if c == 0:
            continue
        code = buf[p]
        p += 1
        icode, vcode = code & 0xF, code >> 4
        if vcode:
            s = int.from_bytes(buf[p : p + 2], "little", signed=True)
            p += 2
        if icode == 5:
            rel += list(range(c))
        elif icode == 4:
            got = []
            t = 0
            while len(got) < c:
                got += [8 * t + b for b in range(8) if buf[p + t] >> b & 1]
                t += 1
            rel += got
            p += t
        else:
            prev = -1
            for _ in range(c):
                g, p = _read_ladder(buf, p, 1 << icode)
                prev += 1 + g
                rel.append(prev)
        if vcode == 0:
            vals += np.frombuffer(buf[p : p + c * dt.itemsize], dt.newbyteorder("<")).tolist()
            p += c * dt.itemsize
        else:
            M, B, _ = _WIRE_FORMATS[vcode]
            for j in range(c):
                h = int.from_bytes(buf[p + 2 * j : p + 2 * j + 2], "little")
                vals.append(_value16(h, M, B, s))
            p += 2 * c
    if p != len(buf):
        raise ValueError("trailing bytes")
    return np.array(counts, np.int64), np.array(rel, np.int64), np.array(vals, dt)


def _sum_dtype(dtype):
    """The scalar type sums are done in: float32 for float16, else the dtype itself."""
    return np.float32 if dtype == np.float16 else np.dtype(dtype).type


def _sparse_sums(pairs, dt):
    """{index: bits as dt} for (index, value bits, value in the sum dtype) pairs in order: a
    lone value keeps its bits, several are summed left to right and rounded once."""
    sd = _sum_dtype(dt)
    terms = {}
    for i, b, v in pairs:
        terms.setdefault(i, []).append((b, v))
    out = {}
    for i, t in terms.items():
        if len(t) == 1:
            out[i] = t[0][0]
        else:
            acc = t[0][1]
            for _, v in t[1:]:
                acc = sd(acc + v)
            out[i] = _computed(acc, dt)
    return out


def _triples(indices, values):
    values = np.asarray(values)
    wide = values.astype(_sum_dtype(values.dtype))
    return zip(np.asarray(indices).tolist(), bits(values).tolist(), wide, strict=True)


def merge_add(ia, va, ib, vb):
    dt = np.asarray(va).dtype
    # a's entries first, so a meeting pair sums a + b
    acc = _sparse_sums([*_triples(ia, va), *_triples(ib, vb)], dt)
    keys = sorted(acc)
    idt = np.result_type(np.asarray(ia).dtype, np.asarray(ib).dtype)
    vals = np.array([acc[i] for i in keys], UNSIGNED[dt]).view(dt)
    return np.array(keys, dtype=idt), vals


def coalesce(indices, values):
    indices = np.asarray(indices)
    values = np.asarray(values)
    acc = _sparse_sums(_triples(indices, values), values.dtype)  # position order
    keys = sorted(acc)
    vals = np.array([acc[i] for i in keys], UNSIGNED[values.dtype]).view(values.dtype)
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
    out = dense.view(UNSIGNED[dense.dtype])
    for i, v in acc.items():
        out[i] = _computed(v, dense.dtype)
    return dense


def gather(dense, indices):
    return np.asarray(dense)[np.asarray(indices)]


def accumulate_topk(g, e, ks, bounds, *, out=None):
    x = canonicalize(np.asarray(g).astype(e.dtype) + e)
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


def accumulate_above(g, e, threshold, *, out=None):
    x = canonicalize(np.asarray(g).astype(e.dtype) + e)
    if out is not None:
        out[:] = x
        x = out
    idx, vals = select_above(x, threshold)
    return x, idx, vals


def divide_max_abs(x, s, out):
    """``spardl_kernels.cpu.arrays.divide_max_abs``: out = x / s, NaN canonical; the largest
    |quotient|, inf when one is not finite."""
    out[:] = canonicalize(x / x.dtype.type(s))
    if not np.all(np.isfinite(out)):
        return np.inf
    return float(np.abs(out).max()) if len(out) else 0.0


def canonical_count_nonfinite(x):
    """``spardl_kernels.cpu.arrays.canonical_count_nonfinite``."""
    x[:] = canonicalize(x)
    return int((~np.isfinite(x)).sum())
