"""The compact wire codec (docs/design.md §2.1): sparse blocks to bytes and back, on the host.

Not one of the kernels of the contract: no CUDA twin. The layer above (``spardl.comm``)
stages device blocks through the host, as it does for every message that goes to MPI.

A message is ``nblocks`` block records, one after the other, with no padding. A record is

* the pair count c, as a *ladder* number starting at 1 byte (below);
* for c > 0: one code byte, ``index_code | value_code << 4``;
* for a 16-bit value code: the scale exponent s, int16 little-endian;
* the index section (``index_code``), then the value section (``value_code``).

Indices are block-relative, strictly ascending and ≥ 0. The index codes are

* ``LADDER_1``, ``LADDER_2``, ``LADDER_4``, ``LADDER_8`` (0–3): the gaps g₀ = i₀,
  g_j = i_j − i_(j−1) − 1, each a ladder number starting at 1, 2, 4 or 8 bytes;
* ``BITMAP`` (4): bit i (LSB first in each byte) of ⌊i_last/8⌋ + 1 bytes is set for each index;
* ``PREFIX`` (5): the indices are 0 … c−1 (a full or leading block): no bytes at all.

The encoder takes whichever is smallest for the block (ties: the lowest code). A *ladder*
number v starting at width w (1, 2, 4 or 8 bytes) is written in w bytes little-endian if
v < 2^(8w) − 1; otherwise w bytes of 0xFF (the escape) are written and v goes on at width 2w;
at 8 bytes it is written as it is. So a gap below 255 costs one byte at ``LADDER_1``, one below
65535 three bytes, and so on.

The value codes are

* ``RAW`` (0): the values' own bytes (float32 or float64, little-endian): bit for bit;
* ``FP16`` (1): IEEE binary16 of v·2^s, rounded to nearest (ties to even), 2 bytes each;
* ``BF16`` (2): bfloat16 (8 exponent bits, 7 fraction bits) of v·2^s, rounded the same way.

Choice of the value code, per block: ``RAW`` when ``quantise`` is off or a value is NaN or ±Inf;
else, with e = ⌈log₂ max|v|⌉, ``FP16`` with s = 15 − e when every non-zero |v| is at least
2^(e−29) (every scaled value is then a normal float16 in [2^−14, 2^15]: relative error at most
2^−11), otherwise ``BF16`` with s = 127 − e (range ratio beyond 2^29; relative error at most
2^−8 down to 2^−126 of the largest). An all-zero block is ``FP16`` with s = 0. The scale is a
power of two, so it is exact; only the rounding to 16 bits loses anything, and the decoded value
(what every receiver gets) is returned to the sender too, so that it can keep the difference.
One exception to rounding to nearest: with e one above the value dtype's top binade (e = 128 for
float32, 1024 for float64), a value within half a 16-bit unit of 2^e would round to a code that
decodes as 2^e, past the dtype's largest finite number; it takes the code below instead (rounded
toward zero: less than one unit off, the decoded value finite and in the value's binade, so the
sender's difference stays exact).

Re-encoding what a receiver decoded (a relay in an all-gather) gives back the same values: the
rule picks s from the largest magnitude rounded up to a power of two, which the rounding cannot
move by more than one binade, and the rescaled values stay representable.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ._common import JIT

__all__ = [
    "LADDER_1",
    "LADDER_2",
    "LADDER_4",
    "LADDER_8",
    "BITMAP",
    "PREFIX",
    "RAW",
    "FP16",
    "BF16",
    "encode_blocks",
    "decode_blocks",
    "encoded_capacity",
    "add_remainders",
]

LADDER_1, LADDER_2, LADDER_4, LADDER_8, BITMAP, PREFIX = 0, 1, 2, 3, 4, 5
RAW, FP16, BF16 = 0, 1, 2

_U32_ESC = (1 << 32) - 1
# (fraction bits M, exponent bias B, the exponent target T of the scaled maximum) per code
_M16, _B16, _T16 = 10, 15, 15
_MBF, _BBF, _TBF = 7, 127, 127
#: Error codes of the compiled workers (0: fine).
_E_ORDER, _E_TRUNC, _E_CODE, _E_TRAIL, _E_RANGE = 1, 2, 3, 4, 5


# -- ladder numbers ----------------------------------------------------------------------------
@numba.njit(**JIT)
def _ladder_cost(v, w):
    c = 0
    while w < 8:
        c += w
        if v < (1 << (8 * w)) - 1:
            return c
        w *= 2
    return c + 8


@numba.njit(**JIT)
def _put(buf, p, v, w):
    """Write v (≥ 0) in w bytes, little-endian; the next position."""
    for t in range(w):
        buf[p + t] = (v >> (8 * t)) & 0xFF
    return p + w


@numba.njit(**JIT)
def _put_ladder(buf, p, v, w):
    while w < 8:
        esc = (1 << (8 * w)) - 1
        if v < esc:
            return _put(buf, p, v, w)
        p = _put(buf, p, esc, w)
        w *= 2
    return _put(buf, p, v, 8)


@numba.njit(**JIT)
def _get_ladder(buf, p, w):
    """(v, next position), or (0, -1) for a truncated or out-of-range number."""
    n = buf.shape[0]
    while True:
        if p + w > n:
            return 0, -1
        v = 0
        for t in range(w):
            v |= np.int64(buf[p + t]) << (8 * t)
        p += w
        if w == 8:
            if v < 0:
                return 0, -1
            return v, p
        if v < (1 << (8 * w)) - 1:
            return v, p
        w *= 2


# -- 16-bit values -----------------------------------------------------------------------------
@numba.njit(**JIT)
def _round16(u, M, B):
    """The 15-bit magnitude code of the float64 y ≥ 0 whose bits are u (int64), rounded to
    nearest even in the format with M fraction bits and bias B (y below its overflow)."""
    e64 = u >> 52
    sh = 52 - M
    if e64 - 1023 >= 1 - B:
        # A normal result: round the fraction in place (a carry moves into the exponent), then
        # rebias the exponent.
        r = (u + ((1 << (sh - 1)) - 1) + ((u >> sh) & 1)) >> sh
        return r - ((1023 - B) << M)
    if e64 == 0:
        return 0  # zero or a float64 subnormal: far below the smallest 16-bit subnormal
    shift = sh + (1 - B) - (e64 - 1023)
    if shift >= 54:
        return 0  # below half the smallest subnormal
    sig = (u & ((1 << 52) - 1)) | (1 << 52)
    r = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if rem > half or (rem == half and (r & 1) == 1):
        r += 1
    return r  # 1 << M when it rounds up to the smallest normal: the same code


@numba.njit(**JIT)
def _value16_slow(h, M, B, s):
    """The float64 value of the 16-bit code h in the format (M, B), times 2^−s."""
    ebits_max = (1 << (15 - M)) - 1
    eb = (h >> M) & ebits_max
    man = h & ((1 << M) - 1)
    if eb == ebits_max:
        v = math.inf if man == 0 else math.nan
    elif eb == 0:
        v = math.ldexp(float(man), 1 - B - M - s)
    else:
        v = math.ldexp(float(man + (1 << M)), eb - B - M - s)
    return -v if (h >> 15) & 1 else v


@numba.njit(**JIT)
def _encode16(vbits, vals, dbits, dec, buf, p, lo, hi, M, B, s, bits, fbits):
    """Write the 16-bit codes of vals[lo:hi]·2^s in (M, B) at buf[p:] and their decoded values
    into dec (through its integer view dbits). The common case works on the bits alone: a normal
    input that stays normal is rounded by adding to its fraction bits (a carry moves into the
    exponent) and rebiased by s; the decoded value is the same rounded bits in the input's own
    format. Subnormal inputs or outputs take :func:`_round16` on the scaled float64.

    A value that would round up past the input format's largest finite number (to 2^128 for
    float32, 2^1024 for float64: only in a block with ⌈log₂ max|v|⌉ one above the format's top
    binade) takes the code below instead, rounded toward zero: its decoded value stays finite
    and in the value's own binade, so the remainder v − decoded(v) stays exact."""
    nbits = vbits.itemsize * 8
    mant = 23 if nbits == 32 else 52
    bias = 127 if nbits == 32 else 1023
    sh = mant - M
    half = (1 << (sh - 1)) - 1
    # the largest rounded magnitude r whose bits r << sh are finite (below the all-ones exponent)
    rtop = (((1 << (nbits - 1 - mant)) - 1) << (mant - sh)) - 1
    rebias = (bias - B - s) << M
    absmask = (1 << (nbits - 1)) - 1
    signbit = 1 << (nbits - 1)
    for j in range(lo, hi):
        u = np.int64(vbits[j])
        a = u & absmask
        r = min((a + half + ((a >> sh) & 1)) >> sh, rtop)
        h = r - rebias
        if a == 0:
            h = 0
            dbits[j] = u  # ±0 as it is
        elif (a >> mant) == 0 or h < (1 << M):
            # a subnormal input, or a result below the format's normal range: the slow way
            v = np.float64(vals[j])
            fbits[0] = math.ldexp(abs(v), s)
            h = _round16(bits[0], M, B)
            q = _value16_slow(h, M, B, s)
            dec[j] = -q if u < 0 else q
        else:
            dbits[j] = (r << sh) | (u & signbit)
        h |= (u >> (nbits - 16)) & 0x8000
        buf[p] = h & 0xFF
        buf[p + 1] = (h >> 8) & 0xFF
        p += 2
    return p


