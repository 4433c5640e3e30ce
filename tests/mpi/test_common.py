"""The contract every algorithm of spardl.ALGORITHMS keeps, and the cases of docs/design.md §9.

Runs on every rank under `mpiexec -n P` (see tests/test_mpi.py) for P in {1, 2, 3, 4, 5, 6, 8}.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from mpiutil import assert_identical_everywhere, conservation_error, grads_for

import spardl

ALGS = sorted(spardl.ALGORITHMS)
CONSERVING = [a for a in ALGS if spardl.ALGORITHMS[a].conserves]


def _expect_error_everywhere(comm, fn, exc=(ValueError, TypeError), match=None):
    """fn() raises on every rank (the test itself is reached by every rank, so no hang)."""
    with pytest.raises(exc, match=match):
        fn()
    comm.Barrier()


@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [13, 64, 1001])
def test_density_one_is_exact_mean(comm, algorithm, dtype, n):
    """C9: with nothing to drop, the output is the mean of the inputs."""
    grads = grads_for(comm, n, dtype, seed=n)
    ar = spardl.make(algorithm, comm, n, density=1.0)
    out = ar(grads[comm.rank])
    assert_identical_everywhere(comm, out)
    want = np.mean(np.stack(grads).astype(np.float64), axis=0)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out.to_dense(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("algorithm", CONSERVING)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("n", "density"), [(13, 0.5), (1001, 0.01), (480, 0.05)])
def test_conservation_over_steps(comm, algorithm, dtype, n, density):
    """Σ_r X_r = P·out + Σ_r E_r,new on every step (docs/design.md §4)."""
    ar = spardl.make(algorithm, comm, n, density=density)
    tol = 2e-6 if dtype == np.float32 else 1e-13
    for step in range(4):
        g = grads_for(comm, n, dtype, seed=100 + step, kind="heavy")[comm.rank]
        x = g.astype(np.float64) + ar.residual.astype(np.float64)
        out = ar(g)
        assert_identical_everywhere(comm, out)
        assert np.all(np.diff(out.indices) > 0)
        err = conservation_error(comm, x, out.to_dense(), ar.residual, "mean")
        assert err <= tol, f"step {step}: conservation error {err:.3g}"


@pytest.mark.parametrize(
    ("algorithm", "key", "value", "exc", "match"),
    [
        ("spardl", "h", 2.5, ValueError, "state h must be an integer, got float"),
        ("spardl", "h", "2", ValueError, "state h must be an integer, got str"),
        ("oktopk", "global_threshold", -1.0, ValueError, "global_threshold must be >= 0"),
        ("oktopk", "global_threshold", "1", ValueError, "global_threshold must be a float"),
    ],
)
def test_an_algorithm_state_of_the_wrong_kind_is_refused(comm, algorithm, key, value, exc, match):
    """Values of the algorithm's own state that it once took as they came: SparDL's h through
    int() (2.5 became 2), a negative Ok-Topk threshold (its next step returned more than k
    entries). Refused on every rank, the state unchanged."""
    P = comm.size
    opts = {"teams": P} if algorithm == "spardl" else {}
    a = spardl.make(algorithm, comm, 300, density=0.05, **opts)
    a(np.random.default_rng(comm.rank).standard_normal(300).astype(np.float32))
    good = a.state_dict()
    bad = {**good, "extra": {**good["extra"], key: value}}
    with pytest.raises((TypeError, ValueError)) as info:
        a.load_state_dict(bad if comm.rank == P - 1 else good)
    if comm.rank == P - 1:
        assert isinstance(info.value, exc) and match in str(info.value), info.value
    assert a.state_dict()["extra"][key] == good["extra"][key]


@pytest.mark.every_comm
@pytest.mark.parametrize("algorithm", ALGS)
def test_c1_output_is_the_top_selection(comm, algorithm):
    """C1 (any P; the reported fault was at P = 1): the output holds the largest entries."""
    n = 100
    if comm.size == 1:
        g = grads_for(comm, n, np.float64, seed=1)[0]
        out = spardl.make(algorithm, comm, n, density=0.05)(g)
        np.testing.assert_array_equal(out.values, g[out.indices])
        rest = np.delete(np.abs(g), out.indices)
        assert out.nnz >= 1
        assert np.min(np.abs(out.values)) >= np.max(rest, initial=0.0)
    else:
        g = grads_for(comm, n, np.float64, seed=1)[comm.rank]
        out = spardl.make(algorithm, comm, n, density=0.05)(g)
        assert_identical_everywhere(comm, out)
        assert out.nnz >= 1


@pytest.mark.every_comm
@pytest.mark.parametrize("algorithm", ALGS)
def test_c2_a_rank_with_nothing_to_send(comm, algorithm):
    """C2: rank 1's gradient is all zeros; same output everywhere, no hang, conservation."""
    n = 50
    g = grads_for(comm, n, np.float64, seed=2)[comm.rank]
    if comm.rank == 1:
        g[:] = 0
    ar = spardl.make(algorithm, comm, n, density=0.1)
    for _ in range(2):
        x = g + ar.residual
        out = ar(g)
        assert_identical_everywhere(comm, out)
        if ar.conserves:
            assert conservation_error(comm, x, out.to_dense(), ar.residual, "mean") <= 1e-13


