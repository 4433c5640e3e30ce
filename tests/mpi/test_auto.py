"""``spardl.make("auto", ...)``: one decision on every rank, conservation across switches,
``stats["auto"]``, transactions and checkpoints, bad options refused on every rank.

Runs on every rank under `mpiexec -n P` (tests/test_mpi.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from mpi4py import MPI
from mpiutil import assert_identical_everywhere, conservation_error, grads_for

import spardl
from spardl.algorithms.auto import candidate_names, explain

P = MPI.COMM_WORLD.Get_size()
N = 96
#: Rates that make the model's choice depend on the density alone: β dominates (sparse at
#: density 0.05, dense at density 1).
RATES = {"alpha": 0.0, "beta": 1e-3}


def _same_everywhere(comm, obj):
    everyone = comm.allgather(obj)
    assert all(o == everyone[0] for o in everyone), everyone


def _step(comm, ar, seed, dtype=np.float64):
    """One step on every rank; returns (X of this rank, the result)."""
    g = grads_for(comm, N, dtype, seed=seed)[comm.rank]
    x = g.astype(np.float64) + np.asarray(ar.residual, np.float64)
    return x, ar(g)


def test_same_decision_on_every_rank_with_measured_rates(comm):
    """Ping-pong rates and measured local work: every rank makes the same choices, results are
    identical everywhere, and the trials visit every candidate in order (prune=0)."""
    ar = spardl.make("auto", comm, N, density=0.05, interval=2, trials=1, prune=0)
    names = candidate_names(P)
    _same_everywhere(comm, (ar.alpha, ar.beta))
    seen = []
    for s in range(len(names) + 5):
        seen.append(ar.stats["auto"]["choice"])
        _, out = _step(comm, ar, 10 + s)
        assert_identical_everywhere(comm, out)
        rep = ar.stats["auto"]
        _same_everywhere(comm, (rep["choice"], rep["candidates"], rep["decisions"]))
    assert seen[: len(names)] == names
    assert ar.stats["auto"]["decisions"] == 3  # after the trials, then every 2 steps
    assert ar.stats["steps"] == len(names) + 5


def test_conservation_across_switches(comm):
    """Σ_r X_r = P·out + Σ_r E_r on every step while the choice moves: the trials through every
    candidate (sparse to sparse), then (trials=0: the model decides) to dense, the residual
    flushed, and back."""
    names = candidate_names(P)
    trials = spardl.make("auto", comm, N, density=0.05, interval=1, trials=1, prune=0, **RATES)
    model = spardl.make("auto", comm, N, density=0.05, interval=1, trials=0, **RATES)
    for ar, densities in ((trials, [0.05] * (len(names) + 2)), (model, [0.05, 1, 1, 0.05, 0.05])):
        chosen = []
        for s, rho in enumerate(densities):
            if rho != ar.density:
                ar.set_density(rho)
            x, out = _step(comm, ar, 40 + s)
            chosen.append(ar.stats["auto"]["choice"])
            err = conservation_error(comm, x, out.to_dense(), ar.residual, "mean")
            assert err < 1e-12, (s, chosen, err)
    assert trials.stats["auto"]["switches"] >= len(names) - 1
    if P > 1:
        # Density 1 is dense's (β dominates: it sends the fewest bytes), 0.05 a sparse one's.
        assert chosen == [chosen[0], "dense", "dense", chosen[0], chosen[0]], chosen
        assert chosen[0] != "dense"


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_flush_on_switch_to_dense(comm, dtype):
    """The first dense step reduces g + E (the residual is flushed: nothing is lost), later
    ones the gradient alone. float32/64: dense's own step on X; float16: the generic step."""
    ar = spardl.make(
        "auto", comm, N, density=0.05, trials=1, candidates=["topka", "dense"], prune=0, **RATES
    )
    tol = {np.float64: 1e-12, np.float32: 1e-6, np.float16: 1e-3}[dtype]
    x, out = _step(comm, ar, 1, dtype)  # topka: a residual is left
    assert ar.stats["auto"]["choice"] == "dense" and np.any(np.asarray(ar.residual))
    x, out = _step(comm, ar, 2, dtype)  # the flush
    assert conservation_error(comm, x, out.to_dense(), ar.residual, "mean") < tol
    assert out.to_dense().dtype == dtype
    if dtype != np.float16:  # float16: the output's rounding remainder stays in the residual
        assert not np.any(np.asarray(ar.residual))
    steps = ar.stats["steps"]
    x, out = _step(comm, ar, 3, dtype)  # dense's own step on g
    assert conservation_error(comm, x, out.to_dense(), ar.residual, "mean") < tol
    assert ar.step == 3 and ar.stats["steps"] == steps + 1


