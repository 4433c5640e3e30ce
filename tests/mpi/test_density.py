"""Allreducer.set_density: a new ρ between steps, agreed on every rank, residuals kept.

Runs on every rank under `mpiexec -n P python -m pytest tests/mpi/test_density.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpiutil import assert_identical_everywhere, conservation_error, grads_for

import spardl
from spardl.algorithms.base import budget

ALGS = sorted(spardl.ALGORITHMS)
CONSERVING = [a for a in ALGS if spardl.ALGORITHMS[a].conserves]
#: ρ per step: down (a warm-up), up, down to the smallest k, and density 1 (exact mean).
SCHEDULE = [0.25, 0.1, 0.02, 0.5, 0.004, 1.0, 0.05]


@pytest.mark.parametrize("algorithm", CONSERVING)
def test_conservation_across_density_changes(comm, algorithm):
    """Σ_r X_r = P·out + Σ_r E_r,new at every step while ρ changes between steps, and k
    follows ρ (at ρ = 1 the output is every entry)."""
    n = 480
    ar = spardl.make(algorithm, comm, n, density=SCHEDULE[0])
    for step, rho in enumerate(SCHEDULE):
        ar.set_density(rho)
        assert ar.density == rho and ar.k == budget(rho, n)
        g = grads_for(comm, n, np.float64, seed=300 + step, kind="heavy")[comm.rank]
        x = g + ar.residual.astype(np.float64)
        out = ar(g)
        assert_identical_everywhere(comm, out)
        err = conservation_error(comm, x, out.to_dense(), ar.residual, "mean")
        assert err <= 1e-13, f"step {step} (ρ={rho}): conservation error {err:.3g}"
        if rho == 1.0:
            assert not np.any(ar.residual), "density 1 leaves nothing in the residual"


@pytest.mark.parametrize("algorithm", ALGS)
def test_density_change_equals_a_fresh_allreducer_at_density_one(comm, algorithm):
    """After set_density(1) the output is the exact mean of g + E (any algorithm)."""
    n = 101
    ar = spardl.make(algorithm, comm, n, density=0.05)
    ar(grads_for(comm, n, np.float64, seed=7)[comm.rank])
    ar.set_density(1.0)
    grads = grads_for(comm, n, np.float64, seed=8)
    res = np.stack(comm.allgather(np.asarray(ar.residual, np.float64)))
    out = ar(grads[comm.rank])
    want = (np.sum(np.stack(grads), axis=0) + np.sum(res, axis=0)) / comm.size
    np.testing.assert_allclose(out.to_dense(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("algorithm", ["spardl", "oktopk"])
def test_state_dict_carries_the_density(comm, algorithm):
    """A checkpoint taken after set_density resumes at that ρ, bit for bit."""
    n = 300
    a = spardl.make(algorithm, comm, n, density=0.2)
    a.set_density(0.03)
    for s in range(3):
        a(grads_for(comm, n, np.float32, seed=40 + s)[comm.rank])
    b = spardl.make(algorithm, comm, n, density=0.2)
    b.load_state_dict(a.state_dict())
    assert b.density == 0.03 and b.k == a.k
    for s in range(3, 5):
        g = grads_for(comm, n, np.float32, seed=40 + s)[comm.rank]
        oa, ob = a(g), b(g)
        assert oa.indices.tobytes() == ob.indices.tobytes()
        assert oa.values.tobytes() == ob.values.tobytes()
    assert a.residual.tobytes() == b.residual.tobytes()


def test_a_spardl_density_edited_without_its_h_names_the_density(comm):
    """A SparDL state whose density was edited by hand (its h kept): the load refuses h and
    says at which density it checked it, on every rank, and keeps the old state."""
    n = 1000
    a = spardl.make("spardl", comm, n, density=0.05)
    a(grads_for(comm, n, np.float32, seed=3)[comm.rank])
    state = a.state_dict()
    state["density"] = 0.04
    with pytest.raises(ValueError, match=r"h=\d+, outside .* at its density 0.04"):
        a.load_state_dict(state)
    assert a.density == 0.05


@pytest.mark.parametrize("algorithm", ["spardl", "topka", "dense"])
def test_density_change_on_one_rank_only_fails_everywhere(comm, algorithm):
    """One rank changes ρ, the others step: every rank raises (no hang), naming set_density;
    the state is unchanged and the allreducer keeps working."""
    if comm.size == 1:
        pytest.skip("needs two ranks")
    n = 64
    ar = spardl.make(algorithm, comm, n, density=0.1)
    g = grads_for(comm, n, np.float64, seed=3)[comm.rank]
    with pytest.raises(ValueError, match="set_density"):
        if comm.rank == 0:
            ar.set_density(0.5)
        else:
            ar(g)
    assert ar.density == 0.1 and ar.step == 0
    out = ar(g)  # every rank again in step
    assert_identical_everywhere(comm, out)


def test_density_disagreement_and_bad_values_fail_everywhere(comm):
    ar = spardl.make("spardl", comm, 64, density=0.1)
    if comm.size > 1:
        with pytest.raises(ValueError, match="ranks disagree on set_density"):
            ar.set_density(0.2 if comm.rank == 0 else 0.3)
    bad = 0 if comm.rank == comm.size - 1 else 0.2
    with pytest.raises(ValueError, match=r"density must be in \(0, 1\]"):
        ar.set_density(bad)
    with pytest.raises(TypeError, match="density must be a float"):
        ar.set_density("0.1" if comm.rank == 0 else 0.1)
    assert ar.density == 0.1
    comm.Barrier()


@pytest.mark.parametrize("algorithm", ["spardl", "oktopk", "dense"])
def test_numpy_scalar_densities_are_compared_by_value(comm, algorithm):
    """NumPy floats and integers are densities like Python numbers, and ranks whose NumPy
    densities differ fail on every rank, at construction and in set_density (they once gave the
    same check field, -1, on every rank: different k on each rank, then a truncated message and
    a hang)."""
    n = 1000
    ar = spardl.make(algorithm, comm, n, density=np.int64(1))
    assert ar.density == 1.0 and ar.k == n
    ar.set_density(np.float32(0.25))
    assert ar.density == float(np.float32(0.25))
    ar.set_density(np.float64(0.1))
    assert ar.k == budget(0.1, n)
    out = ar(grads_for(comm, n, np.float64, seed=5)[comm.rank])
    assert_identical_everywhere(comm, out)
    if comm.size == 1:
        return
    mine = np.float32(0.01) if comm.rank == 0 else np.float32(0.5)
    with pytest.raises(ValueError, match="ranks disagree on density"):
        spardl.make(algorithm, comm, n, density=mine)
    with pytest.raises(ValueError, match="ranks disagree on set_density"):
        ar.set_density(mine)
    assert ar.density == 0.1
    comm.Barrier()