@numba.njit(**JIT)
def _decode16(buf, p, c, obits, out, pos, M, B, s):
    """Decode c 16-bit codes of (M, B) at buf[p:] times 2^−s into out[pos:] (through its
    integer view obits where the result is a normal number of out's dtype)."""
    nbits = obits.itemsize * 8
    mant = 23 if nbits == 32 else 52
    bias = 127 if nbits == 32 else 1023
    emax = (1 << (nbits - 1 - mant)) - 2
    ebmax = (1 << (15 - M)) - 1
    shift = bias - B - s
    sh = mant - M
    rebias = shift << M
    for j in range(c):
        h = np.int64(buf[p + 2 * j]) | (np.int64(buf[p + 2 * j + 1]) << 8)
        mag = h & 0x7FFF
        eb = mag >> M
        sign = (h >> 15) << (nbits - 1)
        if 0 < eb < ebmax and 1 <= eb + shift <= emax:  # a normal code to a normal value
            obits[pos + j] = ((mag + rebias) << sh) | sign
        elif mag == 0:
            obits[pos + j] = sign
        else:
            out[pos + j] = _value16_slow(h, M, B, s)


# -- encoding ----------------------------------------------------------------------------------
# The steps of _plan, _write and _decode are compiled functions of their own, chosen by
# measurement to keep the message loops as fast as when they were written in one piece: the
# index-section readers and writers and the code choices are inlined by Numba (inline="always"),
# _scan_block is not (LLVM's own inlining measured as fast), and the value sections stay in the
# loops (a helper around _encode16 or _decode16 measured a few percent slower).
@numba.njit(**JIT)
def _scan_block(rel, vals, pos, c, off):
    """One pass over the c pairs of a block at rel[pos:], vals[pos:] (indices relative to off):
    the gaps' costs at each ladder start (1 byte each below 255, 3 below 65535; wider ones
    priced exactly) and the values' range. Returns (ok, last, n3, nw, w1, w2, w4, amax, amin):
    ok False when the indices are not strictly ascending from off; last the block-relative
    last index; n3 the gaps in [255, 65535); nw the gaps ≥ 65535 and w1, w2, w4 their exact
    costs from LADDER_1, LADDER_2, LADDER_4; amax the largest |v| (∞ if one is NaN or ±∞);
    amin the smallest non-zero |v|."""
    prev = off - 1
    n3 = 0
    nw = 0
    w1 = 0
    w2 = 0
    w4 = 0
    amax = 0.0
    amin = math.inf
    finite = True
    for j in range(pos, pos + c):
        r = rel[j]
        g = r - prev - 1
        prev = r
        if g < 0:
            return False, 0, 0, 0, 0, 0, 0, 0.0, 0.0
        if g >= 0xFF:
            if g < 0xFFFF:
                n3 += 1
            else:
                nw += 1
                w1 += _ladder_cost(g, 1)
                w2 += _ladder_cost(g, 2)
                w4 += _ladder_cost(g, 4)
        a = abs(np.float64(vals[j]))
        finite &= a < math.inf
        amax = max(amax, a)
        if 0.0 < a < amin:
            amin = a
    if not finite:
        amax = math.inf
    return True, prev - off, n3, nw, w1, w2, w4, amax, amin