def test_stats_auto_content(comm, tmp_path_factory):
    path = None
    if comm.rank == 0:
        path = str(tmp_path_factory.mktemp("fit") / "pingpong.json")
        with open(path, "w") as f:
            json.dump({"alpha": 2e-6, "beta": 1e-9, "gamma": None}, f)
    path = comm.bcast(path, root=0)
    ar = spardl.make("auto", comm, N, density=0.05, interval=3, trials=1, fit=path)
    names = candidate_names(P)
    rep = ar.stats["auto"]
    assert rep["phase"] == "trials" and rep["choice"] == names[0]
    assert rep["candidates"] == {name: None for name in names}
    assert (rep["alpha"], rep["beta"], rep["rates"]) == (2e-6, 1e-9, f"fit {path}")
    for s in range(len(names) + 1):  # dense, tried last, after the step that flushes E
        _step(comm, ar, 70 + s)
    rep = ar.stats["auto"]
    assert rep["phase"] == "chosen" and rep["decisions"] == 1
    assert rep["decided_at_step"] == len(names) + 1
    assert rep["choice"] in names and list(rep["candidates"]) == names
    for name, p in rep["candidates"].items():
        assert set(p) == {"communication", "local", "predicted", "measured", "mpi"}, name
        assert p["measured"] > 0 and p["measured"] >= p["local"] and p["mpi"] <= p["measured"]
        assert p["predicted"] == pytest.approx(p["communication"] + p["local"])
        if P == 1:
            assert p["communication"] == 0
    assert rep["conserves"] is True and rep["interval"] == 3 and rep["trials"] == 1
    text = explain(rep)
    assert all(name in text for name in names) and "*" in text
    d, w = rep["decisions"], rep["switches"]
    assert (
        f"{d} decision{'' if d == 1 else 's'}, {w} switch{'' if w == 1 else 'es'} (trials" in text
    )
    # gTop-k only when named; then the allreducer does not promise conservation.
    g = spardl.make("auto", comm, N, candidates=["gtopk", "spardl"], trials=0, **RATES)
    assert g.conserves is False and list(g.stats["auto"]["candidates"])[0] == "gtopk"
    assert "gtopk" not in names


def test_prune_skips_what_the_link_rules_out(comm):
    """A candidate whose modelled communication alone exceeds ``prune`` times the fastest step
    measured is not tried: here dense (8-14 s of modelled communication against real steps of
    milliseconds, even on a loaded machine), on every rank alike; the trials end sooner and never
    choose it. Sparse ones (modelled 12-84 ms) may be pruned too, by timing. P = 1: every
    candidate's communication is 0, so every one is tried."""
    n = 100_000
    rates = {"alpha": 0.0, "beta": 1e-5}
    ar = spardl.make("auto", comm, n, density=0.001, interval=50, trials=2, **rates)
    names = candidate_names(P)
    assert names[-1] == "dense"  # tried last, after the sparse steps that can rule it out
    seen = []
    for s in range(2 * len(names) + 2):
        seen.append(ar.stats["auto"]["choice"])
        g = grads_for(comm, n, np.float32, seed=120 + s)[comm.rank]
        x = g.astype(np.float64) + np.asarray(ar.residual, np.float64)
        out = ar(g)
        assert conservation_error(comm, x, out.to_dense(), ar.residual, "mean") < 1e-4
        _same_everywhere(comm, (ar.stats["auto"]["choice"], ar.stats["auto"]["not_tried"]))
    rep = ar.stats["auto"]
    assert rep["phase"] == "chosen" and rep["decisions"] == 1 and rep["prune"] == 2.0
    if P == 1:
        assert rep["not_tried"] == [] and "dense" in seen
    else:
        tried = [name for name in names if name not in rep["not_tried"]]
        assert "dense" in rep["not_tried"] and "dense" not in seen
        assert rep["decided_at_step"] == 2 * len(tried)
        assert seen[: 2 * len(tried)] == [name for name in tried for _ in range(2)]
        assert rep["choice"] != "dense" and rep["candidates"]["dense"]["measured"] is None
        assert "not tried" in explain(rep)


def test_model_choice_without_trials(comm):
    """trials=0: the α-β model alone decides, at construction and every interval."""
    ar = spardl.make("auto", comm, N, density=1.0, trials=0, **RATES)
    rep = ar.stats["auto"]
    assert rep["decisions"] == 1 and all(p["local"] is None for p in rep["candidates"].values())
    if P > 1:
        assert rep["choice"] == "dense"
    # α dominates: the fewest rounds (P = 1: every candidate is free, the first one wins).
    ar = spardl.make("auto", comm, N, density=0.05, trials=0, alpha=1.0, beta=0.0)
    best = min(ar.stats["auto"]["candidates"].items(), key=lambda kv: kv[1]["predicted"])[0]
    assert ar.stats["auto"]["choice"] == best


