"""Ok-Topk under MPI: against the single-process reference, conservation with threshold reuse and
region re-balancing, the paper's message bound, and the collective cases for oktopk."""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpiutil import (
    assert_identical_everywhere,
    assert_sparse_equal,
    conservation_error,
    grads_for,
)
from ref_oktopk import ref_oktopk_step

import spardl


def _mean(sums, P, dtype):
    return (sums / sums.dtype.type(P)).astype(dtype) if P > 1 else sums.astype(dtype)


def _check_against_reference(comm, ar, xs, want_bounds=None):
    """Run one step of ``ar`` on this rank's X and compare it with the reference, bit for bit."""
    P, r = comm.size, comm.rank
    work = xs[r].dtype
    out = ar(xs[r] - ar.residual)  # grad = X − E_old, so that the allreducer forms X again
    idx, sums, residuals, bounds = ref_oktopk_step(xs, ar.k, bounds=want_bounds)
    assert_identical_everywhere(comm, out)
    np.testing.assert_array_equal(ar.bounds, bounds)
    assert_sparse_equal(out, idx, _mean(sums, P, work))
    np.testing.assert_array_equal(ar.residual, residuals[r])
    return bounds


@pytest.mark.every_comm
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("n", "density"), [(13, 0.5), (5, 0.2), (200, 0.05), (1001, 0.01)])
def test_first_step_equals_the_reference(comm, dtype, n, density):
    """Step 0 uses exact thresholds: same regions, sums, output and residuals as the reference.
    (n = 13 is case C3; n = 5 with k = 1 leaves most regions empty for P > 1.)"""
    xs = grads_for(comm, n, dtype, seed=n, kind="heavy")
    ar = spardl.make("oktopk", comm, n, density=density)
    _check_against_reference(comm, ar, xs)


def test_exact_mode_equals_the_reference_over_steps(comm):
    """selector="exact", τ' = 1: every step is exact; regions are reused between τ = 2 steps."""
    n, density = 300, 0.04
    ar = spardl.make(
        "oktopk",
        comm,
        n,
        density=density,
        selector="exact",
        threshold_interval=1,
        region_interval=2,
    )
    residuals = None
    bounds = None
    for step in range(5):
        gs = grads_for(comm, n, np.float64, seed=40 + step, kind="heavy")
        if residuals is None:
            xs = gs
        else:
            xs = [g + e for g, e in zip(gs, residuals, strict=True)]
        reuse = bounds if step % 2 else None
        bounds = _check_against_reference(comm, ar, xs, want_bounds=reuse)
        residuals = comm.allgather(ar.residual)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("kind", ["normal", "heavy"])
def test_conservation_with_threshold_reuse_and_rebalancing(comm, dtype, kind):
    """τ' = 3 and τ = 2: reused and nudged thresholds, regions moving; nothing is lost."""
    n, density = 500, 0.03
    ar = spardl.make("oktopk", comm, n, density=density, threshold_interval=3, region_interval=2)
    # float16 outputs are rounded to half precision (relative 2^-11) after the exact sums.
    tol = {np.float64: 1e-13, np.float32: 2e-6, np.float16: 1e-3}[dtype]
    seen_bounds = []
    for step in range(7):
        g = grads_for(comm, n, dtype, seed=50 + step, kind=kind)[comm.rank]
        x = g.astype(np.float64) + ar.residual.astype(np.float64)
        out = ar(g)
        assert_identical_everywhere(comm, out)
        assert np.all(np.diff(out.indices) > 0)
        assert out.values.dtype == dtype
        err = conservation_error(comm, x, out.to_dense(), ar.residual, "mean")
        assert err <= tol, f"step {step}: conservation error {err:.3g}"
        b = ar.bounds
        assert b[0] == 0 and b[-1] == n and np.all(np.diff(b) >= 0)
        seen_bounds.append(b.copy())
    # Boundaries change only on region steps (0, 2, 4, 6).
    for step in (1, 3, 5):
        np.testing.assert_array_equal(seen_bounds[step], seen_bounds[step - 1])


def test_local_residual_forgets_what_was_sent(comm):
    """residual="local": E = X with this rank's selection zeroed, elsewhere untouched."""
    n = 200
    g = grads_for(comm, n, np.float64, seed=60)[comm.rank]
    ar = spardl.make("oktopk", comm, n, density=0.05, residual="local")
    ar(g)
    zeroed = ar.residual == 0
    assert np.count_nonzero(zeroed) == ar.k  # step 0 selects exactly the local top-k
    np.testing.assert_array_equal(ar.residual[~zeroed], g[~zeroed])
    assert np.min(np.abs(g[zeroed])) >= np.max(np.abs(g[~zeroed]))


