"""Cross-rank agreement of what a rank cannot check alone: loaded states whose ranks disagree on
something the collective schedule depends on (ρ, Ok-Topk's regions and global threshold,
SparDL's h across teams, auto's trial counters and current candidate), and fields no int64
holds. Each raises on every rank, leaves every rank's state as it was, and the allreducer keeps
working; none may hang or end in a truncated message.

Runs on every rank under `mpiexec -n P` (tests/test_mpi.py); at P = 1 there is no other rank to
differ, and the same loads must succeed.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from mpiutil import assert_identical_everywhere, grads_for
from overlap_state import three_parameter_state
from scripts.fake_bucket import FakeBucket

import spardl
import spardl.torch as st

ALGS = sorted(spardl.ALGORITHMS)


def _stepped(comm, algorithm, n, density, steps=3, **options):
    ar = spardl.make(algorithm, comm, n, density=density, **options)
    for s in range(steps):
        ar(grads_for(comm, n, np.float64, seed=60 + s)[comm.rank])
    return ar


def _still_in_step(comm, ar, before):
    """The failed load changed nothing on this rank, and every rank still agrees."""
    after = ar.state_dict()
    assert (after["step"], after["calls"], after["density"]) == (
        before["step"],
        before["calls"],
        before["density"],
    )
    np.testing.assert_array_equal(after["residual"], before["residual"])
    assert_identical_everywhere(comm, ar(grads_for(comm, ar.n, np.float64, seed=99)[comm.rank]))


def _load_expecting(comm, ar, state, match):
    """Load ``state``: at P = 1 it must load; else every rank raises ``match`` and keeps its
    state."""
    if comm.size == 1:
        ar.load_state_dict(state)
        assert_identical_everywhere(comm, ar(grads_for(comm, ar.n, np.float64, seed=98)[0]))
        return
    before = ar.state_dict()
    with pytest.raises(ValueError, match=match):
        ar.load_state_dict(state)
    _still_in_step(comm, ar, before)


@pytest.mark.parametrize("algorithm", ALGS)
def test_loaded_states_of_different_densities_fail_everywhere(comm, algorithm):
    """The last rank loads a state saved at another ρ (a valid state on its own): k and every
    message size differ, so every rank must refuse it (it once hung on a truncated message, or
    for Gaussian-k and dense gave ranks different results without a word)."""
    n = 400
    low = _stepped(comm, algorithm, n, 0.05)
    high = _stepped(comm, algorithm, n, 0.25)
    state = (high if comm.rank == comm.size - 1 else low).state_dict()
    if comm.size == 1:
        state = low.state_dict()
    b = _stepped(comm, algorithm, n, 0.05)
    _load_expecting(comm, b, state, "ranks disagree on .*state's density")


@pytest.mark.parametrize("change", ["threshold", "bounds"])
def test_oktopk_states_with_different_regions_or_thresholds_fail_everywhere(comm, change):
    """Ok-Topk reduces over regions and selects with a global threshold every rank must hold
    alike: a loaded state where the last rank's differ is refused on every rank."""
    n = 400
    a = _stepped(comm, "oktopk", n, 0.05, steps=4)
    state = copy.deepcopy(a.state_dict())
    extra = state["extra"]
    assert extra["bounds"] is not None and np.isfinite(extra["global_threshold"])
    if comm.rank == comm.size - 1:
        if change == "threshold":
            extra["global_threshold"] *= 2
        elif comm.size > 1:
            b = np.array(extra["bounds"])
            b[1] = b[1] + 1 if b[1] < b[2] else b[1] - 1  # still non-decreasing, from 0 to n
            extra["bounds"] = b
    # the message names the field (the compared fields are digests)
    word = "global threshold" if change == "threshold" else "region bounds"
    _load_expecting(comm, a, state, f"ranks disagree on .*state's {word}: rank 0=")


def test_spardl_team_owners_with_different_h_fail_everywhere(comm):
    """With d > 1 teams the owners of a block exchange top-h selections sized by their own h:
    a loaded state where they differ is refused on every rank (d = 2, or d = P at odd P)."""
    P = comm.size
    n = 480
    a = _stepped(comm, "spardl", n, 0.1, teams=2 if P % 2 == 0 else P)
    state = copy.deepcopy(a.state_dict())
    if comm.rank == P - 1 and P > 1:
        assert a.h_min < a.k_b[a.p]  # h has room to differ
        state["extra"]["h"] += 1 if state["extra"]["h"] < a.k_b[a.p] else -1
    _load_expecting(comm, a, state, "ranks disagree on .*state's h: rank 0=")