def _state(ar):
    st = ar.state_dict()
    return (
        st["step"],
        st["calls"],
        np.array(st["residual"]).tobytes() if st["residual"] is not None else None,
        repr(st["extra"]),
    )


@pytest.mark.parametrize("when", ["sparse", "flush", "dense"])
def test_failed_step_leaves_state_unchanged(comm, when):
    """A step that raises (NaN) or is skipped (Inf) changes nothing, also when it is the
    flushing step of a switch to dense or a dense step."""
    ar = spardl.make("auto", comm, N, density=0.05, interval=1, trials=0, **RATES)
    skip = spardl.make(
        "auto", comm, N, density=0.05, interval=1, trials=0, nonfinite="skip", **RATES
    )
    for a in (ar, skip):
        _step(comm, a, 1)
        if when != "sparse":
            a.set_density(1.0)
            _step(comm, a, 2)  # decides for dense: the next step flushes
        if when == "dense":
            _step(comm, a, 3)
    for a, bad, exc in ((ar, np.nan, spardl.NonFiniteError), (skip, np.inf, None)):
        before = _state(a)
        choice = a.stats["auto"]["choice"]
        g = grads_for(comm, N, np.float64, seed=9)[comm.rank]
        if comm.rank == P - 1:
            g[3] = bad
        if exc is None:
            out = a(g)
            assert out.nnz == 0
        else:
            with pytest.raises(exc):
                a(g)
        assert _state(a) == before and a.stats["auto"]["choice"] == choice
        x, out = _step(comm, a, 4)  # and it goes on
        assert conservation_error(comm, x, out.to_dense(), a.residual, "mean") < 1e-12


def test_state_dict_round_trip(comm):
    """A state saved mid-run and loaded back continues bit for bit (trials=0: no timing)."""
    ar = spardl.make("auto", comm, N, density=0.05, interval=2, trials=0, **RATES)
    for s in range(3):
        _step(comm, ar, 80 + s)
    saved = ar.state_dict()
    first = [_step(comm, ar, 90 + s)[1].to_dense() for s in range(3)]
    ar.load_state_dict(saved)
    again = [_step(comm, ar, 90 + s)[1].to_dense() for s in range(3)]
    for a, b in zip(first, again, strict=True):
        assert a.tobytes() == b.tobytes()


def test_state_dict_mid_trials(comm):
    """A state saved inside the trials resumes them where they stood: the same candidate, the
    same steps left in its block, then the next candidates in order."""
    ar = spardl.make("auto", comm, N, density=0.05, interval=5, trials=2, prune=0, **RATES)
    names = candidate_names(P)
    for s in range(3):  # the first candidate's two steps and one of the second's
        _step(comm, ar, 100 + s)
    saved = ar.state_dict()
    fresh = spardl.make("auto", comm, N, density=0.05, interval=5, trials=2, prune=0, **RATES)
    fresh.load_state_dict(saved)
    seen = []
    for s in range(2 * len(names) - 2):  # dense's block: the flushing step, then its two
        seen.append(fresh.stats["auto"]["choice"])
        _step(comm, fresh, 110 + s)
    assert names[-1] == "dense"
    assert seen == [names[1]] + [name for name in names[2:-1] for _ in range(2)] + ["dense"] * 3
    assert fresh.stats["auto"]["phase"] == "chosen" and fresh.stats["auto"]["decisions"] == 1


def test_failed_load_leaves_no_candidate_state_behind(comm):
    """A load that fails on one rank (a NaN in its residual) fails on every rank and leaves
    nothing of the state behind, also not the saved candidate's state where that candidate is
    not built yet: afterwards the allreducer steps exactly as a fresh one."""
    n = 2000
    opts = dict(density=0.05, interval=100, trials=2, prune=0, alpha=0.0, beta=1e-9)

    def grad(s):
        return np.random.default_rng(1000 * s + comm.rank).standard_normal(n).astype(np.float32)

    a = spardl.make("auto", comm, n, **opts)
    names = candidate_names(P)
    for s in range(2 * names.index("oktopk") + 1):  # saved while Ok-Topk is in its trials
        a(grad(s))
    state = a.state_dict()
    state["residual"] = np.array(state["residual"], copy=True)
    if comm.rank == 0:
        state["residual"][0] = np.nan
    b = spardl.make("auto", comm, n, **opts)
    fresh = spardl.make("auto", comm, n, **opts)
    with pytest.raises(ValueError):
        b.load_state_dict(state)
    assert b._pending == {}
    # Every trial step (dense's block: the flushing step, then its two). The decision after
    # them follows each allreducer's measured times, so the steps after it are not compared.
    for s in range(2 * len(names) + 1):
        assert b.stats["auto"]["choice"] == fresh.stats["auto"]["choice"]
        ours, theirs = b(grad(100 + s)), fresh(grad(100 + s))
        np.testing.assert_array_equal(ours.to_dense(), theirs.to_dense())
    assert b.stats["auto"]["phase"] == fresh.stats["auto"]["phase"] == "chosen"


