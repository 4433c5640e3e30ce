"""Step and call counters at the top of their range: every state loader takes counters in
[0, 2**63) (``check_counter``), so a call that would take one past 2**63 - 1 raises first
(OverflowError, naming the counter) and changes nothing: every state saved is one that loads.

One rank, in this process (MPI.COMM_SELF): the allreducers, ``auto`` (its current candidate's
counters too), the torch reducer and the overlap-mode hook state.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from plain_state import plain_state
from scripts.fake_bucket import FakeBucket

import spardl

LARGEST = 2**63 - 1
N = 40


def _grad(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(N).astype(np.float32)


def _stepped(algorithm: str):
    ar = spardl.make(algorithm, MPI.COMM_SELF, N, density=0.1)
    ar(_grad(0))
    return ar


def _without_stats(state: dict) -> dict:
    return plain_state({k: v for k, v in state.items() if k != "stats"})


@pytest.mark.parametrize("algorithm", ["dense", "spardl", "auto"])
@pytest.mark.parametrize("key", ["step", "calls"])
def test_a_call_past_the_largest_counter_raises_and_changes_nothing(algorithm, key):
    ar = _stepped(algorithm)
    state = ar.state_dict()
    state["step"] = LARGEST if key == "step" else 5
    state["calls"] = LARGEST
    ar.load_state_dict(state)
    before = plain_state(ar.state_dict())
    with pytest.raises(OverflowError, match=rf"^{key} is {LARGEST}, the largest a state holds"):
        ar(_grad(1))
    assert plain_state(ar.state_dict()) == before
    assert ar.step == state["step"]


@pytest.mark.parametrize("algorithm", ["dense", "spardl", "auto"])
def test_the_call_that_reaches_the_largest_step_saves_a_state_that_loads(algorithm):
    ar = _stepped(algorithm)
    state = ar.state_dict()
    state["step"] = state["calls"] = LARGEST - 1
    ar.load_state_dict(state)
    ar(_grad(1))
    saved = ar.state_dict()
    assert saved["step"] == saved["calls"] == LARGEST
    again = spardl.make(algorithm, MPI.COMM_SELF, N, density=0.1)
    again.load_state_dict(saved)
    assert plain_state(again.state_dict()) == plain_state(saved)
    with pytest.raises(OverflowError, match="^step is"):
        again(_grad(2))


@pytest.mark.parametrize("key", ["step", "calls"])
def test_auto_refuses_a_call_past_its_current_candidates_largest_counter(key):
    ar = _stepped("auto")
    state = ar.state_dict()
    inner = list(state["extra"]["inner"])
    inner[0 if key == "step" else 1] = LARGEST
    state["extra"]["inner"] = tuple(inner)
    ar.load_state_dict(state)
    before = plain_state(ar.state_dict())
    name = state["extra"]["choice"]
    with pytest.raises(OverflowError, match=rf"^candidate {name}'s {key} is {LARGEST}"):
        ar(_grad(1))
    assert plain_state(ar.state_dict()) == before


def _reducer(torch):
    import spardl.torch as st

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (30, 10)]
    red = st.SparseGradientReducer(params, MPI.COMM_SELF, "spardl", density=0.2)
    return red, params


def _backward(torch, params, seed):
    """Gradients from a real backward (the hook counts a parameter used when its hook fires)."""
    rng = np.random.default_rng(seed)
    loss = sum(
        (p * torch.from_numpy(rng.standard_normal(p.numel()).astype(np.float32))).sum()
        for p in params
    )
    for p in params:
        p.grad = None
    loss.backward()


def test_the_reducer_refuses_a_step_past_the_largest_and_round_trips_the_one_before():
    torch = pytest.importorskip("torch")
    red, params = _reducer(torch)
    _backward(torch, params, 0)
    red.reduce()
    state = red.state_dict()
    state["step"] = LARGEST
    red.load_state_dict(state)
    before = _without_stats(red.state_dict())
    _backward(torch, params, 1)
    with pytest.raises(OverflowError, match=rf"^step is {LARGEST}"):
        red.reduce()
    assert _without_stats(red.state_dict()) == before and red.step == LARGEST
    # One below: the step is taken, and what it saves loads into a new reducer.
    state["step"] = LARGEST - 1
    red.load_state_dict(state)
    red.reduce()
    saved = red.state_dict()
    assert saved["step"] == LARGEST
    again, params2 = _reducer(torch)
    again.load_state_dict(saved)
    assert _without_stats(again.state_dict()) == _without_stats(saved)
    _backward(torch, params2, 2)
    with pytest.raises(OverflowError, match="^step is"):
        again.reduce()


def test_the_overlap_hook_refuses_an_iteration_past_the_largest_step():
    torch = pytest.importorskip("torch")
    import spardl.torch as st

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (30, 10)]
    model = torch.nn.ParameterList(params)

    def iteration(state, seed):
        _backward(torch, params, seed)
        buf = torch.cat([p.grad for p in params])
        return state._bucket(FakeBucket(0, buf, params, True)).wait(), buf

    state = st.SparseHookState(MPI.COMM_SELF, "spardl", 0, density=0.2, model=model, overlap=True)
    iteration(state, 0)
    saved = state.state_dict()
    saved["step"] = LARGEST
    state.load_state_dict(saved)
    before = _without_stats(state.state_dict())
    with pytest.raises(OverflowError, match=rf"^step is {LARGEST}"):
        iteration(state, 1)
    assert _without_stats(state.state_dict()) == before and state.step == LARGEST
    saved["step"] = LARGEST - 1
    state.load_state_dict(saved)
    out, _ = iteration(state, 2)
    assert bool(out.any()) and state.step == LARGEST
    again = st.SparseHookState(MPI.COMM_SELF, "spardl", 0, density=0.2, model=model, overlap=True)
    again.load_state_dict(state.state_dict())
    assert again.step == LARGEST
    with pytest.raises(OverflowError, match="^step is"):
        iteration(again, 3)
