"""The compact wire codec (spardl_kernels/cpu/wire.py): equal to its reference in tests/naive.py
byte for byte, round trips exact, re-encoding what was decoded changes nothing, and the sender's
remainder v − decoded(v) is exact in the value dtype."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spardl_kernels.cpu import wire as W
from tests import naive

SETTINGS = settings(deadline=None, max_examples=80)
DTYPES = [np.float32, np.float64]


@st.composite
def messages(draw, max_blocks=5, max_count=40):
    """(indices, values, counts, dtype): block-relative ascending indices with gaps that reach
    every ladder width, values with zeros, signs, wide ranges and (sometimes) non-finite ones."""
    dtype = draw(st.sampled_from(DTYPES))
    nb = draw(st.integers(0, max_blocks))
    idx, val, counts = [], [], []
    for _ in range(nb):
        c = draw(st.integers(0, max_count))
        kind = draw(st.integers(0, 4))
        if kind == 0:
            gaps = [0] * c  # a prefix (PREFIX) or dense runs (BITMAP)
            first = draw(st.integers(0, 3))
        elif kind == 1:
            gaps = draw(st.lists(st.integers(0, 3), min_size=c, max_size=c))
            first = draw(st.integers(0, 20))
        else:
            big = [254, 255, 256, 65534, 65535, 65536, 2**32 - 2, 2**32 - 1, 2**32, 2**40]
            g = st.one_of(st.integers(0, 300), st.sampled_from(big), st.integers(0, 2**45))
            gaps = draw(st.lists(g, min_size=c, max_size=c))
            first = draw(g)
        pos = first - 1
        for gap in gaps:
            pos += gap + 1
            idx.append(pos)
        scale = 2.0 ** draw(st.integers(-140 if dtype == np.float32 else -1000, 100))
        spread = draw(st.sampled_from([1.0, 1e3, 1e9, 1e12]))
        width = 32 if dtype == np.float32 else 64
        special = [0.0, -0.0, 1.0, -1.0, 65504.0, 65520.0, 2.0**-24, 2.0**-25]
        if draw(st.integers(0, 5)) == 0:
            special += [np.nan, np.inf, -np.inf]
        elems = st.one_of(
            st.floats(-1, 1, width=width).map(lambda x, s=scale, sp=spread: x * s * sp),
            st.floats(-1, 1, width=width).map(lambda x, s=scale: x * s),
            st.sampled_from(special),
        )
        with np.errstate(over="ignore", under="ignore"):
            val += [dtype(v) for v in draw(st.lists(elems, min_size=c, max_size=c))]
        counts.append(c)
    return (
        np.array(idx, np.int64),
        np.array(val, dtype),
        np.array(counts, np.int64),
        np.dtype(dtype),
    )


def _same_values(a, b):
    """Bit for bit, NaN payloads aside (the reference goes through Python floats)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = np.isnan(a)
    np.testing.assert_array_equal(nan, np.isnan(b))
    np.testing.assert_array_equal(a[~nan].view(np.uint8), b[~nan].view(np.uint8))


@SETTINGS
@given(messages(), st.booleans())
def test_encode_matches_reference(msg, quantise):
    idx, val, counts, dtype = msg
    buf, dec = W.encode_blocks(idx, val, counts, quantise=quantise)
    ref_buf, ref_dec = naive.encode_blocks(idx, val, counts, quantise=quantise)
    assert buf.dtype == np.uint8
    assert buf.tobytes() == ref_buf.tobytes()
    _same_values(dec, ref_dec)
    # and the reference decoder reads the kernel's bytes as the kernel's decoder does
    c1, i1, v1 = W.decode_blocks(buf, len(counts), dtype)
    c2, i2, v2 = naive.decode_blocks(buf, len(counts), dtype)
    np.testing.assert_array_equal(c1, c2)
    np.testing.assert_array_equal(i1, i2)
    _same_values(v1, v2)


@SETTINGS
@given(messages())
def test_round_trip_and_remainder_exact(msg):
    idx, val, counts, dtype = msg
    buf, dec = W.encode_blocks(idx, val, counts)
    got_c, got_i, got_v = W.decode_blocks(buf, len(counts), dtype)
    np.testing.assert_array_equal(got_c, counts)
    np.testing.assert_array_equal(got_i, idx)
    assert got_i.dtype == np.int64 and got_v.dtype == dtype
    # what the receiver decodes is what the sender was told, bit for bit (NaN included)
    assert got_v.tobytes() == dec.tobytes()
    finite = np.isfinite(val)
    # the remainder v - decoded(v) is exact in the value dtype: nothing lost to its rounding
    with np.errstate(invalid="ignore", over="ignore"):
        rem = val - dec
    exact = (
        np.array(val[finite], np.longdouble) - np.array(dec[finite], np.longdouble)
        if dtype == np.float64
        else val[finite].astype(np.float64) - dec[finite].astype(np.float64)
    )
    np.testing.assert_array_equal(np.asarray(rem[finite], exact.dtype), exact)
    # signs and zeros survive; non-finite values travel bit for bit
    np.testing.assert_array_equal(np.signbit(dec[finite]), np.signbit(val[finite]))
    assert dec[~finite].tobytes() == val[~finite].tobytes()