@pytest.mark.every_comm
@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("density", [0.5, 0.2])
def test_c3_uneven_splits(comm, algorithm, density):
    """C3: n = 13 for every P (not divisible by most P); identical and conserving."""
    n = 13
    g = grads_for(comm, n, np.float32, seed=3)[comm.rank]
    ar = spardl.make(algorithm, comm, n, density=density)
    x = g.astype(np.float64)
    out = ar(g)
    assert_identical_everywhere(comm, out)
    assert out.indices.dtype == np.int64
    assert np.all((out.indices >= 0) & (out.indices < n))
    if ar.conserves:
        assert conservation_error(comm, x, out.to_dense(), ar.residual, "mean") <= 2e-6


@pytest.mark.every_comm
@pytest.mark.parametrize("algorithm", ALGS)
def test_c4_single_nonzero_is_reduced(comm, algorithm):
    """C4: rank r holds (r+1)·e₀; the output at index 0 is the mean (P+1)/2, nothing else."""
    n = 100
    g = np.zeros(n, np.float32)
    g[0] = comm.rank + 1
    out = spardl.make(algorithm, comm, n, density=0.01)(g)
    assert_identical_everywhere(comm, out)
    dense = out.to_dense()
    assert dense[0] == np.float32((comm.size + 1) / 2)
    assert np.all(dense[1:] == 0)
    np.testing.assert_array_equal(out.indices, [0])  # no explicit zeros listed


@pytest.mark.parametrize("algorithm", ALGS)
def test_c5_budget_from_density(comm, algorithm):
    """C5: k = ⌊ρ·n⌋ = 10 for n = 1000 and ρ = 0.01, on every rank."""
    ar = spardl.make(algorithm, comm, 1000, density=0.01)
    assert ar.k == 10
    assert comm.allgather(ar.k) == [10] * comm.size


@pytest.mark.parametrize("algorithm", ALGS)
def test_c6_float16_mean_does_not_overflow(comm, algorithm):
    """C6: float16 gradients of 60000 everywhere, density 1, mean: 60000, finite."""
    n = 16
    g = np.full(n, 60000.0, np.float16)
    out = spardl.make(algorithm, comm, n, density=1.0)(g)
    assert out.values.dtype == np.float16
    assert np.all(np.isfinite(out.values))
    np.testing.assert_array_equal(out.to_dense(), g)


