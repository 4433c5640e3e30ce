"""The peers (topka, gaussiank, topkdsa, gtopk) under mpiexec: against the single-process
references of tests/ref_peers.py, the conservation invariant, and docs/design.md §9."""

from __future__ import annotations

import numpy as np
import pytest
from mpiutil import (
    assert_identical_everywhere,
    assert_sparse_equal,
    conservation_error,
    grads_for,
)
from ref_peers import REFERENCES, ref_gtopk

import spardl
from spardl import NonFiniteError

PEERS = ["topka", "gaussiank", "topkdsa", "gtopk"]
CONSERVING = ["topka", "gaussiank", "topkdsa"]


def _work(dtype):
    return np.float32 if np.dtype(dtype) == np.float16 else dtype


def _allx(comm, x):
    """Every rank's X = g + E_old (work dtype), on every rank."""
    return [np.asarray(v) for v in comm.allgather(np.array(x, copy=True))]


def _ref_mean(sums, P, dtype):
    if P > 1:
        sums = sums / sums.dtype.type(P)
    return sums.astype(dtype)


@pytest.mark.every_comm
@pytest.mark.parametrize("algorithm", PEERS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n,density", [(13, 0.3), (1001, 0.3), (None, 0.1)])
def test_matches_reference(comm, algorithm, dtype, n, density):
    """Two steps: output and this rank's residual equal the reference bit for bit."""
    P = comm.size
    n = 24 * P if n is None else n  # None: a multiple of P
    ar = spardl.make(algorithm, comm, n, density=density)
    for step in range(2):
        g = grads_for(comm, n, dtype, seed=step + 7 * n, kind="heavy" if step else "normal")
        x = g[comm.rank].astype(_work(dtype)) + ar.residual
        xs = _allx(comm, x)
        out = ar(g[comm.rank])
        assert_identical_everywhere(comm, out)
        ri, rv, rres = REFERENCES[algorithm](xs, ar.k)
        assert_sparse_equal(out, ri, _ref_mean(rv, P, dtype))
        assert out.indices.dtype == np.int64
        assert np.all(np.diff(out.indices) > 0)
        assert out.values.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(ar.residual, rres[comm.rank])


@pytest.mark.parametrize("algorithm", CONSERVING)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [13, 1001])
def test_conservation_over_steps(comm, algorithm, dtype, n):
    """Σ_r X_r = P·out + Σ_r E_r,new on every one of several consecutive steps."""
    ar = spardl.make(algorithm, comm, n, density=0.05)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for step in range(3):
        g = grads_for(comm, n, dtype, seed=100 + step, kind="heavy")[comm.rank]
        x = g.astype(dtype) + ar.residual
        out = ar(g)
        assert_identical_everywhere(comm, out)
        assert conservation_error(comm, x, out.to_dense(), ar.residual, "mean") <= tol


def test_gtopk_reports_dropped_mass(comm):
    """The re-selections' loss is reported (> 0 when partial sums are dropped) and equals the
    reference's; at density 1 nothing is dropped."""
    P, n = comm.size, 200
    ar = spardl.make("gtopk", comm, n, density=0.05)
    assert spardl.ALGORITHMS["gtopk"].conserves is False
    g = grads_for(comm, n, np.float64, seed=3)
    out = ar(g[comm.rank])
    assert_identical_everywhere(comm, out)
    want = ref_gtopk(g, ar.k)[3]
    got = ar.stats["dropped_mass"]
    assert isinstance(got, float)
    assert comm.allgather(got) == [got] * P
    np.testing.assert_allclose(got, want, rtol=1e-12)
    if P > 1:
        assert got > 0
        # What is not conserved is the dropped mass at surviving coordinates, at most all of it.
        err = conservation_error(comm, g[comm.rank], out.to_dense(), ar.residual, "mean")
        assert err > 0
    else:
        assert got == 0.0
    full = spardl.make("gtopk", comm, n, density=1.0)
    full(g[comm.rank])
    assert full.stats["dropped_mass"] == 0.0