def test_density_one_is_the_exact_mean_on_every_step(comm):
    """C9 with threshold reuse on: density 1 never drops anything, on any step."""
    n = 40
    ar = spardl.make("oktopk", comm, n, density=1.0, threshold_interval=2, region_interval=3)
    for step in range(4):
        gs = grads_for(comm, n, np.float64, seed=70 + step)
        out = ar(gs[comm.rank])
        np.testing.assert_array_equal(out.indices, np.arange(n))
        np.testing.assert_allclose(out.values, np.mean(gs, axis=0), rtol=1e-12, atol=1e-15)
        assert np.all(ar.residual == 0)


def test_messages_within_the_paper_bound(comm):
    """Data messages per step: 2P, +1 on region steps, +1 on threshold steps; never above
    (2P + 2 log₂P) (Li & Hoefler, Eq. 3; a collective counts 1 here). P = 1 sends nothing."""
    P = comm.size
    n, tau_prime, tau = 400, 3, 2
    ar = spardl.make(
        "oktopk", comm, n, density=0.05, threshold_interval=tau_prime, region_interval=tau
    )
    before = ar.stats["messages"]
    for step in range(6):
        ar(grads_for(comm, n, np.float32, seed=80 + step)[comm.rank])
        sent = ar.stats["messages"] - before
        before = ar.stats["messages"]
        if P == 1:
            assert sent == 0
            continue
        assert sent == 2 * P + (step % tau == 0) + (step % tau_prime == 0)
        assert sent <= 2 * P + 2 * math.log2(P)
    phases = ar.stats["phases"]
    if P > 1:
        for name in ("split_reduce", "global_threshold", "balance", "allgather"):
            assert phases[name]["messages"] > 0, name
        assert phases["split_reduce"]["messages"] == 6 * (P - 1) + 3  # + region steps 0, 2, 4
        assert phases["global_threshold"]["messages"] == 2  # steps 0 and 3
        assert phases["allgather"]["messages"] == 6
    assert phases.get("select", {}).get("messages", 0) == 0


def test_c2_zero_rank_matches_the_reference(comm):
    """C2: rank 1 sends nothing (all zeros): no hang, and the exact step-0 answer."""
    n = 50
    xs = grads_for(comm, n, np.float64, seed=2)
    if comm.size > 1:
        xs[1][:] = 0
    ar = spardl.make("oktopk", comm, n, density=0.1)
    _check_against_reference(comm, ar, xs)


def test_all_zero_gradients(comm):
    """Nothing anywhere: every rank selects zeros, the output is all zero, no hang."""
    n = 30
    ar = spardl.make("oktopk", comm, n, density=0.1, threshold_interval=2)
    for _ in range(3):
        out = ar(np.zeros(n, np.float32))
        assert_identical_everywhere(comm, out)
        assert np.all(out.values == 0)
        assert np.all(ar.residual == 0)


def test_resume_with_reused_state_is_bit_identical(comm):
    """Regions, global threshold and selector state survive a checkpoint mid-interval."""
    n = 300
    kw = {"density": 0.05, "threshold_interval": 4, "region_interval": 3}
    grads = [grads_for(comm, n, np.float32, seed=90 + s)[comm.rank] for s in range(6)]
    a = spardl.make("oktopk", comm, n, **kw)
    for g in grads[:3]:
        a(g)
    b = spardl.make("oktopk", comm, n, **kw)
    b.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(a.bounds, b.bounds)
    for g in grads[3:]:
        oa, ob = a(g), b(g)
        np.testing.assert_array_equal(oa.indices, ob.indices)
        np.testing.assert_array_equal(oa.values, ob.values)
        np.testing.assert_array_equal(a.residual, b.residual)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"threshold_interval": 0}, "threshold_interval"),
        ({"threshold_interval": 2.5}, "threshold_interval"),
        ({"region_interval": -1}, "region_interval"),
        ({"region_interval": True}, "region_interval"),
        ({"selector": "sampling"}, "selector"),
        ({"selector": None}, "selector must be a string"),
    ],
)
def test_bad_options_raise_everywhere(comm, kwargs, match):
    """A bad option on the last rank only: every rank raises, naming the option."""
    mine = kwargs if comm.rank == comm.size - 1 else {}
    with pytest.raises((ValueError, TypeError), match=match):
        spardl.make("oktopk", comm, 50, density=0.1, **mine)