@pytest.mark.parametrize("algorithm", ALGS)
def test_c7_mismatched_n_raises_everywhere(comm, algorithm):
    """C7: ranks constructed with different n fail together, naming n, without a hang."""
    if comm.size == 1:
        pytest.skip("needs two ranks")
    n = 101 if comm.rank == 0 else 100
    _expect_error_everywhere(
        comm, lambda: spardl.make(algorithm, comm, n, density=0.1), ValueError, match="n"
    )


@pytest.mark.parametrize("algorithm", ALGS)
def test_c7_mismatched_call_raises_everywhere(comm, algorithm):
    """C7, at call time: one rank passes a gradient of the wrong length."""
    ar = spardl.make(algorithm, comm, 100, density=0.1)
    g = np.ones(101 if comm.rank == comm.size - 1 else 100, np.float32)
    _expect_error_everywhere(comm, lambda: ar(g), ValueError, match="length")
    # the allreducer is still usable afterwards, on every rank
    out = ar(np.ones(100, np.float32))
    assert_identical_everywhere(comm, out)


@pytest.mark.parametrize("algorithm", ALGS)
def test_c8_nan_raises_everywhere_and_applies_nothing(comm, algorithm):
    """C8: one NaN on rank 0 raises NonFiniteError on every rank; residuals unchanged (the
    whole state: tests/mpi/test_transactions.py)."""
    n = 64
    ar = spardl.make(algorithm, comm, n, density=0.1)
    ar(grads_for(comm, n, np.float32, seed=8)[comm.rank])
    before = ar.residual.copy()
    step = ar.step
    g = grads_for(comm, n, np.float32, seed=9)[comm.rank]
    if comm.rank == 0:
        g[7] = np.nan
    _expect_error_everywhere(comm, lambda: ar(g), spardl.NonFiniteError)
    np.testing.assert_array_equal(ar.residual, before)
    assert ar.step == step


@pytest.mark.parametrize("algorithm", ALGS)
def test_nonfinite_skip_drops_the_step_everywhere(comm, algorithm):
    """An Inf on the last rank: the step is skipped on every rank, with no NumPy warning on
    any (a warning turned into an error on one rank would split the ranks)."""
    n = 64
    ar = spardl.make(algorithm, comm, n, density=0.1, nonfinite="skip")
    ar(np.ones(n, np.float32))  # a step first: residuals that inf - inf can meet
    g = grads_for(comm, n, np.float32, seed=10)[comm.rank]
    if comm.rank == comm.size - 1:
        g[3] = np.inf
    before = np.array(ar.residual, copy=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = ar(g)
    assert out.nnz == 0
    assert ar.stats["skipped_steps"] == 1
    np.testing.assert_array_equal(ar.residual, before)


@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"density": 0.0}, "density"),
        ({"density": 1.5}, "density"),
        ({"density": "0.1"}, "density"),
        ({"op": "max"}, "op"),
        ({"op": 1}, "op must be a string"),
        ({"residual": None}, "residual must be a string"),
        ({"residual": "sometimes"}, "residual"),
        ({"nonfinite": "ignore"}, "nonfinite"),
        ({"nonfinite": "skip"}, "nonfinite"),  # valid, but not what the other ranks said
        ({"no_such_option": 1}, "no_such_option"),
    ],
)
def test_bad_arguments_raise_everywhere(comm, algorithm, kwargs, match):
    """Bad arguments on the LAST rank only: every rank raises, naming the argument."""
    if comm.size == 1 and kwargs == {"nonfinite": "skip"}:
        pytest.skip("a valid value; the disagreement needs two ranks")
    good = {"density": 0.1}
    mine = {**good, **kwargs} if comm.rank == comm.size - 1 else good
    _expect_error_everywhere(comm, lambda: spardl.make(algorithm, comm, 50, **mine), match=match)


@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize(
    "bad",
    [np.ones((4, 25), np.float32), np.ones(100, np.int32), np.ones(100, np.complex64)],
    ids=["2d", "int32", "complex"],
)
def test_bad_gradient_raises_everywhere(comm, algorithm, bad):
    ar = spardl.make(algorithm, comm, 100, density=0.1)
    g = bad if comm.rank == 0 else np.ones(100, np.float32)
    _expect_error_everywhere(comm, lambda: ar(g), match="grad")