@pytest.mark.every_comm
@pytest.mark.parametrize("algorithm", PEERS)
@pytest.mark.parametrize("dtype,n", [(np.float64, 13), (np.float32, 1001)])
def test_density_one_exact_mean(comm, algorithm, dtype, n):
    """C9: density 1 gives the exact mean of the inputs; gtopk then conserves too (E = 0)."""
    grads = grads_for(comm, n, dtype, seed=n + 1)
    ar = spardl.make(algorithm, comm, n, density=1.0)
    out = ar(grads[comm.rank])
    assert_identical_everywhere(comm, out)
    want = np.mean(np.stack(grads).astype(np.float64), axis=0)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out.to_dense(), want, rtol=tol, atol=tol)
    assert not np.any(ar.residual)


@pytest.mark.parametrize("algorithm", PEERS)
def test_messages_counted(comm, algorithm):
    """Message counts per step follow each algorithm's schedule."""
    P, n = comm.size, 1001
    ar = spardl.make(algorithm, comm, n, density=0.01)
    ar(grads_for(comm, n, np.float32, seed=5)[comm.rank])
    msgs = ar.stats["messages"]
    if P == 1:
        assert msgs == 0
    elif algorithm == "topka":
        assert msgs == 1
    elif algorithm == "gaussiank":
        assert msgs == 2
    elif algorithm == "topkdsa":
        assert msgs == (P - 1) + 2
    else:  # gtopk: one send up the tree (all but rank 0), then the broadcast
        assert msgs == (0 if comm.rank == 0 else 1) + 1


# -- docs/design.md §9 ---------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", PEERS)
def test_c1_c5_budget_and_single_rank(comm, algorithm):
    """C5: k = ⌊ρn⌋ = 10 for n = 1000, ρ = 0.01 on every rank. C1: P = 1, n = 100, ρ = 0.05:
    the output is the input's own selection (mean over one rank)."""
    ar = spardl.make(algorithm, comm, 1000, density=0.01)
    assert comm.allgather(ar.k) == [10] * comm.size
    if comm.size != 1:
        return
    rng = np.random.default_rng(1)
    g = rng.standard_normal(100)
    ar = spardl.make(algorithm, comm, 100, density=0.05)
    out = ar(g)
    ri, rv, _ = REFERENCES[algorithm]([g], ar.k)
    assert_sparse_equal(out, ri, g[ri])
    np.testing.assert_array_equal(out.to_dense() + ar.residual, g)


@pytest.mark.parametrize("algorithm", PEERS)
def test_c2_zero_gradient_rank(comm, algorithm):
    """C2: rank 1's gradient is all zeros: same output everywhere, no hang, conservation."""
    n = 50
    g = grads_for(comm, n, np.float64, seed=11)
    if comm.size > 1:
        g[1][:] = 0
    ar = spardl.make(algorithm, comm, n, density=0.1)
    for _ in range(2):
        x = g[comm.rank] + ar.residual
        xs = _allx(comm, x)
        out = ar(g[comm.rank])
        assert_identical_everywhere(comm, out)
        ri, rv, _ = REFERENCES[algorithm](xs, ar.k)
        assert_sparse_equal(out, ri, _ref_mean(rv, comm.size, np.float64))
        if spardl.ALGORITHMS[algorithm].conserves:
            assert conservation_error(comm, x, out.to_dense(), ar.residual, "mean") <= 1e-12


@pytest.mark.parametrize("algorithm", PEERS)
def test_c3_uneven_splits(comm, algorithm):
    """C3: n = 13, density 0.5 (n not divisible by P, P not a power of two): the reference."""
    g = grads_for(comm, 13, np.float64, seed=13)
    ar = spardl.make(algorithm, comm, 13, density=0.5)
    out = ar(g[comm.rank])
    assert_identical_everywhere(comm, out)
    ri, rv, _ = REFERENCES[algorithm](g, ar.k)
    assert_sparse_equal(out, ri, _ref_mean(rv, comm.size, np.float64))


@pytest.mark.every_comm
@pytest.mark.parametrize("algorithm", PEERS)
def test_c4_single_coordinate_is_reduced(comm, algorithm):
    """C4: rank r sends (r+1)·e₀: the output is index 0 with the mean (P+1)/2 (2.5 at P = 4)."""
    P, n = comm.size, 100
    g = np.zeros(n)
    g[0] = comm.rank + 1
    out = spardl.make(algorithm, comm, n, density=0.01)(g)
    assert_identical_everywhere(comm, out)
    dense = out.to_dense()
    assert dense[0] == (P + 1) / 2
    assert not np.any(dense[1:])


