"""A step that raises or is skipped leaves the allreducer's whole state as it was
(docs/reliability.md §3), and density 1 is the exact mean on every call, for every algorithm and
option combination.

Runs on every rank under `mpiexec -n P` (tests/test_mpi.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI
from mpiutil import assert_identical_everywhere, grads_for

import spardl

P = MPI.COMM_WORLD.Get_size()
N = 48


def _configs():
    """(algorithm, options) for every algorithm, selector, team count and residual mode."""
    out = []
    for algorithm in sorted(spardl.ALGORITHMS):
        variants = [{}]
        if algorithm == "spardl":
            teams = sorted({1, P} | ({2} if P % 2 == 0 else set()))
            variants = [{"teams": d, "selector": "exact"} for d in teams] + [
                {"teams": d, "selector": "threshold", "threshold_interval": 2} for d in teams
            ]
        elif algorithm == "oktopk":
            variants = [
                {"selector": s, "threshold_interval": 2, "region_interval": 3}
                for s in ("threshold", "exact")
            ]
        for opts in variants:
            for residual in ("global", "local", "none"):
                out.append((algorithm, {**opts, "residual": residual}))
    return out


CONFIGS = _configs()
IDS = [f"{a}-" + "-".join(f"{k}={v}" for k, v in o.items()) for a, o in CONFIGS]
FAILURES = ["nan_raises", "inf_skipped", "bad_length", "dtype_changed", "ranks_disagree"]
WIRES = ["coo", "compact"]

# Up to this world size the tests below built with _crossed run every configuration with every
# failure kind (every dtype and op, both wires). Above it (P = 5, 6 and 8 oversubscribe the
# test machine's cores several times), each configuration runs with one of them, taken in turn
# from an offset of P, so that P = 5, 6 and 8 together still run every algorithm with every one.
FULL_PRODUCT_MAX_P = 4


def _crossed(variants):
    """(algorithm, opts, variant) for every configuration: all variants, or one in turn."""
    out = []
    for i, (algorithm, opts) in enumerate(CONFIGS):
        mine = variants if P <= FULL_PRODUCT_MAX_P else [variants[(i + P) % len(variants)]]
        out += [(algorithm, opts, v) for v in mine]
    return out


def _crossed_ids(cases):
    return [
        f"{IDS[CONFIGS.index((a, o))]}-{'-'.join(v) if isinstance(v, tuple) else v}"
        for a, o, v in cases
    ]


FAILURE_CASES = _crossed(FAILURES)
MEAN_CASES = _crossed([(dtype, op) for dtype in ("float32", "float64") for op in ("mean", "sum")])


def assert_same_state(a, b, path="state"):
    """Two state_dict()s are equal: every key, every array bit for bit, NaN equal to NaN."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), path
        for k in a:
            assert_same_state(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            assert_same_state(u, v, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), f"{path} changed"
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), f"{path}: nan became {b!r}"
    else:
        assert a == b, f"{path}: {a!r} became {b!r}"


def _fail(comm, ar, kind, step):
    """Make ``ar`` fail (or skip) one call on every rank, in the way ``kind`` names."""
    g = grads_for(comm, N, np.float32, seed=50 + step)[comm.rank]
    last = comm.rank == comm.size - 1
    if kind == "nan_raises":
        if comm.rank == 0:
            g[5] = np.nan
        with pytest.raises(spardl.NonFiniteError):
            ar(g)
    elif kind == "inf_skipped":
        if last:
            g[7] = -np.inf
        out = ar(g)
        assert out.nnz == 0
    elif kind == "bad_length":
        bad = np.ones(N + 1, np.float32) if last else g
        with pytest.raises(ValueError, match="length"):
            ar(bad)
    elif kind == "dtype_changed":
        bad = g.astype(np.float64) if last else g
        with pytest.raises(TypeError, match="dtype"):
            ar(bad)
    elif kind == "ranks_disagree":
        # On the first call no rank is wrong alone: rank 0 sends float64, the others float32.
        bad = g.astype(np.float64) if comm.rank == 0 else g
        if comm.size == 1:
            bad = np.ones(N + 1, np.float32)  # one rank cannot disagree: a bad call instead
        with pytest.raises((ValueError, TypeError)):
            ar(bad)
    else:  # pragma: no cover
        raise ValueError(kind)
    comm.Barrier()


