"""The dense allreducer is MPI's Allreduce of the same buffers, bit for bit, and nothing else.

Runs on every rank under `mpiexec -n P` (see tests/test_mpi.py) for P in {1, 2, 3, 4, 5, 6, 8}.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpiutil import assert_identical_everywhere, grads_for

import spardl

DTYPES = [np.float16, np.float32, np.float64]


def _work(dtype):
    return np.dtype(np.float32) if np.dtype(dtype) == np.float16 else np.dtype(dtype)


def _reference(comm, g, op):
    """What the dense allreducer promises, computed the same way here: MPI's own Allreduce of
    the gradient in the work dtype (float32 for float16) divided by s (P for the mean, 1 for the
    sum), with max |g / s| as one more entry (P > 1), then rounded once to the gradient's
    dtype."""
    w = _work(g.dtype)
    scaled = g.astype(w) / w.type(comm.size if op == "mean" else 1)
    peak = np.abs(scaled).max() if np.all(np.isfinite(scaled)) else np.inf
    buf = np.append(scaled, w.type(peak)) if comm.size > 1 else scaled
    total = np.empty_like(buf)
    comm.Allreduce(buf, total, op=MPI.SUM)
    return total[: len(g)].astype(g.dtype)


@pytest.mark.every_comm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_equals_mpi_allreduce_bit_for_bit(comm, dtype, op):
    n = 1001
    ar = spardl.make("dense", comm, n, op=op)
    for step in range(3):
        g = grads_for(comm, n, dtype, seed=40 + step, kind="heavy")[comm.rank]
        out = ar(g)
        assert out.is_dense and out.n == n and out.dtype == np.dtype(dtype)
        want = _reference(comm, g, op)
        assert out.to_dense().tobytes() == want.tobytes()
        keep = want != 0  # the entries listed: all but ±0
        np.testing.assert_array_equal(out.indices, np.flatnonzero(keep))
        assert out.values.tobytes() == want[keep].tobytes()
        assert out.nnz == int(np.count_nonzero(keep))
        assert_identical_everywhere(comm, out)
    assert ar.step == 3


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_mean_and_sum_of_representable_values(comm, dtype):
    """Small multiples of 1/8: every partial sum is exact in any order, so the sum is the NumPy
    sum whatever MPI's reduction order; so is the mean where P is a power of two (g / P exact),
    and otherwise it is within a few units in the last place of the sum divided by P."""
    n = 257
    P = comm.size
    gs = [(np.random.default_rng(50 + r).integers(-64, 65, n) / 8).astype(dtype) for r in range(P)]
    g = gs[comm.rank]
    w = _work(dtype)
    exact = np.sum(np.stack(gs).astype(np.float64), axis=0)
    total = spardl.make("dense", comm, n, op="sum")(g)
    assert total.to_dense().tobytes() == exact.astype(w).astype(dtype).tobytes()
    mean = spardl.make("dense", comm, n, op="mean")(g)
    want = (exact.astype(w) / w.type(P)).astype(dtype)
    if P & (P - 1) == 0:
        assert mean.to_dense().tobytes() == want.tobytes()
    else:
        tol = 4 * P * np.finfo(w).eps
        np.testing.assert_allclose(mean.to_dense().astype(np.float64), want, rtol=tol, atol=tol)


def test_counters_are_one_allreduce(comm):
    n = 1000
    ar = spardl.make("dense", comm, n)
    g = np.ones(n, np.float32)
    control = ar.stats["control_messages"]
    for _ in range(3):
        ar(g)
    P = comm.size
    per_call = 2 * 4 * (n + 1) * (P - 1) // P  # the values and the bound B (class docstring)
    assert ar.stats["messages"] == (3 if P > 1 else 0)
    assert ar.stats["bytes_sent"] == ar.stats["bytes_received"] == 3 * per_call
    assert ar.stats["control_messages"] == control + 3  # the cross-rank check of each call
    assert ar.stats["steps"] == 3


def test_results_held_by_the_caller_stay_intact(comm):
    """The result buffers are reused only once nothing refers to them: results kept across
    later steps (and their dense vectors) never change."""
    n = 300
    ar = spardl.make("dense", comm, n, op="sum")
    kept, want = [], []
    for step in range(5):
        g = grads_for(comm, n, np.float32, seed=60 + step)[comm.rank]
        out = ar(g)
        want.append(_reference(comm, g, "sum").tobytes())
        if step % 2 == 0:
            kept.append((step, out))
        v = out.to_dense()
        v[:] = 0  # to_dense is a copy: writing to it leaves the result alone
    for step, out in kept:
        assert out.to_dense().tobytes() == want[step]


def test_float16_past_its_range_is_clamped_not_inf(comm):
    """The float32 sum of float16 gradients of 60000 is 60000·P: finite, clamped to 65504 in
    float16 for op="sum" (P > 1); the mean stays 60000."""
    n = 8
    g = np.full(n, 60000.0, np.float16)
    total = spardl.make("dense", comm, n, op="sum")(g)
    want = np.float16(60000.0) if comm.size == 1 else np.finfo(np.float16).max
    assert np.all(total.to_dense() == want)
    mean = spardl.make("dense", comm, n, op="mean")(g)
    np.testing.assert_array_equal(mean.to_dense(), g)


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_is_always_zero(comm, dtype):
    n = 50
    ar = spardl.make("dense", comm, n, density=0.1)
    ar(grads_for(comm, n, dtype, seed=70)[comm.rank])
    r = ar.residual
    assert r.shape == (n,) and r.dtype == _work(dtype) and not np.any(r)
    assert ar.state_dict()["residual"] is None


def test_nonfinite_propagate_returns_the_sum(comm):
    n = 20
    g = np.ones(n, np.float32)
    if comm.rank == 0:
        g[3] = np.inf
        g[4] = np.nan
    out = spardl.make("dense", comm, n, nonfinite="propagate")(g)
    d = out.to_dense()
    assert np.isposinf(d[3]) and np.isnan(d[4]) and np.all(d[5:] == 1)
    np.testing.assert_array_equal(out.indices, np.arange(n))  # NaN is listed


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_is_canonical_whoever_made_it(comm, op, dtype):
    """A NaN with a payload in a gradient, and ∞ − ∞ that only MPI's sum makes (+inf on even
    ranks, −inf on odd ones, P > 1), come out as the canonical NaN (docs/design.md §3.4), with
    ``nonfinite="propagate"``, for the sum as for the mean."""
    from naive import canonical_nan

    n = 16
    uint = np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")
    g = np.ones(n, dtype)
    quiet = np.array(np.nan, dtype).view(uint)
    g[2:3].view(uint)[0] = quiet | 0x1234  # a NaN with a payload, on rank 0
    if comm.rank != 0:
        g[2] = 1
    g[5] = np.inf if comm.rank % 2 == 0 else -np.inf
    out = spardl.make("dense", comm, n, op=op, nonfinite="propagate")(g)
    assert_identical_everywhere(comm, out)
    d = out.to_dense()
    nan_bits = np.array([canonical_nan(dtype)]).view(uint)[0]
    assert d[2:3].view(uint)[0] == nan_bits
    if comm.size > 1:
        assert d[5:6].view(uint)[0] == nan_bits
    else:
        assert np.isposinf(d[5])


def test_sums_near_the_top_of_the_range(comm):
    """Float32 gradients of 3e38 on every rank: their sum overflows for P > 1 (raised on every
    rank, the step not applied), while their mean, the sum of g / P, is finite and exact."""
    n = 8
    g = np.full(n, 3e38, np.float32)
    mean = spardl.make("dense", comm, n, op="mean")(g).to_dense()
    assert np.all(np.isfinite(mean))
    np.testing.assert_allclose(mean, g, rtol=4 * comm.size * np.finfo(np.float32).eps)
    ar = spardl.make("dense", comm, n, op="sum")
    if comm.size == 1:
        assert ar(g).to_dense().tobytes() == g.tobytes()
        return
    with pytest.raises(spardl.NonFiniteError):
        ar(g)
    assert ar.step == 0
    half = np.full(n, 3e38 / comm.size / 2, np.float32)  # bound B above half the range at P = 2
    total = ar(half).to_dense()
    assert np.all(np.isfinite(total)) and ar.step == 1


def _reference_float16(comm, g, op):
    """``wire_dtype="float16"``: M = the largest |g / s| of every rank (MPI's MAX), g / s in the
    work dtype scaled by 2^e with P·M in [2^14, 2^15) and rounded to float16, summed by MPI's
    own float16 reduce-scatter and all-gather, the sums widened to the gradient's dtype through
    the work dtype and scaled back by 2^-e (``np.ldexp``: one rounding, whatever e, where 2^e
    itself may not be a number of the work dtype)."""
    import math
    from fractions import Fraction

    P = comm.size
    w = _work(g.dtype)
    scaled = g.astype(w) / w.type(P if op == "mean" else 1)
    peak = float(np.abs(scaled).max()) if np.all(np.isfinite(scaled)) else math.inf
    peak = comm.allreduce(peak, op=MPI.MAX)
    e = 0
    if 0 < peak < math.inf:  # 2^14 <= P·M·2^e < 2^15, in exact arithmetic
        pm = P * Fraction(peak)
        e = 15 - (pm.numerator.bit_length() - pm.denominator.bit_length())
        while pm * Fraction(2) ** e >= 2**15:
            e -= 1
        while pm * Fraction(2) ** e < 2**14:
            e += 1
    with np.errstate(over="ignore"):
        half = np.ldexp(scaled, e).astype(np.float16)
    # MPI's own float16 SUM in the 16-bit allreduce's collectives: a reduce-scatter of P
    # zero-padded blocks, then an all-gather (spardl.comm.float16_allreduce)
    n, m = half.shape[0], -(-half.shape[0] // P)
    pad, block, total = (
        np.zeros(m * P, np.float16),
        np.empty(m, np.float16),
        np.empty(m * P, np.float16),
    )
    pad[:n] = half
    comm.Reduce_scatter_block(pad, block, op=MPI.SUM)
    comm.Allgather(block, total)
    total = total[:n]
    with np.errstate(over="ignore"):
        return np.ldexp(total.astype(w), -e).astype(g.dtype), e


@pytest.mark.every_comm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_float16_wire_is_mpi_float16_allreduce_bit_for_bit(comm, dtype, op):
    """The 16-bit dense allreduce: MPI's float16 sum of the scaled, rounded g / s, at half the
    bytes (and one MAX allreduce of one number)."""
    n = 1001
    ar = spardl.make("dense", comm, n, op=op, wire_dtype="float16")
    scales = set()
    for step in range(3):
        g = grads_for(comm, n, dtype, seed=80 + step)[comm.rank]
        g = g * dtype(10.0 ** (2 - 3 * step))  # three magnitudes: three scales
        out = ar(g)
        assert out.is_dense and out.dtype == np.dtype(dtype)
        want, e = _reference_float16(comm, g, op)
        scales.add(e)
        assert out.to_dense().tobytes() == want.tobytes()
        assert_identical_everywhere(comm, out)
    assert len(scales) == 3
    P = comm.size
    per_call = 2 * 8 * (P - 1) // P + 2 * 2 * n * (P - 1) // P
    assert ar.stats["bytes_sent"] == 3 * per_call
    assert ar.stats["messages"] == (6 if P > 1 else 0)
    assert ar.residual.shape == (n,) and not np.any(ar.residual)


def test_float16_wire_drops_what_float16_cannot_hold(comm):
    """Identical gradients on every rank: the mean is each value rounded to float16's 11
    significant bits after scaling by 2^e (here 2^15 / 4: exact), and values more than about
    2^39 times below the largest round to zero; float32 on the wire keeps them all."""
    g = np.array([3.0, 1 + 2.0**-12, 2.0**-30, 2.0**-45, -0.25], np.float32)
    out = spardl.make("dense", comm, 5, op="sum", wire_dtype="float16")(g)
    d = out.to_dense()
    P = comm.size
    if P & (P - 1) == 0:  # the sum of P equal float16 values is exact
        assert d[0] == 3 * P and d[1] == P and d[4] == -0.25 * P
        assert d[2] == 2.0**-30 * P  # 2^-30·2^e is a normal float16: kept
    assert d[3] == 0  # 2^-45·2^e is below float16's smallest subnormal
    exact = spardl.make("dense", comm, 5, op="sum")(g).to_dense()
    assert exact[3] != 0 and exact[1] == (1 + 2.0**-12) * P


def test_float16_wire_sums_past_float16_range(comm):
    """Sums past ±65504 stay finite (the scale keeps P·M below 2^15) and a NaN or ±inf is
    counted as for the float32 sum: raised on every rank, or returned with "propagate"."""
    n = 8
    g = np.full(n, 40000.0, np.float32)
    out = spardl.make("dense", comm, n, op="sum", wire_dtype="float16")(g).to_dense()
    assert out.tobytes() == _reference_float16(comm, g, "sum")[0].tobytes()
    # Finite, and 40000·P up to float16's rounding of the partial sums (exact for P = 2^j).
    np.testing.assert_allclose(out, 40000.0 * comm.size, rtol=comm.size * 2.0**-11)
    bad = g.copy()
    if comm.rank == 0:
        bad[2] = np.inf
    ar = spardl.make("dense", comm, n, op="sum", wire_dtype="float16")
    with pytest.raises(spardl.NonFiniteError):
        ar(bad)
    assert ar.step == 0
    prop = spardl.make("dense", comm, n, wire_dtype="float16", nonfinite="propagate")(bad)
    d = prop.to_dense()
    assert np.isposinf(d[2]) and np.all(np.isfinite(np.delete(d, 2)))


@pytest.mark.parametrize(
    ("dtype", "mag"),
    [
        (np.float64, 1e300),
        (np.float64, 1e-300),
        (np.float64, 1e-310),  # subnormal: e beyond 1022
        (np.float64, 1e306),
        (np.float32, 1e-40),  # subnormal: e beyond 126
        (np.float32, 1e37),
    ],
)
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_float16_wire_scales_across_the_dtypes_range(comm, dtype, mag, op):
    """The scale 2^e follows M wherever it is in the gradient's range (here e from about -1000
    to 1090 for float64, past ±126 for float32): the sums are g / s rounded to float16's 11
    significant bits, never ±inf or 0 for gradients that float16 cannot hold unscaled."""
    n = 6
    rng = np.random.default_rng(7 + comm.rank)
    g = (mag * np.array([1.0, -0.5, 0.25, 0.75, -1.0, 0.125]) * rng.uniform(0.5, 1, n)).astype(
        dtype
    )
    ar = spardl.make("dense", comm, n, op=op, wire_dtype="float16", nonfinite="raise")
    out = ar(g).to_dense()
    want, _ = _reference_float16(comm, g, op)
    assert out.tobytes() == want.tobytes()
    assert_identical_everywhere(comm, ar(g))
    exact = np.zeros(n, np.float64)
    comm.Allreduce(g.astype(np.float64) / (comm.size if op == "mean" else 1), exact, op=MPI.SUM)
    assert np.all(np.isfinite(out)) and np.all(out != 0)
    rtol = 2.0**-10 * (comm.size + 1)  # each value and each partial sum rounded to 11 bits
    if not (dtype == np.float64 and mag < 1e-300):  # float64 subnormals have fewer bits
        np.testing.assert_allclose(out, exact, rtol=rtol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float16_wire_overflow_raises_on_every_rank(comm, dtype):
    """A sum past the dtype's largest value is ±inf: NonFiniteError on every rank (the step not
    applied) under nonfinite="raise", returned as inf only under "propagate"; a mean of values
    at the largest value is finite or raised, never a silent inf."""
    n, top = 4, np.finfo(dtype).max
    g = np.array([top, -top, 1.0, top / (4 * comm.size)], dtype)  # the last sums to top / 4
    if comm.size > 1:
        ar = spardl.make("dense", comm, n, op="sum", wire_dtype="float16", nonfinite="raise")
        with pytest.raises(spardl.NonFiniteError):
            ar(g)
        assert ar.step == 0
        prop = spardl.make("dense", comm, n, op="sum", wire_dtype="float16", nonfinite="propagate")
        d = prop(g).to_dense()
        assert np.isposinf(d[0]) and np.isneginf(d[1]) and np.all(np.isfinite(d[2:]))
    ar = spardl.make("dense", comm, n, wire_dtype="float16", nonfinite="raise")
    try:
        d = ar(g).to_dense()
    except spardl.NonFiniteError:
        assert ar.step == 0
    else:
        assert np.all(np.isfinite(d)) and ar.step == 1
    comm.Barrier()


@pytest.mark.parametrize(
    ("wire_dtype", "error"), [("float8", ValueError), ("bfloat16", ValueError), (16, TypeError)]
)
def test_bad_wire_dtype_is_refused_on_every_rank(comm, wire_dtype, error):
    with pytest.raises(error, match="wire_dtype"):
        spardl.make("dense", comm, 8, wire_dtype=wire_dtype)