@pytest.mark.parametrize("algorithm", PEERS)
def test_c6_half_precision_no_overflow(comm, algorithm):
    """C6: float16 gradients of 60000.0 at density 1, op mean: 60000.0, finite."""
    g = np.full(16, 60000.0, dtype=np.float16)
    out = spardl.make(algorithm, comm, 16, density=1.0)(g)
    assert out.values.dtype == np.float16
    assert np.all(np.isfinite(out.values))
    np.testing.assert_array_equal(out.to_dense(), g)


@pytest.mark.parametrize("algorithm", PEERS)
def test_c7_mismatched_n_raises_everywhere(comm, algorithm):
    """C7: ranks disagree on n: ValueError on every rank, no hang."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    n = 100 if comm.rank == 0 else 101
    with pytest.raises(ValueError, match="n"):
        spardl.make(algorithm, comm, n, density=0.1)


@pytest.mark.parametrize("algorithm", PEERS)
def test_c8_nan_raises_everywhere(comm, algorithm):
    """C8: rank 0's gradient holds one NaN: NonFiniteError on every rank, residual unchanged."""
    n = 64
    g = grads_for(comm, n, np.float32, seed=8)[comm.rank]
    if comm.rank == 0:
        g[17] = np.nan
    ar = spardl.make(algorithm, comm, n, density=0.1)
    before = ar.residual.copy()
    with pytest.raises(NonFiniteError):
        ar(g)
    np.testing.assert_array_equal(ar.residual, before)


def test_gaussiank_bad_option_everywhere(comm):
    """Bad options raise on every rank, naming the argument."""
    with pytest.raises(ValueError, match="corrections"):
        spardl.make("gaussiank", comm, 100, corrections=-1)
    with pytest.raises(TypeError, match="corrections"):
        spardl.make("gaussiank", comm, 100, corrections=1.5)


def test_topkdsa_switches_dense_past_break_even(comm):
    """A region that fills in past nnz·(4 + vsz) ≥ len·vsz travels dense (all its coordinates);
    a sparse one stays sparse. Density 0.6 in float32: every rank's own part alone passes 1/2."""
    n = 40 * comm.size
    g = grads_for(comm, n, np.float32, seed=21)
    ar = spardl.make("topkdsa", comm, n, density=0.6)
    out = ar(g[comm.rank])
    assert ar.stats["dense_regions"] == 1  # this rank's region
    ri, rv, _ = REFERENCES["topkdsa"](g, ar.k)
    assert_sparse_equal(out, ri, _ref_mean(rv, comm.size, np.float32))
    sparse = spardl.make("topkdsa", comm, n, density=0.02)
    out = sparse(g[comm.rank])
    assert sparse.stats["dense_regions"] == 0
    assert out.nnz <= sparse.k * comm.size


@pytest.mark.parametrize("algorithm", PEERS)
def test_residual_modes(comm, algorithm):
    """ "local" zeroes every sent coordinate (for gtopk, also those that did not survive);
    "none" keeps no residual. The outputs of the first step do not depend on the mode."""
    n = 120
    g = grads_for(comm, n, np.float64, seed=31)[comm.rank]
    outs, res = {}, {}
    for mode in ("global", "local", "none"):
        ar = spardl.make(algorithm, comm, n, density=0.05, residual=mode)
        outs[mode] = ar(g)
        res[mode] = ar.residual.copy()
    for mode in ("local", "none"):
        np.testing.assert_array_equal(outs[mode].indices, outs["global"].indices)
        np.testing.assert_array_equal(outs[mode].values, outs["global"].values)
    assert not np.any(res["none"])
    sent = res["local"] == 0
    assert np.all(res["local"][~sent] == g[~sent])
    if algorithm == "gtopk":
        # global gives back the locally selected values whose coordinate did not survive
        back = (res["global"] != 0) & sent
        np.testing.assert_array_equal(res["global"][back], g[back])
        assert not np.any(np.isin(np.flatnonzero(back), outs["global"].indices))
    else:
        np.testing.assert_array_equal(res["local"], res["global"])