@pytest.mark.parametrize(
    ("algorithm", "opts", "kind"), FAILURE_CASES, ids=_crossed_ids(FAILURE_CASES)
)
def test_failed_step_leaves_the_state_unchanged(comm, algorithm, opts, kind):
    """state_dict() before and after a failed (or skipped) call is the same, and the next calls
    continue bit for bit as an allreducer that never saw the failure."""
    nonfinite = "skip" if kind == "inf_skipped" else "raise"
    a = spardl.make(algorithm, comm, N, density=0.1, nonfinite=nonfinite, **opts)
    b = spardl.make(algorithm, comm, N, density=0.1, nonfinite=nonfinite, **opts)
    warm = 0 if kind == "ranks_disagree" else 3  # thresholds, h and regions have moved
    for step in range(warm):
        g = grads_for(comm, N, np.float32, seed=step)[comm.rank]
        a(g)
        b(g)
    before = a.state_dict()
    _fail(comm, a, kind, warm)
    assert_same_state(before, a.state_dict())
    for step in range(warm, warm + 3):
        g = grads_for(comm, N, np.float32, seed=step)[comm.rank]
        oa, ob = a(g), b(g)
        assert_identical_everywhere(comm, oa)
        assert oa.indices.tobytes() == ob.indices.tobytes()
        assert oa.values.tobytes() == ob.values.tobytes()
    assert_same_state(b.state_dict(), a.state_dict())


@pytest.mark.parametrize(("algorithm", "opts"), CONFIGS, ids=IDS)
def test_failed_first_step_leaves_the_state_unchanged(comm, algorithm, opts):
    """A failure on the very first call: no dtype and no residual are left behind."""
    a = spardl.make(algorithm, comm, N, density=0.1, **opts)
    before = a.state_dict()
    _fail(comm, a, "nan_raises", 0)
    after = a.state_dict()
    assert after["dtype"] is None and after["residual"] is None
    assert_same_state(before, after)


@pytest.mark.parametrize(("algorithm", "opts", "case"), MEAN_CASES, ids=_crossed_ids(MEAN_CASES))
def test_density_one_is_the_exact_mean_on_every_call(comm, algorithm, opts, case):
    """Density 1 drops nothing: every call's output is the mean (sum) of that call's gradients,
    whatever the selector, the teams or the residual mode."""
    dtype, op = np.dtype(case[0]).type, case[1]
    n = 37
    ar = spardl.make(algorithm, comm, n, density=1.0, op=op, **opts)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for step in range(5):
        grads = grads_for(comm, n, dtype, seed=300 + step, kind="heavy" if step % 2 else "normal")
        out = ar(grads[comm.rank])
        assert_identical_everywhere(comm, out)
        total = np.sum(np.stack(grads).astype(np.float64), axis=0)
        want = total / comm.size if op == "mean" else total
        scale = max(1.0, float(np.max(np.abs(want))))
        np.testing.assert_allclose(
            out.to_dense(), want, rtol=tol, atol=tol * scale, err_msg=f"step {step}"
        )
        if opts["residual"] != "none":
            assert np.max(np.abs(ar.residual), initial=0.0) <= tol * scale, f"step {step}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "algorithm", sorted({a for a, _ in CONFIGS} - {"dense"}) + ["spardl:teams=2", "spardl:teams=P"]
)
def test_density_one_is_the_exact_mean_with_compact_messages(comm, algorithm, dtype):
    """wire="compact" rounds values to 16 bits below density 1; at density 1 it sends them
    unrounded, so the output is still the exact mean and the residuals stay zero. SparDL with
    d > 1 included: its team communicators, split off its own, send unrounded too."""
    n = 37
    algorithm, _, teams = algorithm.partition(":teams=")
    options = {}
    if teams:
        d = comm.size if teams == "P" else int(teams)
        if d == 1 or comm.size % d:
            pytest.skip(f"teams={teams} is not a new case at P={comm.size}")
        options["teams"] = d
    ar = spardl.make(algorithm, comm, n, density=1.0, wire="compact", **options)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for step in range(3):
        grads = grads_for(comm, n, dtype, seed=400 + step)
        out = ar(grads[comm.rank])
        assert_identical_everywhere(comm, out)
        want = np.sum(np.stack(grads).astype(np.float64), axis=0) / comm.size
        scale = max(1.0, float(np.max(np.abs(want))))
        np.testing.assert_allclose(out.to_dense(), want, rtol=tol, atol=tol * scale)
        assert np.max(np.abs(ar.residual), initial=0.0) <= tol * scale
    ar.comm.free()  # a process has a bounded number of MPI communicators