def _auto_trying(comm, n, target):
    """``auto`` saved during the trials of its second candidate, ``target`` (two of its three
    trial steps taken), and the options to build another: a fresh one has built its first
    candidate only, so the saved candidate state waits there for ``target`` to be built."""
    # prune=0: every candidate is tried (with pruning, a fast first candidate on an idle
    # machine could rule the second out, and the trials never reach it).
    opts = dict(candidates=["topka", target], trials=3, prune=0)
    a = _stepped(comm, "auto", n, 0.1, steps=5, **opts)
    assert a.stats["auto"]["choice"] == target and a.stats["auto"]["phase"] == "trials"
    return a, opts


def _auto_into(comm, a, n, opts, into):
    """The allreducer a state of ``a`` is loaded into: ``a`` itself (its current candidate
    built) or a fresh one (that candidate not built yet)."""
    if into == "built":
        return a
    b = spardl.make("auto", comm, n, density=0.1, **opts)
    assert sorted(b._inners) == [0]
    return b


@pytest.mark.parametrize("field", ["since", "flush", "not_tried"])
def test_auto_states_with_different_trial_counters_fail_everywhere(comm, field):
    """Auto's trial and decision schedule follows its counters (more of them than one check
    message once held, so the last ones went uncompared and the ranks hung)."""
    n = 200
    a = _stepped(comm, "auto", n, 0.05, steps=2, trials=1, interval=5)
    state = copy.deepcopy(a.state_dict())
    extra = state["extra"]
    if comm.rank == comm.size - 1:
        if field == "since":
            extra["since"] += 1
        elif field == "flush":
            extra["flush"] = not extra["flush"]
        else:
            extra["not_tried"] = [*extra["not_tried"], 0]
    _load_expecting(comm, a, state, "ranks disagree on .*state's other counters")


@pytest.mark.parametrize("into", ["built", "pending"])
@pytest.mark.parametrize("change", ["inner step", "threshold", "h"])
def test_auto_candidate_states_that_differ_fail_everywhere(comm, change, into):
    """Auto's current candidate follows its own step and state: a loaded state where the last
    rank's candidate differs (its step, Ok-Topk's global threshold, SparDL's h among a block's
    owners) is refused on every rank, whether the candidate is built (the same allreducer) or
    its state waits for it to be built (a fresh one)."""
    P = comm.size
    n = 480
    d = 2 if P % 2 == 0 else P
    a, opts = _auto_trying(comm, n, f"spardl:d={d}" if change == "h" else "oktopk")
    state = copy.deepcopy(a.state_dict())
    inner = list(state["extra"]["inner"])
    if comm.rank == P - 1 and P > 1:
        if change == "inner step":
            inner[0] += 1
        elif change == "threshold":
            assert np.isfinite(inner[3]["global_threshold"])
            inner[3]["global_threshold"] *= 2
        else:
            ar = a._inner(a._choice)
            assert ar.h_min < ar.k_b[ar.p]  # h has room to differ
            inner[3]["h"] += 1 if inner[3]["h"] < ar.k_b[ar.p] else -1
    state["extra"]["inner"] = tuple(inner)
    b = _auto_into(comm, a, n, opts, into)
    _load_expecting(comm, b, state, "ranks disagree on .*state's other counters")


@pytest.mark.parametrize("into", ["built", "pending"])
@pytest.mark.parametrize("change", ["h out of range", "malformed"])
def test_auto_candidate_states_refused_on_some_ranks_fail_everywhere(comm, change, into):
    """A candidate state that only some ranks refuse: SparDL's h out of range on every owner of
    the last rank's block (the owners agree, so no comparison catches it), or a malformed
    candidate state on the last rank. Both raise on every rank at the load, also where the
    candidate is not built yet (its state once waited unchecked for the first step, where
    those ranks alone raised and the others hung; the malformed one hung the load)."""
    P = comm.size
    n = 480
    d = 2 if P % 2 == 0 else P
    a, opts = _auto_trying(comm, n, f"spardl:d={d}")
    state = copy.deepcopy(a.state_dict())
    inner = list(state["extra"]["inner"])
    m = P // d
    if change == "h out of range":
        if comm.rank % m == (P - 1) % m:
            inner[3]["h"] = 10**6
        match = "h=1000000, outside"
    else:
        if comm.rank == P - 1:
            inner = inner[:3]
        match = r"must be \(step, calls, dtype, extra\)"
    state["extra"]["inner"] = tuple(inner)
    b = _auto_into(comm, a, n, opts, into)
    before, built = b.state_dict(), sorted(b._inners)
    with pytest.raises(ValueError, match=match):
        b.load_state_dict(state)
    assert b._pending == {} and sorted(b._inners) == built  # nothing of the state kept
    _still_in_step(comm, b, before)