def test_a_byte_swapped_float_gradient_is_named_as_such(comm):
    ar = spardl.make("topka", comm, 100, density=0.1)
    g = np.ones(100, np.dtype(np.float32).newbyteorder("S"))
    _expect_error_everywhere(comm, lambda: ar(g), match="non-native byte order")


def test_unknown_algorithm_on_one_rank_raises_everywhere(comm):
    name = "no-such-algorithm" if comm.rank == 0 else "dense"
    _expect_error_everywhere(comm, lambda: spardl.make(name, comm, 10), ValueError)


@pytest.mark.parametrize("algorithm", ALGS)
def test_state_dict_resume_is_bit_identical(comm, algorithm):
    """Save after two steps, load into a fresh allreducer: the next steps match bit for bit."""
    n = 300
    steps = [grads_for(comm, n, np.float32, seed=20 + s)[comm.rank] for s in range(4)]
    a = spardl.make(algorithm, comm, n, density=0.05)
    for g in steps[:2]:
        a(g)
    state = a.state_dict()
    b = spardl.make(algorithm, comm, n, density=0.05)
    b.load_state_dict(state)
    for g in steps[2:]:
        oa, ob = a(g), b(g)
        np.testing.assert_array_equal(oa.indices, ob.indices)
        np.testing.assert_array_equal(oa.values, ob.values)
        np.testing.assert_array_equal(a.residual, b.residual)


@pytest.mark.parametrize("algorithm", ALGS)
def test_state_from_another_configuration_is_rejected(comm, algorithm):
    a = spardl.make(algorithm, comm, 300, density=0.05)
    a(np.ones(300, np.float32))
    b = spardl.make(algorithm, comm, 301, density=0.05)
    with pytest.raises(ValueError, match="n"):
        b.load_state_dict(a.state_dict())
    other = "dense" if algorithm != "dense" else ALGS[0]
    if other != algorithm:
        c = spardl.make(other, comm, 300, density=0.05)
        with pytest.raises(ValueError, match="algorithm"):
            c.load_state_dict(a.state_dict())


@pytest.mark.parametrize("algorithm", [a for a in ALGS if a != "dense"])
def test_a_residual_is_not_loaded_where_it_would_be_dropped(comm, algorithm):
    """A state saved with error feedback once loaded into residual="none", which ignored the
    entries it had yet to apply while its state_dict kept returning them: refused on every rank
    (the last rank's residual alone is non-zero), with the state unchanged. A residual="none"
    state (zeros) still loads there, and the refused one into residual="local"."""
    n = 300
    g = grads_for(comm, n, np.float32, seed=5)[comm.rank]
    a = spardl.make(algorithm, comm, n, density=0.05, residual="local")
    a(g)
    state = a.state_dict()
    assert np.any(state["residual"] != 0)
    if comm.rank != comm.size - 1:
        state["residual"] = np.zeros_like(state["residual"])
    b = spardl.make(algorithm, comm, n, density=0.05, residual="none")
    with pytest.raises(ValueError) as info:
        b.load_state_dict(state)
    if comm.rank == comm.size - 1:
        assert "residual='none', which would drop them" in str(info.value)
    assert b.state_dict()["step"] == 0 and b.state_dict()["residual"] is None
    c = spardl.make(algorithm, comm, n, density=0.05, residual="none")
    c(g)
    b.load_state_dict(c.state_dict())
    assert b.state_dict()["step"] == 1
    d = spardl.make(algorithm, comm, n, density=0.05, residual="local")
    d.load_state_dict(state)
    np.testing.assert_array_equal(d.residual, state["residual"])
    for ar in (a, b, c, d):
        ar.comm.free()