@SETTINGS
@given(messages())
def test_reencoding_the_decoded_values_is_lossless(msg):
    """A relay (a Bruck all-gather) sends again what it received: the values must not move."""
    idx, val, counts, dtype = msg
    buf, dec = W.encode_blocks(idx, val, counts)
    _, rel, got = W.decode_blocks(buf, len(counts), dtype)
    buf2, dec2 = W.encode_blocks(rel, got, counts)
    assert dec2.tobytes() == dec.tobytes()
    _, _, again = W.decode_blocks(buf2, len(counts), dtype)
    assert again.tobytes() == dec.tobytes()


@SETTINGS
@given(st.integers(0, 2**32), st.sampled_from(DTYPES), st.integers(-60, 60))
def test_fp16_blocks_are_numpy_float16_of_the_scaled_values(seed, dtype, exp):
    """Independent of the reference: an FP16 block holds float16(v·2^s) (NumPy's rounding), and
    its relative error is at most 2^−11."""
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal(200) * 2.0**exp).astype(dtype)
    v[rng.random(200) < 0.1] = 0
    buf, dec = W.encode_blocks(np.arange(0, 600, 3), v, [200])
    assert buf[1] >> 4 == W.FP16
    s = int(np.frombuffer(buf[2:4].tobytes(), "<i2")[0])
    halves = (v.astype(np.float64) * 2.0**s).astype(np.float16)
    np.testing.assert_array_equal(buf[-400:].view("<u2"), halves.view(np.uint16))
    np.testing.assert_array_equal(dec, (halves.astype(np.float64) * 2.0**-s).astype(dtype))
    nz = v != 0
    assert np.all(np.abs(dec[nz] - v[nz]) <= np.abs(v[nz]) * 2.0**-11)


@st.composite
def near_the_top(draw):
    """(values, dtype): one block of finite values up to the dtype's largest, most of them in
    its top binade, where the 16-bit rounding of a value can carry past that largest value."""
    dtype = draw(st.sampled_from(DTYPES))
    top = float(np.finfo(dtype).max)
    width = 32 if dtype == np.float32 else 64
    edge = st.sampled_from([top, -top, top * (1 - 2.0**-12), top * (1 - 2.0**-9), 2.0**127])
    elems = st.one_of(
        st.floats(top / 2, top, width=width),
        st.floats(-top, top, width=width),
        st.floats(-(2.0**-100), 2.0**-100, width=width),
        edge,
    )
    vals = draw(st.lists(elems, min_size=1, max_size=30))
    return np.array(vals, dtype), np.dtype(dtype)


@SETTINGS
@given(near_the_top())
def test_values_up_to_the_dtypes_max_decode_finite(msg):
    """Values up to the dtype's largest decode finite (never ±inf), within one unit of the
    16-bit format's last place, with an exact and finite remainder; the reference agrees byte
    for byte and a relay's re-encoding changes nothing."""
    val, dtype = msg
    n = val.shape[0]
    buf, dec = W.encode_blocks(np.arange(n), val, [n])
    ref_buf, ref_dec = naive.encode_blocks(np.arange(n), val, [n])
    assert buf.tobytes() == ref_buf.tobytes()
    _same_values(dec, ref_dec)
    _, _, got = W.decode_blocks(buf, 1, dtype)
    assert got.tobytes() == dec.tobytes()
    assert np.all(np.isfinite(got))
    with np.errstate(over="raise", invalid="raise"):
        rem = val - dec
    wide = np.longdouble if dtype == np.float64 else np.float64
    exact = np.asarray(val, wide) - np.asarray(dec, wide)
    np.testing.assert_array_equal(np.asarray(rem, wide), exact)
    assert np.all(np.isfinite(rem))
    M = {W.FP16: 10, W.BF16: 7}[buf[1] >> 4]
    big = np.abs(val) >= np.max(np.abs(val)) * 2.0**-20  # normal in either 16-bit format
    unit = np.ldexp(1.0, np.frexp(np.abs(val[big]).astype(np.float64))[1] - 1 - M)
    assert np.all(np.abs(exact[big]) < unit)
    _, dec2 = W.encode_blocks(np.arange(n), got, [n])
    assert dec2.tobytes() == dec.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("small", "code"), [(None, W.FP16), (1.0, W.BF16)])