@numba.njit(**JIT, inline="always")
def _index_code(c, last, n3, nw, w1, w2, w4):
    """The smallest index code of a block of c pairs (ties: the lowest code) from the gap
    costs of :func:`_scan_block`. Returns (code, bytes)."""
    if last == c - 1:
        return PREFIX, 0
    code, cost = LADDER_1, (c - n3 - nw) + 3 * n3 + w1
    c2 = 2 * (c - nw) + w2
    c4 = 4 * (c - nw) + w4
    if c2 < cost:
        code, cost = LADDER_2, c2
    if c4 < cost:
        code, cost = LADDER_4, c4
    if 8 * c < cost:
        code, cost = LADDER_8, 8 * c
    if last // 8 + 1 < cost:
        code, cost = BITMAP, last // 8 + 1
    return code, cost


@numba.njit(**JIT, inline="always")
def _value_code(amax, amin, quantise):
    """The value code and scale exponent of a block whose largest |v| is amax (∞ when one is
    not finite) and smallest non-zero |v| is amin. Returns (code, s)."""
    if not (quantise and amax < math.inf):
        return RAW, 0
    if amax == 0.0:
        return FP16, 0
    f, x = math.frexp(amax)
    e = x - 1 if f == 0.5 else x  # ⌈log₂ amax⌉
    if amin >= math.ldexp(1.0, e - 29):
        return FP16, _T16 - e
    return BF16, _TBF - e


