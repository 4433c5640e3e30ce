"""Nothing is lost to the output's precision: with float16 gradients, the rounding remainder of
every output value goes into one rank's residual, so Σ_r X_r = P·out + Σ_r E_r holds to float32
rounding, underflow to 0 and overflow past 65504 included (docs/reliability.md §1).

Runs on every rank under `mpiexec -n P` (tests/test_mpi.py), P ∈ {1, 2, 3, 4, 5, 6, 8}.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpiutil import assert_identical_everywhere, conservation_error, grads_for

import spardl

ALGS = sorted(spardl.ALGORITHMS)
FEEDBACK = [a for a in ALGS if spardl.ALGORITHMS[a].rounding_feedback]
CONSERVING = [a for a in FEEDBACK if spardl.ALGORITHMS[a].conserves]
TINY = np.float16(1.19e-7)  # twice the smallest float16 subnormal (5.96e-8)
TOL = 1e-6  # float32 rounding of the residuals, relative to max |Σ_r X_r|


def _step(comm, ar, g, op="mean"):
    """One call; returns the output and the conservation error of that step."""
    x = g.astype(np.float32).astype(np.float64) + np.asarray(ar.residual, np.float64)
    out = ar(g)
    assert_identical_everywhere(comm, out)
    assert out.values.dtype == np.float16
    assert np.all(np.isfinite(out.values))
    return out, conservation_error(comm, x, out.to_dense().astype(np.float64), ar.residual, op)


def _mass(comm, v):
    total = np.zeros(len(v), np.float64)
    comm.Allreduce(np.asarray(v, np.float64), total, op=MPI.SUM)
    return total


@pytest.mark.parametrize("algorithm", CONSERVING)
def test_underflowing_mean_is_kept_in_the_residuals(comm, algorithm):
    """An underflowing mean: rank 0 holds 1.19e-7 on 16 of 64 entries, the others zeros. The mean
    (1.19e-7/P) rounds to 0 (or up, at P = 3) in float16; over steps, the mass the ranks put in
    is exactly what came out plus what the residuals hold."""
    n, P = 64, comm.size
    ar = spardl.make(algorithm, comm, n, density=0.25)
    g = np.zeros(n, np.float16)
    if comm.rank == 0:
        g[:16] = TINY
    put_in = np.zeros(n, np.float64)
    came_out = np.zeros(n, np.float64)
    for step in range(6):
        out, err = _step(comm, ar, g)
        assert err <= TOL, f"step {step}: conservation error {err:.3g}"
        put_in += _mass(comm, g.astype(np.float64))
        came_out += P * out.to_dense().astype(np.float64)
    held = _mass(comm, ar.residual)
    np.testing.assert_allclose(came_out + held, put_in, rtol=0, atol=TOL * float(TINY))


@pytest.mark.parametrize("algorithm", CONSERVING)
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_overflow_is_clamped_and_the_excess_kept(comm, algorithm, op):
    """Sums past float16's range: the output is the largest finite float16 (never inf) and the
    excess stays in the residuals."""
    n = 16
    ar = spardl.make(algorithm, comm, n, density=1.0, op=op)
    g = np.full(n, 60000.0, np.float16)
    if op == "mean":
        # A mean past 65504 needs X = g + E beyond float16: load a float32 residual first.
        g = np.full(n, 1.0, np.float16)
        state = ar.state_dict()
        state["dtype"] = "float16"
        state["residual"] = np.full(n, 70000.0, np.float32)
        ar.load_state_dict(state)
    out, err = _step(comm, ar, g, op)
    assert err <= TOL, f"conservation error {err:.3g}"
    expect_clamp = op == "mean" or comm.size > 1
    if expect_clamp:
        np.testing.assert_array_equal(out.values, np.float16(65504.0))


@pytest.mark.parametrize("algorithm", CONSERVING)
@pytest.mark.parametrize("density", [0.05, 0.5, 1.0])
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_float16_conserves_to_float32_rounding(comm, algorithm, density, op):
    """Random float16 gradients of several magnitudes: conservation to 1e-6, every step."""
    n = 200
    ar = spardl.make(algorithm, comm, n, density=density, op=op)
    for step in range(4):
        g = grads_for(comm, n, np.float64, seed=700 + step, kind="heavy")[comm.rank]
        g = (g * 10.0 ** (step - 2)).astype(np.float16)
        _, err = _step(comm, ar, g, op)
        assert err <= TOL, f"step {step}: conservation error {err:.3g}"


def test_remainders_stay_with_the_owner_of_the_block(comm):
    """The remainder of index i goes to the rank owning i's block of uniform_bounds(n, P) only:
    with every rank sending the same tiny value, the residuals outside a rank's block are 0."""
    from spardl_kernels import uniform_bounds

    n, P = 64, comm.size
    ar = spardl.make("topka", comm, n, density=1.0)
    g = np.full(n, TINY, np.float16)
    if P > 1:
        g[:] = 0
        if comm.rank == 0:
            g[:] = TINY
    out, err = _step(comm, ar, g)
    assert err <= TOL
    b = uniform_bounds(n, P)
    mine = np.zeros(n, bool)
    mine[b[comm.rank] : b[comm.rank + 1]] = True
    assert np.all(np.asarray(ar.residual)[~mine] == 0)


@pytest.mark.parametrize("algorithm", [a for a in ALGS if a not in FEEDBACK])
def test_without_rounding_feedback_the_output_is_still_finite(comm, algorithm):
    """dense keeps no residual: its float16 output is the float32 mean rounded once (clamped to
    ±65504), and the rounding remainder is dropped; its residual stays zero."""
    n = 16
    ar = spardl.make(algorithm, comm, n, density=1.0, op="sum")
    out = ar(np.full(n, 60000.0, np.float16))
    assert np.all(np.isfinite(out.values))
    assert np.all(np.asarray(ar.residual) == 0)


@pytest.mark.parametrize("algorithm", FEEDBACK)
def test_no_residual_means_no_remainder(comm, algorithm):
    """residual="none": the remainder has nowhere to go, the residual stays zero."""
    n = 64
    ar = spardl.make(algorithm, comm, n, density=0.25, residual="none")
    g = np.zeros(n, np.float16)
    if comm.rank == 0:
        g[:16] = TINY
    ar(g)
    assert np.all(np.asarray(ar.residual) == 0)


@pytest.mark.parametrize("algorithm", ALGS)
def test_a_nan_elsewhere_leaves_the_finite_values_clamped_and_their_excess_kept(comm, algorithm):
    """nonfinite="propagate" with one NaN (rank 0, index 1): the other sums are rounded as in
    any step. They were cast as a whole: a sum past 65504 became +inf, and its remainder was
    dropped from the residuals."""
    n, P = 4, comm.size

    def run(nonfinite, nan):
        ar = spardl.make(algorithm, comm, n, density=1.0, op="sum", nonfinite=nonfinite)
        g = np.array([60000, 1, 2, 3], np.float16)
        if nan and comm.rank == 0:
            g[1] = np.nan
        out = ar(g).to_dense()
        return out, _mass(comm, ar.residual)

    clean, clean_mass = run("raise", nan=False)
    out, mass = run("propagate", nan=True)
    assert np.isnan(out[1])
    assert out[0] == clean[0] == np.float16(min(60000.0 * P, 65504.0))
    np.testing.assert_array_equal(out[2:], clean[2:])
    np.testing.assert_array_equal(mass[[0, 2, 3]], clean_mass[[0, 2, 3]])