STATEFUL = [(a, o) for a, o in CONFIGS if a in ("spardl", "oktopk") and o["residual"] == "global"]
STATEFUL_IDS = [f"{a}-" + "-".join(f"{k}={v}" for k, v in o.items()) for a, o in STATEFUL]


def _warm(comm, algorithm, opts, density=0.1, steps=3):
    ar = spardl.make(algorithm, comm, N, density=density, **opts)
    for step in range(steps):
        ar(grads_for(comm, N, np.float32, seed=step)[comm.rank])
    return ar


@pytest.mark.parametrize(("algorithm", "opts"), STATEFUL, ids=STATEFUL_IDS)
def test_undoing_a_rejected_step_at_a_new_density_restores_the_state(comm, algorithm, opts):
    """A caller that changes ρ for a step and undoes the change when the step is rejected
    (``_snapshot``/``_restore``, as the torch integration and elastic resizing do) gets the
    state back exactly, h and thresholds included: ρ's budgets come back before the saved
    thresholds, which are checked against them."""
    a, b = _warm(comm, algorithm, opts), _warm(comm, algorithm, opts)
    before, saved = a.state_dict(), a._snapshot()
    a.set_density(0.3)
    _fail(comm, a, "nan_raises", 3)
    a._restore(saved)
    assert_same_state(before, a.state_dict())
    g = grads_for(comm, N, np.float32, seed=3)[comm.rank]
    oa, ob = a(g), b(g)
    assert oa.values.tobytes() == ob.values.tobytes()
    assert_same_state(b.state_dict(), a.state_dict())


@pytest.mark.parametrize(("algorithm", "opts"), STATEFUL, ids=STATEFUL_IDS)
def test_a_rejected_load_at_another_density_leaves_the_state_unchanged(comm, algorithm, opts):
    """load_state_dict of a state saved at another ρ whose algorithm part is malformed raises
    the malformed-state error on every rank and leaves everything as it was."""
    a = _warm(comm, algorithm, opts)
    state = _warm(comm, algorithm, opts, density=0.3, steps=1).state_dict()
    state["extra"] = {**state["extra"], "selector": {"kind": "none of them"}}
    before = a.state_dict()
    with pytest.raises(ValueError, match="malformed"):
        a.load_state_dict(state)
    assert_same_state(before, a.state_dict())


# every configuration with both wires (one in turn above FULL_PRODUCT_MAX_P); dense sends dense
# vectors whatever the wire: with "coo" only
WIRED = []
for _a, _o, _w in _crossed(WIRES):
    _case = (_a, _o, "coo" if _a == "dense" else _w)
    if _case not in WIRED:
        WIRED.append(_case)
WIRED_IDS = [f"{a}-{w}-" + "-".join(f"{k}={v}" for k, v in o.items()) for a, o, w in WIRED]


@pytest.mark.parametrize(("algorithm", "opts", "wire"), WIRED, ids=WIRED_IDS)
def test_a_propagated_nan_leaves_with_the_step_that_sent_it(comm, algorithm, opts, wire):
    """``nonfinite="propagate"``: a NaN and an inf in one rank's gradient reach the output of
    that step; what was sent of them leaves the senders' residuals (they rank above every
    finite value, so every algorithm sends them), so the next steps, on finite gradients, are
    finite everywhere, output and residuals."""
    ar = spardl.make(algorithm, comm, N, density=0.25, nonfinite="propagate", wire=wire, **opts)
    for step in range(4):
        g = grads_for(comm, N, np.float32, seed=90 + step)[comm.rank]
        if step == 1 and comm.rank == 0:
            g[5], g[17] = np.nan, np.inf
        out = ar(g)
        assert_identical_everywhere(comm, out)
        if step >= 2:
            assert np.all(np.isfinite(out.to_dense())), f"step {step}: a non-finite output"
            assert np.all(np.isfinite(ar.residual)), f"step {step}: a non-finite residual"
    ar.close()