@numba.njit(**JIT)
def _plan(rel, vals, counts, starts, quantise):
    """Per block: index code, value code and scale exponent; and the message size in bytes
    (block b's indices are rel − starts[b]). Returns (error, icode, vcode, scale, size)."""
    nb = counts.shape[0]
    icode = np.zeros(nb, np.int64)
    vcode = np.zeros(nb, np.int64)
    scale = np.zeros(nb, np.int64)
    isz = vals.itemsize
    size = 0
    pos = 0
    for b in range(nb):
        c = counts[b]
        size += _ladder_cost(c, 1)
        if c == 0:
            continue
        ok, last, n3, nw, w1, w2, w4, amax, amin = _scan_block(rel, vals, pos, c, starts[b])
        if not ok:
            return _E_ORDER, icode, vcode, scale, 0
        code, cost = _index_code(c, last, n3, nw, w1, w2, w4)
        icode[b] = code
        vc, s = _value_code(amax, amin, quantise)
        vcode[b] = vc
        scale[b] = s
        size += 1 + cost  # the code byte and the index section
        size += c * isz if vc == RAW else 2 + 2 * c
        pos += c
    return 0, icode, vcode, scale, size


@numba.njit(**JIT, inline="always")
def _write_bitmap(rel, buf, p, pos, c, off):
    """The BITMAP section of the c indices at rel[pos:] (relative to off) at buf[p:]; the next
    position."""
    nbytes = (rel[pos + c - 1] - off) // 8 + 1
    for t in range(nbytes):
        buf[p + t] = 0
    for j in range(pos, pos + c):
        r = rel[j] - off
        buf[p + (r >> 3)] |= 1 << (r & 7)
    return p + nbytes


