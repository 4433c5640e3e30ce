"""Elastic resume of the torch classes (docs/reliability.md §4.1): a SparseGradientReducer's and a
SparseHookState's state saved at P ranks loads at P' (sub-communicators of the world): the
residuals and the momentum-correction velocities keep their sum over ranks (bit for bit when
P' ≥ P), the step carries over, and the next step runs on every rank of the new world."""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI
from mpiutil import assert_identical_everywhere
from test_elastic_stateful import DIR, ME, WORLD, W, same_state, world_sum

from spardl import elastic

torch = pytest.importorskip("torch")

from spardl.torch import (  # noqa: E402
    SparseGradientReducer,
    SparseHookState,
    from_torch_state,
)

OPTIONS = {"density": 0.2, "momentum_correction": 0.9}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _grads(model, seed):
    g = torch.Generator().manual_seed(1000 * seed + ME)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def _sums(obj, keys, n):
    """Σ over the world of the residuals and of the velocities (by parameter key), as this
    rank's ``state_dict()`` holds them (a loaded state not applied yet included)."""
    res, vel = np.zeros(n), np.zeros(n)
    if obj is not None:
        state = from_torch_state(obj.state_dict())
        if state["allreducer"] is not None and state["allreducer"]["residual"] is not None:
            res = np.asarray(state["allreducer"]["residual"], np.float64)
        if state["velocity"]:
            vel = np.concatenate([np.asarray(state["velocity"][k], np.float64) for k in keys])
    both = world_sum(np.concatenate([res, vel]))
    return both[:n], both[n:]


def _sub(P):
    sub = WORLD.Split(0 if ME < P else MPI.UNDEFINED, ME)
    return None if sub == MPI.COMM_NULL else sub


def _save_at(P, model, path):
    """Three steps of a reducer on the first P ranks, then its state gathered to rank 0 and
    saved to ``path``. Returns (communicator, reducer, gathered state, own state_dict()): None
    off the P ranks."""
    sub = _sub(P)
    if sub is None:
        return None, None, None, None
    red = SparseGradientReducer(model.named_parameters(), sub, "oktopk", **OPTIONS)
    for s in range(3):
        _grads(model, s)
        red.reduce()
    gathered = elastic.gather_state(red, root=0)
    elastic.save_checkpoint(red, path)
    return sub, red, gathered, red.state_dict()


def _resume_at(new, model2, gathered, path, step, own):
    """A reducer on ``new`` loaded from the gathered state, checked against one loaded from the
    checkpoint file and, given ``own`` (the same world), against this rank's saved state."""
    loaded = SparseGradientReducer(model2.named_parameters(), new, "oktopk", **OPTIONS)
    elastic.load_gathered_state(loaded, gathered if ME == 0 else None)
    again = SparseGradientReducer(model2.named_parameters(), new, "oktopk", **OPTIONS)
    elastic.load_checkpoint(again, path)
    assert loaded.step == again.step == step
    a, b = loaded.state_dict(), again.state_dict()
    a.pop("stats"), b.pop("stats")  # the counters of the two reducers' own traffic differ
    same_state(from_torch_state(a), from_torch_state(b))
    if own is not None:  # the same world: each rank's own state, bit for bit
        own.pop("stats")
        same_state(from_torch_state(own), from_torch_state(a))
    return loaded


def _assert_sums_kept(got, want, exact):
    """The world's sums carried over: bit for bit (``exact``, P' ≥ P) or to rounding."""
    if exact:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7 * np.abs(want).max())


def _hook_loaded(new, gathered, keys, model2, step):
    """A SparseHookState on ``new`` loaded from the gathered state: kept as loaded until its
    allreducer is made (the first sparse step), then applied at the saved step."""
    hook = SparseHookState(new, "oktopk", warmup_steps=0, model=_model(), **OPTIONS)
    elastic.load_gathered_state(hook, gathered if ME == 0 else None)
    pending = hook.state_dict()["allreducer"]  # saved again before it is applied: kept
    assert pending["world_size"] == new.Get_size() and pending["step"] == step
    numels = [p.numel() for p in model2.parameters()]
    hook._core.set_layout(keys, numels, torch.float32)  # what the first iteration does
    hook._core.allreducer(dense=False)
    assert hook.step == step and hook.allreducer.step == step
    return hook


@pytest.mark.parametrize("sizes", [(W, max(1, W - 1)), (max(1, W // 2), W)], ids=str)
def test_reducer_and_hook_state_resume_at_another_world_size(sizes):
    P, Pn = sizes
    model = _model()
    keys = [k for k, _ in model.named_parameters()]
    n = sum(p.numel() for p in model.parameters())
    path = os.path.join(DIR, f"torch-{P}-{Pn}.zip")
    sub, red, gathered, own = _save_at(P, model, path)
    E, V = _sums(red, keys, n)
    step = WORLD.bcast(red.step if ME == 0 else None, root=0)
    assert np.abs(E).max() > 0 and np.abs(V).max() > 0  # there is something to carry

    new = _sub(Pn)
    loaded = model2 = None
    if new is not None:
        model2 = _model()
        loaded = _resume_at(new, model2, gathered, path, step, own if Pn == P else None)
    E2, V2 = _sums(loaded, keys, n)
    _assert_sums_kept(E2, E, exact=Pn >= P)
    _assert_sums_kept(V2, V, exact=Pn >= P)

    hook = None
    if new is not None:
        _grads(model2, 9)
        loaded.reduce()  # the next step runs on the new world
        assert loaded.step == step + 1
        assert_identical_everywhere(new, loaded.last_result)
        hook = _hook_loaded(new, gathered, keys, model2, step)
    H, _ = _sums(hook, keys, n)
    _assert_sums_kept(H, E, exact=Pn >= P)
    for c in (new, sub):
        if c is not None:
            c.Free()