def test_ranks_disagreeing_on_the_trials_refuse_a_load(comm):
    """States whose trial counters differ between ranks would desynchronise the trials'
    collectives: the load raises on every rank and changes nothing."""
    ar = spardl.make("auto", comm, N, density=0.05, interval=5, trials=2, prune=0, **RATES)
    for s in range(3):
        _step(comm, ar, 130 + s)
    state = ar.state_dict()
    if P > 1 and comm.rank == P - 1:
        state["extra"] = dict(state["extra"], trial=[state["extra"]["trial"][0], 0])
    before = _state(ar)
    if P == 1:
        ar.load_state_dict(state)
        return
    with pytest.raises(ValueError, match="disagree|other counters"):
        ar.load_state_dict(state)
    assert _state(ar) == before


def test_state_saved_before_prune_loads_by_name(comm):
    """A state saved before ``prune`` (``trial_start``; the default candidates then had dense
    first): its timings land on the candidates they belong to, by name; saved inside the trials,
    the trials start again."""
    ar = spardl.make("auto", comm, N, density=0.05, interval=50, trials=1, prune=0, **RATES)
    names = candidate_names(P)
    for s in range(len(names) + 2):
        _step(comm, ar, 140 + s)
    state = ar.state_dict()
    extra = dict(state["extra"])
    old = ["dense", *names[:-1]]  # the old default order
    times = dict(zip(names, extra["times"], strict=True))
    for key in ("trial", "since", "not_tried"):
        del extra[key]
    extra["times"] = [times[name] for name in old]
    after = {**state, "extra": {**extra, "trial_start": 0}}
    b = spardl.make("auto", comm, N, density=0.05, interval=50, trials=1, prune=0, **RATES)
    b.load_state_dict(after)
    assert [list(w) for w in b._times] == [list(w) for w in ar._times]
    # the old count: the steps since trials x candidates steps after trial_start
    assert b.stats["auto"]["phase"] == "chosen" and b._since == state["step"] - len(names)
    inside = {**state, "extra": {**extra, "trial_start": state["step"] - 1}}
    c = spardl.make("auto", comm, N, density=0.05, interval=50, trials=1, prune=0, **RATES)
    c.load_state_dict(inside)
    assert c.stats["auto"]["phase"] == "trials" and c.stats["auto"]["choice"] == names[0]


BAD = [
    ({"interval": 0}, ValueError, "interval"),
    ({"interval": 2.0}, TypeError, "interval"),
    ({"trials": -1}, ValueError, "trials"),
    ({"alpha": 1e-6}, ValueError, "alpha and beta"),
    ({"alpha": -1.0, "beta": 0.0}, ValueError, "alpha"),
    ({"alpha": 0.0, "beta": float("inf")}, ValueError, "beta"),
    ({"hysteresis": 1.0}, ValueError, "hysteresis"),
    ({"prune": 0.5}, ValueError, "prune"),
    ({"prune": float("inf")}, ValueError, "prune"),
    ({"prune": "2"}, TypeError, "prune"),
    ({"candidates": "dense"}, TypeError, "candidates"),
    ({"candidates": []}, ValueError, "candidates"),
    ({"candidates": ["nope"]}, ValueError, "candidates"),
    ({"candidates": [f"spardl:d={P + 1}"]}, ValueError, "candidates"),
    ({"fit": 3}, TypeError, "fit"),
    ({"fit": "x.json", "alpha": 0.0, "beta": 0.0}, ValueError, "fit"),
    ({"fit": "/nonexistent/pingpong.json"}, ValueError, "fit"),
    ({"teams": 2}, TypeError, "teams"),
]


@pytest.mark.parametrize("options,exc,word", BAD, ids=[repr(b[0]) for b in BAD])
@pytest.mark.parametrize("where", ["all", "rank0"])
def test_bad_options_raise_on_every_rank(comm, options, exc, word, where):
    mine = options if where == "all" or comm.rank == 0 else {}
    if where == "rank0" and P > 1 and "fit" in options and "alpha" not in options:
        mine = options  # fit: a path every rank names (rank 0 reads it)
    with pytest.raises(exc) as info:
        spardl.make("auto", comm, N, **{"trials": 0, **mine})
    assert word in str(info.value)