@numba.njit(**JIT, inline="always")
def _write_gaps(rel, buf, p, pos, c, off, w):
    """The gaps of the c indices at rel[pos:] (relative to off) as ladder numbers starting at w
    bytes, at buf[p:]; the next position. Gaps below 65535 at w = 1 or 2 are stored without the
    ladder loop (up to 3 bytes ahead: the buffer's slack)."""
    prev = off - 1
    if w == 1:
        for j in range(pos, pos + c):
            g = rel[j] - prev - 1
            prev = rel[j]
            if g < 0xFFFF:
                # 1 byte, or the escape and 2 bytes: stored either way, p moves by 1 or 3
                esc = g >= 0xFF
                buf[p] = 0xFF if esc else g
                buf[p + 1] = g & 0xFF
                buf[p + 2] = g >> 8
                p += 3 if esc else 1
            else:
                p = _put_ladder(buf, p, g, 1)
    elif w == 2:
        for j in range(pos, pos + c):
            g = rel[j] - prev - 1
            prev = rel[j]
            if g < 0xFFFF:
                buf[p] = g & 0xFF
                buf[p + 1] = g >> 8
                p += 2
            else:
                p = _put_ladder(buf, p, g, 2)
    else:
        for j in range(pos, pos + c):
            p = _put_ladder(buf, p, rel[j] - prev - 1, w)
            prev = rel[j]
    return p


@numba.njit(**JIT)
def _write(rel, vals, vbytes, vbits, counts, starts, icode, vcode, scale, buf, dec, dbits):
    """Write the message planned by :func:`_plan` into buf (which has 8 bytes of slack at the
    end: the ladder loops store up to 3 bytes ahead) and the decoded values into dec; returns
    the number of bytes of the message."""
    isz = vals.itemsize
    bits = np.zeros(1, np.int64)
    fbits = bits.view(np.float64)
    p = 0
    pos = 0
    for b in range(counts.shape[0]):
        c = counts[b]
        p = _put_ladder(buf, p, c, 1)
        if c == 0:
            continue
        ic = icode[b]
        vc = vcode[b]
        buf[p] = ic | (vc << 4)
        p += 1
        s = scale[b]
        if vc != RAW:
            p = _put(buf, p, s & 0xFFFF, 2)
        if ic == BITMAP:
            p = _write_bitmap(rel, buf, p, pos, c, starts[b])
        elif ic != PREFIX:
            p = _write_gaps(rel, buf, p, pos, c, starts[b], 1 << ic)
        if vc == RAW:
            for t in range(c * isz):
                buf[p + t] = vbytes[pos * isz + t]
            for j in range(pos, pos + c):
                dec[j] = vals[j]
            p += c * isz
        else:
            M = _M16 if vc == FP16 else _MBF
            B = _B16 if vc == FP16 else _BBF
            p = _encode16(vbits, vals, dbits, dec, buf, p, pos, pos + c, M, B, s, bits, fbits)
        pos += c
    return p


# -- decoding ----------------------------------------------------------------------------------
@numba.njit(**JIT, inline="always")
def _read_codes(buf, p):
    """The code byte at buf[p] (p < len(buf)) and, for a 16-bit value code, the scale exponent
    after it. Returns (error, index code, value code, s, next position)."""
    n = buf.shape[0]
    code = np.int64(buf[p])
    p += 1
    ic = code & 0xF
    vc = code >> 4
    if ic > PREFIX or vc > BF16:
        return _E_CODE, ic, vc, 0, p
    s = 0
    if vc != RAW:
        if p + 2 > n:
            return _E_TRUNC, ic, vc, 0, p
        s = np.int64(buf[p]) | (np.int64(buf[p + 1]) << 8)
        if s >= 0x8000:
            s -= 0x10000
        p += 2
    return 0, ic, vc, s, p


@numba.njit(**JIT, inline="always")
def _read_bitmap(buf, p, c, rel, pos, off):
    """The c indices of a BITMAP section at buf[p:], plus off, into rel[pos:]. Returns
    (error, next position)."""
    n = buf.shape[0]
    j = 0
    t = 0
    while j < c:
        if p + t >= n:
            return _E_TRUNC, p
        byte = np.int64(buf[p + t])
        for bit in range(8):
            if (byte >> bit) & 1:
                if j == c:
                    return _E_CODE, p  # more bits set than the count
                rel[pos + j] = 8 * t + bit + off
                j += 1
        t += 1
    return 0, p + t