@pytest.mark.parametrize("key", ["step", "calls"])
def test_loaded_counters_past_int64_fail_everywhere(comm, key):
    """A counter no int64 holds, on the last rank: a clear error on every rank (it once
    overflowed inside the check on that rank alone, and the others waited)."""
    a = _stepped(comm, "spardl", 100, 0.1, steps=1)
    before = a.state_dict()
    state = dict(before)
    if comm.rank == comm.size - 1:
        state[key] = 2**70
    with pytest.raises(ValueError, match=rf"state {key} must be in \[0, 2\*\*63\)"):
        a.load_state_dict(state)
    _still_in_step(comm, a, before)


def test_construction_arguments_past_int64_fail_everywhere(comm):
    """n past int64 on the last rank: an error on every rank, never an overflow on one."""
    n = 2**64 if comm.rank == comm.size - 1 else 100
    with pytest.raises((ValueError, TypeError)):
        spardl.make("spardl", comm, n, density=0.1)
    assert_identical_everywhere(comm, spardl.make("spardl", comm, 100)(np.ones(100)))


def test_numpy_and_python_densities_are_named_when_they_differ(comm):
    """np.float32(0.1) is not 0.1: the message names the density (once "the call sequence",
    their descriptions having compared equal), and a NumPy bool is named as one."""
    if comm.size > 1:
        rho = np.float32(0.1) if comm.rank == comm.size - 1 else 0.1
        with pytest.raises(ValueError, match="ranks disagree on density"):
            spardl.make("topka", comm, 100, density=rho)
    with pytest.raises(TypeError, match="check must be a bool, got numpy.bool"):
        spardl.make("topka", comm, 100, check=np.bool_(True))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 2))


def _backward(model, comm, seed):
    model.zero_grad()
    torch.manual_seed(10 * seed + comm.rank)
    model(torch.randn(4, 16)).sum().backward()


def _hook_step(comm, model, hook, seed):
    """One backward and the DDP hook on one bucket of all of ``model``'s gradients."""
    _backward(model, comm, seed)
    params = list(model.parameters())
    buf = torch.cat([p.grad.flatten() for p in params])
    return hook._bucket(FakeBucket(0, buf, params, True)).wait()


def _reduce_alike(comm, model, red, seeds) -> None:
    """A backward and a ``red.reduce()`` at each seed: every rank must get the same indices."""
    for s in seeds:
        _backward(model, comm, s)
        out = red.reduce()
        assert comm.allgather(out.indices.tolist()) == [out.indices.tolist()] * comm.size


def test_reducer_states_of_different_densities_fail_everywhere(comm):
    """The PyTorch reducer's load compares its allreducer's state too (ρ here)."""
    model = _model()

    def stepped(density):
        red = st.SparseGradientReducer(model.parameters(), comm, density=density)
        for s in range(2):
            _backward(model, comm, s)
            red.reduce()
        return red

    low, high = stepped(0.05), stepped(0.25)
    state = (high if comm.rank == comm.size - 1 and comm.size > 1 else low).state_dict()
    b = stepped(0.05)
    if comm.size == 1:
        b.load_state_dict(state)
        return
    with pytest.raises(ValueError, match="ranks disagree on allreducer state's density"):
        b.load_state_dict(state)
    assert b.state_dict()["step"] == 2
    _reduce_alike(comm, model, b, [5])


def test_hook_states_of_different_densities_fail_at_the_first_sparse_step(comm):
    """The DDP hook builds its allreducer at its first sparse iteration and applies a state
    loaded before then there: that is where ranks whose states disagree (ρ here) must raise,
    on every rank."""
    model = _model()

    def step(hook, seed):
        return _hook_step(comm, model, hook, seed)

    def stepped(density):
        hook = st.SparseHookState(comm, "spardl", warmup_steps=0, density=density, model=model)
        for s in range(2):
            step(hook, s)
        return hook

    low, high = stepped(0.05), stepped(0.25)
    state = (high if comm.rank == comm.size - 1 and comm.size > 1 else low).state_dict()
    fresh = st.SparseHookState(comm, "spardl", warmup_steps=0, density=0.05, model=model)
    fresh.load_state_dict(state)
    if comm.size == 1:
        step(fresh, 3)
        return
    with pytest.raises(ValueError, match="ranks disagree on .*state's density"):
        step(fresh, 3)