def test_the_largest_finite_value_rounds_toward_zero(dtype, small, code):
    """max|v| = the dtype's largest: rounded to nearest it would decode as 2^(emax + 1) = inf;
    it takes the largest code below, (2 − 2^−M)·2^emax, and the sender keeps the rest."""
    info = np.finfo(dtype)
    for sign in (1, -1):
        v = np.array([sign * info.max] + ([] if small is None else [small]), dtype)
        buf, dec = W.encode_blocks(np.arange(v.shape[0]), v, [v.shape[0]])
        assert buf[1] >> 4 == code
        M = 10 if code == W.FP16 else 7
        want = sign * math.ldexp(2 - 2.0**-M, info.maxexp - 1)
        assert dec[0] == dtype(want)
        assert W.decode_blocks(buf, 1, dtype)[2].tobytes() == dec.tobytes()
        with np.errstate(over="raise"):
            assert v[0] - dec[0] == dtype(sign * (info.max - abs(want)))


def test_codes_and_sizes():
    """Each index code where it is the smallest, and the bytes per pair at 1 % density."""
    f32 = np.float32
    one = np.ones(1, f32)

    def code(rel, vals):
        buf, _ = W.encode_blocks(np.asarray(rel, np.int64), vals, [len(rel)])
        return buf[1] & 0xF, buf[1] >> 4

    assert code(np.arange(50), np.ones(50, f32)) == (W.PREFIX, W.FP16)
    assert code(np.arange(1, 51), np.ones(50, f32))[0] == W.BITMAP
    assert code([3, 300], np.ones(2, f32))[0] == W.LADDER_1
    assert code(np.arange(0, 10**6, 4000), np.ones(250, f32))[0] == W.LADDER_2
    assert code([2**20], one)[0] == W.LADDER_4  # 4 bytes, against 1 + 2 + 4 and 2 + 4
    assert code([2**33], one)[0] == W.LADDER_8  # 8 bytes, against 4 + 8
    assert code([1], np.array([np.nan], f32))[1] == W.RAW
    assert code([1, 2], np.array([1.0, 1e-12], f32))[1] == W.BF16  # a range beyond 2^29
    buf, _ = W.encode_blocks([], np.ones(0, f32), [0, 0])
    assert buf.tobytes() == b"\x00\x00"
    rng = np.random.default_rng(0)
    n, k = 10**6, 10**4
    idx = np.sort(rng.choice(n, k, replace=False))
    buf, _ = W.encode_blocks(idx, rng.standard_normal(k).astype(f32), [k])
    assert len(buf) / k < 3.3  # 2 value bytes + ~1.15 index bytes
    assert len(buf) <= W.encoded_capacity(1, k, 4, f32)


def test_quantise_off_sends_values_bit_for_bit():
    v = np.array([1.1, -0.0, np.nan, 3e38], np.float32)
    buf, dec = W.encode_blocks(np.array([0, 5, 9, 10]), v, [4], quantise=False)
    assert dec.tobytes() == v.tobytes()
    assert W.decode_blocks(buf, 1, np.float32)[2].tobytes() == v.tobytes()


def test_errors_name_the_argument():
    f32 = np.ones(2, np.float32)
    with pytest.raises(ValueError, match="indices"):
        W.encode_blocks(np.array([3, 3]), f32, [2])
    with pytest.raises(ValueError, match="indices"):
        W.encode_blocks(np.array([-1, 3]), f32, [2])
    with pytest.raises(ValueError, match="counts"):
        W.encode_blocks(np.array([1, 3]), f32, [3])
    with pytest.raises(ValueError, match="lengths"):
        W.encode_blocks(np.array([1, 3, 4]), f32, [3])
    with pytest.raises(TypeError, match="values"):
        W.encode_blocks(np.array([1, 3]), np.ones(2, np.float16), [2])
    with pytest.raises(TypeError, match="indices"):
        W.encode_blocks(np.array([1.0, 3.0]), f32, [2])
    with pytest.raises(TypeError, match="value_dtype"):
        W.decode_blocks(np.zeros(1, np.uint8), 1, np.int32)
    buf, _ = W.encode_blocks(np.array([1, 300, 70000]), np.ones(3, np.float32), [3])
    for bad in (buf[:-1], np.concatenate([buf, np.zeros(1, np.uint8)]), buf[:3]):
        with pytest.raises(ValueError, match="corrupt"):
            W.decode_blocks(bad, 1, np.float32)
    bad = buf.copy()
    bad[1] = 0x37  # index code 7: unknown
    with pytest.raises(ValueError, match="corrupt"):
        W.decode_blocks(bad, 1, np.float32)