@numba.njit(**JIT, inline="always")
def _read_gaps(buf, p, c, w, rel, pos, off):
    """The c indices of a gap section (ladder numbers starting at w bytes) at buf[p:], plus
    off, into rel[pos:]. Returns (error, next position). Gaps without an escape at w = 1 or 2
    are read without the ladder loop."""
    n = buf.shape[0]
    prev = off - 1
    for j in range(c):
        if w == 1 and p < n and buf[p] < 0xFF:
            g = np.int64(buf[p])
            p += 1
        elif w == 2 and p + 2 <= n and (buf[p] < 0xFF or buf[p + 1] < 0xFF):
            g = np.int64(buf[p]) | (np.int64(buf[p + 1]) << 8)
            p += 2
        else:
            g, p = _get_ladder(buf, p, w)
            if p < 0:
                return _E_TRUNC, p
            if g > (1 << 62) - max(prev, 0):
                return _E_RANGE, p
        prev = prev + 1 + g
        rel[pos + j] = prev
    return 0, p


@numba.njit(**JIT)
def _decode(buf, nblocks, starts, counts, rel, vals, vbytes, vints):
    """Parse a message into counts, indices (block-relative plus starts[b]) and values (rel and
    vals hold room for every pair the buffer can hold). Returns (error, pairs)."""
    isz = vals.itemsize
    cap = rel.shape[0]
    n = buf.shape[0]
    p = 0
    pos = 0
    for b in range(nblocks):
        c, p = _get_ladder(buf, p, 1)
        if p < 0:
            return _E_TRUNC, pos
        counts[b] = c
        if c == 0:
            continue
        if c > cap - pos or p >= n:
            return _E_TRUNC, pos
        err, ic, vc, s, p = _read_codes(buf, p)
        if err:
            return err, pos
        if ic == PREFIX:
            for j in range(c):
                rel[pos + j] = j + starts[b]
        elif ic == BITMAP:
            err, p = _read_bitmap(buf, p, c, rel, pos, starts[b])
        else:
            err, p = _read_gaps(buf, p, c, 1 << ic, rel, pos, starts[b])
        if err:
            return err, pos
        if vc == RAW:
            if c * isz > n - p:
                return _E_TRUNC, pos
            for t in range(c * isz):
                vbytes[pos * isz + t] = buf[p + t]
            p += c * isz
        else:
            if 2 * c > n - p:
                return _E_TRUNC, pos
            M = _M16 if vc == FP16 else _MBF
            B = _B16 if vc == FP16 else _BBF
            _decode16(buf, p, c, vints, vals, pos, M, B, s)
            p += 2 * c
        pos += c
    if p != n:
        return _E_TRAIL, pos
    return 0, pos


# -- public functions --------------------------------------------------------------------------
_VALUE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _value_dtype(name, dtype) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{name}: must be float32 or float64, got {dtype!r}") from e
    if dt not in _VALUE_DTYPES:
        raise TypeError(f"{name}: must be float32 or float64, got {dt}")
    return dt