def _load_options(comm, algorithm):
    # SparDL with teams of one rank each (d = P > 1): its loaded signature exchanges h among a
    # block's owners, as auto's does for its candidate; Ok-Topk's is local.
    return {"teams": comm.size} if algorithm == "spardl" else {}


@pytest.mark.parametrize("algorithm", ["auto", "spardl", "oktopk"])
def test_a_load_on_one_rank_while_the_others_step_fails_everywhere(comm, algorithm):
    """One rank loads a state while the others step: every rank raises, naming the load, and
    nobody hangs (the algorithms whose loaded signature exchanges messages of its own waited
    there for ranks that were in a step's agreement); the allreducer keeps working."""
    if comm.size == 1:
        pytest.skip("needs two ranks")
    n = 60
    ar = _stepped(comm, algorithm, n, 0.1, steps=2, **_load_options(comm, algorithm))
    state = ar.state_dict()
    g = grads_for(comm, n, np.float64, seed=71)[comm.rank]
    with pytest.raises(ValueError, match="ranks disagree on load_state_dict"):
        if comm.rank == 0:
            ar.load_state_dict(state)
        else:
            ar(g)
    _still_in_step(comm, ar, state)


@pytest.mark.parametrize("algorithm", ["spardl", "oktopk"])
def test_a_reducer_load_on_one_rank_while_the_others_reduce_fails_everywhere(comm, algorithm):
    """The same for the PyTorch reducer, whose load checks its allreducer's loaded state."""
    if comm.size == 1:
        pytest.skip("needs two ranks")
    model = _model()
    red = st.SparseGradientReducer(
        model.parameters(), comm, algorithm, density=0.1, **_load_options(comm, algorithm)
    )
    for s in range(2):
        _backward(model, comm, s)
        red.reduce()
    state = red.state_dict()
    _backward(model, comm, 2)
    with pytest.raises(ValueError, match="ranks disagree on"):
        if comm.rank == 0:
            red.load_state_dict(state)
        else:
            red.reduce()
    assert red.state_dict()["step"] == 2
    _backward(model, comm, 3)
    out = red.reduce()
    assert comm.allgather(out.indices.tolist()) == [out.indices.tolist()] * comm.size


def test_a_state_not_restored_on_one_rank_is_refused_on_every_rank(comm):
    """Undoing a failed step raised on rank 0 only (its density's restore, injected): that
    rank's reducer is half restored, and its next reduce() and load raise on every rank (rank
    0's RuntimeError, named by the others), where rank 0 refusing alone left the others waiting
    in the step's agreement. The others' states are sound, so they are kept as they were."""
    model = _model()
    red = st.SparseGradientReducer(
        model.parameters(), comm, "spardl", density=0.1, density_warmup=4, nonfinite="raise"
    )
    for s in range(2):
        _backward(model, comm, s)
        red.reduce()
    state = red.state_dict()
    if comm.rank == 0:

        def fail(saved):
            raise RuntimeError("injected restore failure")

        red.allreducer._restore = fail
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    with pytest.raises(spardl.NonFiniteError) as info:
        red.reduce()
    notes = "".join(getattr(info.value, "__notes__", []))
    assert ("injected restore failure" in notes) == (comm.rank == 0), notes
    if comm.rank == 0:
        del red.allreducer._restore
    said = "state could not be restored"
    match = said if comm.rank == 0 else f"rank 0 failed \\(RuntimeError: .*{said}"
    error = RuntimeError if comm.rank == 0 else ValueError
    for call in (red.reduce, lambda: red.load_state_dict(state)):
        _backward(model, comm, 3)
        with pytest.raises(error, match=match):
            call()
    if comm.rank != 0:
        assert red.state_dict()["step"] == 2
    red.close()