def test_train_cli_and_torch_pass_wire_through():
    """`spardl train --wire compact` reaches the allreducer's options; "coo" (the default) adds
    nothing, so a default run's options are as before. spardl.torch accepts ``wire``."""
    import argparse

    from spardl import train

    p = argparse.ArgumentParser()
    train.add_arguments(p)
    assert train._allreducer_options(p.parse_args(["--wire", "compact"]))["wire"] == "compact"
    assert "wire" not in train._allreducer_options(p.parse_args([]))
    with pytest.raises(SystemExit):
        p.parse_args(["--wire", "zip"])
    torch_mod = pytest.importorskip("spardl.torch")
    assert "wire" in torch_mod._COMMON_OPTIONS


def test_cost_model_prices_compact_pairs_as_encoded():
    """cost_model.compact_pair_bytes is what the encoder spends on uniformly spread indices."""
    from spardl import cost_model as cm

    rng = np.random.default_rng(1)
    n = 400_000
    # At ρ = 1 an allreducer sends values unrounded (quantise off): a full block, no indices.
    for dtype in (np.float32, np.float64):
        full, _ = W.encode_blocks(
            np.arange(n), rng.standard_normal(n).astype(dtype), [n], quantise=False
        )
        size = np.dtype(dtype).itemsize
        assert cm.compact_pair_bytes(1.0, size) == size
        assert abs(len(full) / n - size) < 0.01 * size
    for rho in (0.3, 0.05, 0.01, 0.002):
        k = int(rho * n)
        idx = np.sort(rng.choice(n, k, replace=False))
        buf, _ = W.encode_blocks(idx, rng.standard_normal(k).astype(np.float32), [k])
        assert abs(len(buf) / k - cm.compact_pair_bytes(rho)) < 0.03 * cm.compact_pair_bytes(rho)
    coo = cm.predict("spardl", 8, 10**6, 0.01)
    compact = cm.predict("spardl", 8, 10**6, 0.01, wire="compact")
    assert compact["messages"] == coo["messages"]
    assert compact["bytes"] == pytest.approx(coo["bytes"] * cm.compact_pair_bytes(0.01) / 8)
    assert cm.predict("topka", 8, 10**6, 0.01, wire="compact")["messages"] == 2
    with pytest.raises(ValueError, match="wire"):
        cm.predict("topka", 4, 1000, 0.01, wire="zip")


@SETTINGS
@given(messages(max_blocks=4, max_count=12), st.lists(st.integers(0, 2**40), max_size=4))
def test_starts_are_subtracted_and_added_back(msg, offsets):
    """``starts``: absolute indices in, the same bytes as block-relative ones, absolute out."""
    idx, val, counts, dtype = msg
    starts = np.array((offsets + [0] * len(counts))[: len(counts)], np.int64)
    absolute = idx + np.repeat(starts, counts)
    buf, dec = W.encode_blocks(absolute, val, counts, starts=starts)
    ref, ref_dec = W.encode_blocks(idx, val, counts)
    assert buf.tobytes() == ref.tobytes() and dec.tobytes() == ref_dec.tobytes()
    _, got, _ = W.decode_blocks(buf, len(counts), dtype, starts)
    np.testing.assert_array_equal(got, absolute)
    if len(counts) and counts[0]:
        below = absolute.copy()
        below[0] = starts[0] - 1
        with pytest.raises(ValueError, match="start"):
            W.encode_blocks(below, val, counts, starts=starts)


def test_add_remainders_keeps_what_the_wire_rounded():
    rng = np.random.default_rng(3)
    v = (rng.standard_normal(1000) * 1e-3).astype(np.float32)
    v[:3] = [np.nan, np.inf, 0.0]
    idx = np.sort(rng.choice(10_000, 1000, replace=False))
    _, dec = W.encode_blocks(idx, v, [500, 500], quantise=True)
    target = np.zeros(10_000, np.float32)
    target[idx] = 5.0
    W.add_remainders(target, idx, v, dec)
    want = np.full(1000, 5.0, np.float32)
    with np.errstate(invalid="ignore"):
        rem = v - dec
    ok = np.isfinite(rem) & (rem != 0)
    want[ok] += rem[ok]
    np.testing.assert_array_equal(target[idx], want)
    assert np.all(target[np.setdiff1d(np.arange(10_000), idx)] == 0)
    with pytest.raises(ValueError, match="indices"):
        W.add_remainders(target, np.array([10_000]), v[:1], dec[:1])
    with pytest.raises(TypeError, match="sent"):
        W.add_remainders(target, idx, v.astype(np.float64), dec)