@pytest.mark.parametrize("algorithm", ["spardl", "oktopk"])
def test_a_state_of_another_selector_is_named_as_such(comm, algorithm):
    """A state saved with selector="exact" loaded into selector="threshold" was called
    "malformed": it names the option on both sides now, on every rank, the state unchanged."""
    n = 200
    a = spardl.make(algorithm, comm, n, density=0.05, selector="exact")
    a(grads_for(comm, n, np.float32, seed=9)[comm.rank])
    b = spardl.make(algorithm, comm, n, density=0.05, selector="threshold")
    with pytest.raises(ValueError) as info:
        b.load_state_dict(a.state_dict())
    assert "state was saved with selector='exact', this allreducer has selector='threshold'" in (
        str(info.value)
    )
    assert "malformed" not in str(info.value) and b.state_dict()["step"] == 0
    for ar in (a, b):
        ar.comm.free()


MALFORMED = [
    ({"residual": np.zeros(300, np.float64)}, TypeError, "residual has dtype"),
    ({"residual": np.zeros(300, np.int64)}, TypeError, "residual has dtype"),
    ({"residual": np.full(300, np.nan, np.float32)}, ValueError, "NaN or Inf"),
    ({"step": 1.5}, TypeError, "step"),
    ({"step": True}, TypeError, "step"),
    ({"step": -1}, ValueError, "step"),
    ({"calls": -7}, ValueError, "calls"),
    ({"dtype": "int32"}, TypeError, "dtype"),
]


@pytest.mark.parametrize("algorithm", ALGS)
def test_malformed_state_is_rejected_at_load(comm, algorithm):
    """A state with a residual of the wrong dtype or non-finite values, or counters that are not
    counts: refused at load, naming what is wrong, with the state unchanged (the last rank's
    state only is bad: every rank raises). Two allreducers for all cases: each holds MPI
    communicators, of which a process has a bounded number."""
    a = spardl.make(algorithm, comm, 300, density=0.05)
    a(np.ones(300, np.float32))
    a(np.ones(300, np.float32))
    good = a.state_dict()
    b = spardl.make(algorithm, comm, 300, density=0.05)
    for change, exc, match in MALFORMED:
        if "residual" in change and good["residual"] is None:
            continue  # dense keeps no residual
        state = {**good, **change} if comm.rank == comm.size - 1 else good
        with pytest.raises((TypeError, ValueError)) as info:
            b.load_state_dict(state)
        if comm.rank == comm.size - 1:
            assert isinstance(info.value, exc) and match in str(info.value), change
        assert b.state_dict()["step"] == 0 and b.state_dict()["calls"] == 0, change
    b.load_state_dict(good)  # and the good state still loads
    assert b.state_dict()["step"] == good["step"]
    a.comm.free()
    b.comm.free()


@pytest.mark.every_comm
@pytest.mark.parametrize("algorithm", ALGS)
def test_sum_is_P_times_mean(comm, algorithm):
    n = 200
    g = grads_for(comm, n, np.float64, seed=30)[comm.rank]
    mean = spardl.make(algorithm, comm, n, density=0.1, op="mean")(g)
    total = spardl.make(algorithm, comm, n, density=0.1, op="sum")(g)
    np.testing.assert_array_equal(mean.indices, total.indices)
    np.testing.assert_allclose(total.values, mean.values * comm.size, rtol=1e-12)


@pytest.mark.parametrize("algorithm", ALGS)
def test_constant_gradient_is_not_starved(comm, algorithm):
    """Every entry ties: the selection still sends about k entries (ties to the lower index)."""
    n = 100
    ar = spardl.make(algorithm, comm, n, density=0.1)
    for _ in range(2):
        x = np.ones(n) + ar.residual
        out = ar(np.ones(n))
        assert_identical_everywhere(comm, out)
        assert out.nnz >= 1
        if ar.conserves:
            assert conservation_error(comm, x, out.to_dense(), ar.residual, "mean") <= 1e-13