@pytest.mark.parametrize("algorithm", [*ALGS, "auto"])
@pytest.mark.parametrize(
    ("key", "bad", "error", "match"),
    [
        ("density", "0.5", TypeError, "state density must be a float"),
        ("density", None, TypeError, "state density must be a float"),
        ("density", 1.5, ValueError, r"state density must be in \(0, 1\]"),
        ("extra", None, TypeError, "state extra must be a dict"),
        ("extra", [1, 2], TypeError, "state extra must be a dict"),
    ],
)
def test_loaded_density_and_extra_of_the_wrong_kind_fail_everywhere(
    comm, algorithm, key, bad, error, match
):
    """A state whose density is not a number in (0, 1] or whose algorithm part is not a dict,
    on the last rank: every rank raises, naming the field (a string density once loaded as a
    number on some algorithms, None an algorithm part on others), and keeps its state."""
    n = 60
    ar = _stepped(comm, algorithm, n, 0.1, steps=2)
    before = ar.state_dict()
    state = ar.state_dict()
    if comm.rank == comm.size - 1:
        state[key] = bad
    with pytest.raises(error, match=match):  # the other ranks name the last rank's error
        ar.load_state_dict(state)
    _still_in_step(comm, ar, before)


_BAD_STATS = [  # (the last rank's stats, the error of its load: None if it loads)
    ("missing", None),
    (None, None),
    ("narrow", None),  # a NumPy uint8 counter: loaded as a Python int (it overflowed a later count)
    ([1, 2], TypeError),
    ({"messages": -1}, ValueError),
    ({"steps": 2**63}, ValueError),
    ({"phases": {"x": 1}}, TypeError),
    ({"phases": {"x": {"messages": 1, "bytes_sent": 2, "bytes_received": 3, "e": "x"}}}, TypeError),
    ({"phases": {"x": {"messages": 1, "bytes_sent": -2, "bytes_received": 3}}}, ValueError),
    ({"dropped_mass": "x"}, TypeError),  # a sum a step adds to (gTop-k's), not a number
    ({"dropped_mass": float("nan")}, ValueError),
]


@pytest.mark.parametrize("algorithm", ["spardl", "topka", "auto"])
@pytest.mark.parametrize(("bad", "error"), _BAD_STATS)
def test_reducer_states_with_missing_or_bad_stats(comm, algorithm, bad, error):
    """The saved message counters on the last rank: missing or None start at zero (and the
    counters an allreducer adds, ``steps`` among them, keep counting); anything else that is not
    a dict of counters in [0, 2**63) and finite sums raises at the load on every rank, with the
    last rank's type (TypeError for a field of the wrong kind, ValueError for a bad value).
    Either way the next steps run on every rank (a counter the state lacked once failed the
    next message on that rank alone, and with SparDL's teams inside the load itself)."""
    model = _model()
    opts = _load_options(comm, algorithm)
    red = st.SparseGradientReducer(model.parameters(), comm, algorithm, density=0.1, **opts)
    for s in range(2):
        _backward(model, comm, s)
        red.reduce()
    state = red.state_dict()
    if comm.rank == comm.size - 1:
        if bad == "missing":
            del state["stats"]
        elif bad == "narrow":
            state["stats"]["bytes_sent"] = np.uint8(250)
        else:
            state["stats"] = bad
    if error is None:
        red.load_state_dict(state)
    else:
        with pytest.raises(error, match="state stats"):
            red.load_state_dict(state)
    _reduce_alike(comm, model, red, range(2, 4))
    assert red.state_dict()["step"] == 4
    assert red.stats["steps"] >= 2


_BAD_VELOCITIES = {
    "short": lambda v, key: {**v, key: np.zeros(3, np.float32)},
    "unknown key": lambda v, key: {**v, "no.such.parameter": np.zeros(3, np.float32)},
    "text": lambda v, key: {**v, key: "x"},
    "not a dict": lambda v, key: [1, 2],
}


@pytest.mark.parametrize("bad", sorted(_BAD_VELOCITIES))
def test_reducer_states_with_bad_velocities_fail_at_the_load_everywhere(comm, bad):
    """Momentum correction's saved velocities on the last rank of the wrong length, key or
    kind: the load raises on every rank and keeps the state (they were checked at the first
    step after it, on that rank alone, while the others waited in the allreduce)."""
    model = _model()
    red = st.SparseGradientReducer(
        model.named_parameters(), comm, "spardl", density=0.1, momentum_correction=0.9
    )
    _backward(model, comm, 0)
    red.reduce()
    state = red.state_dict()
    key = next(iter(state["velocity"]))
    if comm.rank == comm.size - 1:
        state["velocity"] = _BAD_VELOCITIES[bad](state["velocity"], key)
    error = TypeError if bad in ("text", "not a dict") else ValueError
    if comm.size > 1:
        error = (TypeError, ValueError)  # the other ranks name the last rank's type or its own
    with pytest.raises(error, match="velocit|rank"):
        red.load_state_dict(state)
    _reduce_alike(comm, model, red, range(1, 3))
    assert red.state_dict()["step"] == 3