def encode_blocks(indices, values, counts, *, starts=None, quantise=True):
    """Encode sparse blocks in the compact wire format (module docstring).

    Parameters
    ----------
    indices : int32 or int64 array of shape (m,)
        The indices of every block, concatenated in block order; within a block strictly
        ascending and ≥ the block's start.
    values : float32 or float64 array of shape (m,)
        Their values.
    counts : integer array of shape (nblocks,)
        Pairs per block (≥ 0, summing to m).
    starts : integer array of shape (nblocks,), optional
        The first position of each block, subtracted from its indices (they travel
        block-relative); zeros by default.
    quantise : bool, default True
        Allow the 16-bit value codes; False sends every value bit for bit (``RAW``) and keeps
        only the index coding.

    Returns
    -------
    buf : uint8 array
        The message.
    decoded : array of shape (m,), ``values.dtype``
        The values as :func:`decode_blocks` returns them on the other side (a copy; equal to
        ``values`` where a block went ``RAW``).

    Raises
    ------
    TypeError
        If a dtype is not one of those above.
    ValueError
        If an array is not 1-D, the counts are negative or do not add up to m, the lengths of
        ``indices`` and ``values`` (or of ``counts`` and ``starts``) differ, or a block's
        indices are below its start or not strictly ascending.

    Notes
    -----
    Two passes over the pairs: one plans every block (codes, scale, size), one writes. Compiled
    with Numba (``spardl_kernels/cpu/wire.py``); O(m) time and memory.
    """
    idx = np.asarray(indices)
    val = np.asarray(values)
    cnt = np.asarray(counts)
    for name, a in (("indices", idx), ("values", val), ("counts", cnt)):
        if a.ndim != 1:
            raise ValueError(f"{name}: must be 1-D, got shape {a.shape}")
    if idx.shape[0] == 0 and idx.dtype.kind not in "iu":
        idx = np.empty(0, np.int64)
    if idx.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise TypeError(f"indices: must be int32 or int64, got {idx.dtype}")
    vdt = _value_dtype("values", val.dtype)
    if cnt.shape[0] and cnt.dtype.kind not in "iu":
        raise TypeError(f"counts: must be integers, got {cnt.dtype}")
    cnt = cnt.astype(np.int64, copy=False)
    if idx.shape[0] != val.shape[0]:
        raise ValueError(f"indices and values: lengths differ ({idx.shape[0]} and {val.shape[0]})")
    if np.any(cnt < 0) or int(cnt.sum()) != idx.shape[0]:
        raise ValueError(
            f"counts: must be >= 0 and add up to len(indices) = {idx.shape[0]}, "
            f"got a sum of {int(cnt.sum())}"
        )
    st = _starts(starts, cnt.shape[0])
    idx = np.ascontiguousarray(idx, dtype=np.int64)
    val = np.ascontiguousarray(val, dtype=vdt)
    err, icode, vcode, scale, size = _plan(idx, val, cnt, st, bool(quantise))
    if err:
        raise ValueError(
            "indices: must be >= the block's start and strictly ascending within each block"
        )
    buf = np.empty(size + 8, np.uint8)  # 8 bytes of slack for the ladder loops
    dec = np.empty_like(val)
    ints = np.int32 if vdt == np.float32 else np.int64
    written = _write(
        idx,
        val,
        val.view(np.uint8),
        val.view(ints),
        cnt,
        st,
        icode,
        vcode,
        scale,
        buf,
        dec,
        dec.view(ints),
    )
    assert written == size, (written, size)
    return buf[:size], dec


_ERRORS = {
    _E_TRUNC: "shorter than its own headers say",
    _E_CODE: "an unknown block code",
    _E_TRAIL: "longer than its blocks",
    _E_RANGE: "an index beyond 2^62",
}


def _starts(starts, nblocks) -> np.ndarray:
    if starts is None:
        return np.zeros(nblocks, np.int64)
    st = np.asarray(starts)
    if st.ndim != 1 or st.shape[0] != nblocks:
        raise ValueError(f"starts: must have one entry per block ({nblocks}), got {st.shape}")
    if st.shape[0] and st.dtype.kind not in "iu":
        raise TypeError(f"starts: must be integers, got {st.dtype}")
    return np.ascontiguousarray(st, dtype=np.int64)