def test_hook_states_with_bad_velocities_fail_at_the_first_step_everywhere(comm):
    """The DDP hook learns its layout at its first iteration: a loaded velocity of the wrong
    length on one rank is refused there, before the step's agreement, on every rank."""
    model = _model()

    def step(hook, seed):
        return _hook_step(comm, model, hook, seed)

    def hook_state():
        return st.SparseHookState(
            comm, "spardl", warmup_steps=0, density=0.1, model=model, momentum_correction=0.9
        )

    hook = hook_state()
    step(hook, 0)
    state = hook.state_dict()
    key = next(iter(state["velocity"]))
    if comm.rank == comm.size - 1:
        state["velocity"][key] = np.zeros(3, np.float32)
    fresh = hook_state()
    fresh.load_state_dict(state)  # the layout is not known yet
    with pytest.raises(ValueError, match="velocity of parameter|rank"):
        step(fresh, 1)


_BAD_REDUCER_STATES = {
    "step inf": lambda s: s.update(step=float("inf")),
    "step negative": lambda s: s.update(step=-5),
    "step text": lambda s: s.update(step="2"),
    "numels missing": lambda s: s.pop("numels"),
    "sum past a float": lambda s: s["stats"].update(dropped_mass=10**400),
}


@pytest.mark.parametrize("bad", sorted(_BAD_REDUCER_STATES))
def test_reducer_states_that_fail_in_other_ways_fail_everywhere(comm, bad):
    """A reducer state on the last rank whose load fails with an error other than TypeError
    or ValueError (a KeyError, an OverflowError) raises on every rank too (that rank once
    raised alone while the others waited), and a step must be a non-negative integer (-5 and
    1.7 once loaded)."""
    model = _model()
    red = st.SparseGradientReducer(model.parameters(), comm, "spardl", density=0.1)
    _backward(model, comm, 0)
    red.reduce()
    state = red.state_dict()
    if comm.rank == comm.size - 1:
        _BAD_REDUCER_STATES[bad](state)
    with pytest.raises((TypeError, ValueError), match="state|rank"):
        red.load_state_dict(state)
    _reduce_alike(comm, model, red, range(1, 3))
    assert red.state_dict()["step"] == 3


# -- overlap mode: an undo that fails on one rank ------------------------------------------------
def _overlap_state(comm, warmup_steps=0, **options):
    """Three parameters, one fake DDP bucket each (by default), and an overlap-mode hook state
    over them (:func:`overlap_state.three_parameter_state`)."""
    return three_parameter_state(comm, warmup_steps, **options)


def _overlap_buckets(comm, state, params, seed, count=3, groups=((0,), (1,), (2,)), nan=False):
    """A real backward (the used-parameter hooks fire), then its first ``count`` buckets of
    ``groups`` (parameter positions) to the hook (count < len(groups): a backward that stopped
    early, the iteration left open), with a NaN in the first one if ``nan``; the futures'
    results."""
    torch.manual_seed(10 * seed + comm.rank)
    for p in params:
        p.grad = None
    sum((p * torch.randn(p.numel())).sum() for p in params).backward()
    futs = []
    for b, group in enumerate(groups[:count]):
        buf = torch.cat([params[i].grad for i in group])
        if nan and b == 0:
            buf[0] = float("nan")
        last = b == len(groups) - 1
        futs.append(state._bucket(FakeBucket(b, buf, [params[i] for i in group], last)))
    return [f.wait() for f in futs]


def _fail_undo_on_rank_0(comm, monkeypatch, error=RuntimeError) -> None:
    if comm.rank == 0:

        def fail(self, undo):
            raise error("injected undo failure")

        monkeypatch.setattr(st._Core, "_unstep", fail)


def _raised_here_or_named(comm, said: str):
    """What every rank raises when rank 0 fails with ``said``: its own error there, the
    others a ValueError naming rank 0 and its message."""
    if comm.rank == 0:
        return pytest.raises(RuntimeError, match=said)
    return pytest.raises(ValueError, match=f"rank 0 .*{said}")


def _undo_open_iteration(comm, state, call, saved, next_iteration) -> None:
    """Undo the open iteration by ``call`` ("next": ``next_iteration()``'s first bucket;
    "drain", "load_state_dict" of ``saved``, "close") while rank 0's undo raises: the bucket
    and the load raise on every rank (their agreement), drain and close on rank 0 alone."""
    if call in ("next", "load_state_dict"):
        with _raised_here_or_named(comm, "injected undo failure"):
            if call == "next":
                next_iteration()
            else:
                state.load_state_dict(saved)
    elif comm.rank == 0:
        with pytest.raises(RuntimeError, match="injected undo failure"):
            getattr(state, call)()
    else:
        getattr(state, call)()


def test_an_unfinished_iteration_not_undone_on_one_rank_fails_the_next_one_everywhere(
    comm, monkeypatch
):
    """Overlap mode: a backward stopped after two of three buckets, and the next iteration's
    first bucket undoes the open one, which raises on rank 0 only. That error goes to the
    bucket's agreement, so every rank fails the iteration (rank 0 once raised before it and
    the others waited there forever); later iterations are refused everywhere, and close()
    frees every communicator on every rank."""
    params, state = _overlap_state(comm)
    _overlap_buckets(comm, state, params, seed=0)
    assert state.step == 1
    _overlap_buckets(comm, state, params, seed=1, count=2)
    _fail_undo_on_rank_0(comm, monkeypatch)
    with _raised_here_or_named(comm, "injected undo failure"):
        _overlap_buckets(comm, state, params, seed=2)
    monkeypatch.undo()
    with _raised_here_or_named(comm, "could not be restored"):
        _overlap_buckets(comm, state, params, seed=3)
    state.close()
    assert state._core.comm.freed and state._core.ctl.freed


@pytest.mark.parametrize("call", ["close", "load_state_dict", "drain"])
def test_an_unfinished_iteration_whose_undo_fails_on_one_rank_still_closes_everywhere(
    comm, monkeypatch, call
):
    """Overlap mode, a backward stopped after two of three buckets; then ``call`` undoes the
    open iteration, which raises on rank 0 only. Rank 0 raises its undo's error, after the
    collective parts every rank makes (the closes; a load's agreement, where the others
    refuse the load too): none waits for a rank that left. The state is then refused
    everywhere, and close() frees every communicator."""
    params, state = _overlap_state(comm)
    _overlap_buckets(comm, state, params, seed=0)
    saved = state.state_dict()
    _overlap_buckets(comm, state, params, seed=1, count=2)
    _fail_undo_on_rank_0(comm, monkeypatch)
    _undo_open_iteration(comm, state, call, saved, next_iteration=None)
    monkeypatch.undo()
    if call != "close":
        with _raised_here_or_named(comm, "could not be restored"):
            _overlap_buckets(comm, state, params, seed=3)
        state.close()
    assert state._core.comm.freed and state._core.ctl.freed


@pytest.mark.parametrize("call", ["next", "load_state_dict"])
def test_an_interrupted_undo_of_an_unfinished_iteration_on_one_rank_fails_everywhere(
    comm, monkeypatch, call
):
    """As above, but rank 0's undo raises KeyboardInterrupt (no Exception): it still goes to
    the agreement of the bucket or the load that undid the open iteration, so every rank
    raises there (rank 0 once raised before that agreement and the others waited in it). A
    load raises the interrupt itself on rank 0 (an interrupt propagates, as from
    ``undo_or_break``); a bucket, on the communication thread (whose torch futures take no
    interrupt), the RuntimeError saying that the state could not be restored, its cause the
    interrupt. The others raise a ValueError naming rank 0's error."""
    params, state = _overlap_state(comm)
    _overlap_buckets(comm, state, params, seed=0)
    saved = state.state_dict()
    _overlap_buckets(comm, state, params, seed=1, count=2)
    _fail_undo_on_rank_0(comm, monkeypatch, KeyboardInterrupt)
    if call == "load_state_dict":
        kind, said = KeyboardInterrupt, r"injected undo failure\)"
    else:
        kind, said = RuntimeError, ".*could not be restored .*KeyboardInterrupt: injected undo"
    if comm.rank == 0:
        raised = pytest.raises(kind, match="injected undo failure")
    else:
        raised = pytest.raises(ValueError, match=rf"rank 0 failed \({kind.__name__}: {said}")
    with raised:
        if call == "next":
            _overlap_buckets(comm, state, params, seed=2)
        else:
            state.load_state_dict(saved)
    monkeypatch.undo()
    with _raised_here_or_named(comm, "could not be restored"):
        _overlap_buckets(comm, state, params, seed=3)
    state.close()
    assert state._core.comm.freed and state._core.ctl.freed