def decode_blocks(buf, nblocks, value_dtype, starts=None):
    """Decode a message of :func:`encode_blocks`.

    Parameters
    ----------
    buf : uint8 array
        The message (any alignment).
    nblocks : int
        Blocks it holds (≥ 0; both sides know it).
    value_dtype : float32 or float64
        The dtype the values were encoded from (both sides know it).
    starts : integer array of shape (nblocks,), optional
        The first position of each block, added to its indices; zeros by default.

    Returns
    -------
    counts : int64 array of shape (nblocks,)
    indices : int64 array of shape (m,)
        Block-relative plus their block's start, concatenated in block order.
    values : array of shape (m,), ``value_dtype``

    Raises
    ------
    ValueError
        If the message is corrupt: shorter or longer than its records, or an unknown code.
    TypeError
        If ``buf`` is not uint8 or ``value_dtype`` is not float32 or float64.
    """
    b = np.asarray(buf)
    if b.ndim != 1:
        raise ValueError(f"buf: must be 1-D, got shape {b.shape}")
    if b.dtype != np.uint8:
        raise TypeError(f"buf: must be uint8, got {b.dtype}")
    vdt = _value_dtype("value_dtype", value_dtype)
    if isinstance(nblocks, bool) or not isinstance(nblocks, (int, np.integer)) or nblocks < 0:
        raise ValueError(f"nblocks: must be an integer >= 0, got {nblocks!r}")
    st = _starts(starts, int(nblocks))
    b = np.ascontiguousarray(b)
    cap = b.shape[0] // 2  # every pair takes at least 2 bytes (its value)
    counts = np.zeros(int(nblocks), np.int64)
    rel = np.empty(cap, np.int64)
    vals = np.empty(cap, vdt)
    ints = np.int32 if vdt == np.float32 else np.int64
    err, m = _decode(b, int(nblocks), st, counts, rel, vals, vals.view(np.uint8), vals.view(ints))
    if err:
        raise ValueError(
            f"received message of {b.shape[0]} bytes is corrupt: {_ERRORS[err]} "
            f"({nblocks} blocks expected)"
        )
    return counts, rel[:m], vals[:m]


@numba.njit(**JIT)
def _add_remainders(target, idx, sent, delivered):
    for j in range(idx.shape[0]):
        r = sent[j] - delivered[j]
        if r != 0 and abs(r) < math.inf:
            target[idx[j]] += r


def add_remainders(target, indices, sent, delivered):
    """``target[i] += sent − delivered`` at each index, in place: what the wire did not deliver.

    Parameters
    ----------
    target : float32 or float64 array of shape (n,), writeable
        A sender's residual (or partial sums).
    indices : int64 array of shape (m,), unique, each in [0, n)
    sent, delivered : arrays of shape (m,), ``target``'s dtype
        The values as encoded and as :func:`encode_blocks` said they will be decoded.

    Returns
    -------
    ndarray
        ``target``.

    Notes
    -----
    The difference is computed in the dtype, where it is exact for the 16-bit codes of this
    module (a value rounded within its binade, or to 0). Zero and non-finite differences (a
    non-finite value travels ``RAW``, bit for bit) are skipped. One pass, no temporary.

    Raises
    ------
    ValueError, TypeError
        If the shapes or dtypes do not match, or an index is out of range.
    """
    t = np.asarray(target)
    idx = np.asarray(indices)
    a = np.asarray(sent)
    d = np.asarray(delivered)
    _value_dtype("target", t.dtype)
    if not (a.dtype == d.dtype == t.dtype):
        raise TypeError(f"sent and delivered: must be {t.dtype}, got {a.dtype} and {d.dtype}")
    if idx.dtype != np.int64:
        raise TypeError(f"indices: must be int64, got {idx.dtype}")
    if not (idx.ndim == a.ndim == d.ndim == t.ndim == 1 and idx.shape == a.shape == d.shape):
        raise ValueError("indices, sent and delivered: must be 1-D of one length")
    if not t.flags.writeable:
        raise ValueError("target: must be writeable")
    if idx.shape[0] and (int(idx.min()) < 0 or int(idx.max()) >= t.shape[0]):
        raise ValueError(f"indices: must be in [0, {t.shape[0]})")
    _add_remainders(t, idx, a, d)
    return target


def encoded_capacity(nblocks, max_pairs, index_bytes, value_dtype) -> int:
    """An upper bound on the bytes of a message of ``nblocks`` blocks and ``max_pairs`` pairs.

    Parameters
    ----------
    nblocks, max_pairs : int
        Blocks and pairs (in all).
    index_bytes : int
        4 when every block is shorter than 2^31 (a gap then fits ``LADDER_4`` without an
        escape), else 8.
    value_dtype : float32 or float64
        The dtype encoded (a ``RAW`` block sends its bytes).

    Returns
    -------
    int
        Per block 15 bytes of count, 1 code byte, 2 scale bytes; per pair the index bound and
        the value's size.
    """
    vsz = _value_dtype("value_dtype", value_dtype).itemsize
    return int(nblocks) * 18 + int(max_pairs) * (int(index_bytes) + vsz)