def test_a_bucket_allreducer_not_rolled_back_on_one_rank_is_refused_before_a_rebuild(comm):
    """Overlap mode: bucket 0's allreducer cannot roll back its failed step (a NaN) on rank 0
    only, which leaves that allreducer half restored even though the iteration's undo then
    restores its snapshot. The next iteration comes with other buckets (DDP's rebuild): its
    first bucket's agreement must refuse on every rank, where rank 0 once raised alone while
    saving the buckets' states for the rebuild and the others went on building new ones."""
    params, state = _overlap_state(comm)
    _overlap_buckets(comm, state, params, seed=0)
    ar = state._core.cores[0].sparse
    if comm.rank == 0:
        rollback = ar._rollback

        def fail(saved):  # once, after rolling back: the flag alone says "half restored"
            del ar._rollback
            rollback(saved)
            raise RuntimeError("injected rollback failure")

        ar._rollback = fail
    with pytest.raises(spardl.NonFiniteError):
        _overlap_buckets(comm, state, params, seed=1, nan=True)
    assert (ar.broken is not None) == (comm.rank == 0)
    with _raised_here_or_named(comm, "could not be restored"):
        _overlap_buckets(comm, state, params, seed=2, groups=((0,), (1, 2)))
    state.close()


@pytest.mark.parametrize("call", ["next", "drain", "load_state_dict", "close"])
def test_what_an_unfinished_iteration_built_is_closed_everywhere_when_its_undo_fails(
    comm, monkeypatch, call
):
    """Overlap mode with one dense warm-up iteration and parameters of up to 3 entries
    reduced dense: the first sparse iteration builds bucket 0's dense allreducer of its small
    parameter, and its backward stops after that bucket. Undoing it (the next iteration's
    first bucket, drain, a load or close) raises on rank 0 only, after the restores; the
    allreducer it built is closed on every rank all the same (a rank that skipped that
    collective close once left the others waiting), and close() frees every communicator."""
    params, state = _overlap_state(comm, 1, dense_numel=3)
    groups = ((0, 2), (1,))
    _overlap_buckets(comm, state, params, seed=0, groups=groups)
    saved = state.state_dict()
    _overlap_buckets(comm, state, params, seed=1, groups=groups, count=1)
    state._core.drain()
    built = state._core.cores[0].small_dense
    assert built is not None and not built.closed
    _fail_undo_on_rank_0(comm, monkeypatch)

    def next_iteration():
        _overlap_buckets(comm, state, params, seed=2, groups=groups)

    _undo_open_iteration(comm, state, call, saved, next_iteration)
    monkeypatch.undo()
    assert built.closed
    state.close()
    assert state._core.comm.freed and state._core.ctl.freed


def test_a_fault_applying_a_loaded_hook_state_on_one_rank_fails_everywhere(comm, monkeypatch):
    """The DDP hook applies a state loaded before its first sparse iteration when it builds
    its allreducer there; a fault while applying it on rank 0 (injected: no TypeError or
    ValueError) makes every rank raise, rank 0 a malformed state, where that rank once raised
    alone and the others waited in the agreement on the loaded state."""
    model = _model()
    hook = st.SparseHookState(comm, "spardl", warmup_steps=0, density=0.1, model=model)
    for s in range(2):
        _hook_step(comm, model, hook, s)
    state = hook.state_dict()
    fresh = st.SparseHookState(comm, "spardl", warmup_steps=0, density=0.1, model=model)
    fresh.load_state_dict(state)
    if comm.rank == 0:

        def fault(self, pending):
            raise ZeroDivisionError("injected apply fault")

        monkeypatch.setattr(st._Core, "_apply", fault)
    said = r"state is malformed \(ZeroDivisionError: injected apply fault\)"
    match = said if comm.rank == 0 else rf"rank 0 rejected its arguments \(ValueError: {said}"
    with pytest.raises(ValueError, match=match):
        _hook_step(comm, model, fresh, 3)
    for h in (hook, fresh):
        h.close()
