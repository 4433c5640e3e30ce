"""The per-step buffer of X = g + E is reused from step to step, never under a caller's feet."""

import weakref

import numpy as np
import pytest
from mpi4py import MPI

import spardl
from spardl._arrays import BufferPool

SPARSE = sorted(set(spardl.ALGORITHMS) - {"dense"})


def _grad(step, n=4096):
    return np.random.default_rng(step).standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("algorithm", SPARSE)
def test_buffers_are_reused_and_results_unchanged(algorithm):
    """Two allreducers, one whose old residuals are kept alive by the caller (no reuse possible)
    and one free to reuse them: bit-identical residuals and outputs over several steps."""
    kept = []
    a = spardl.make(algorithm, MPI.COMM_SELF, 4096, density=0.05)
    b = spardl.make(algorithm, MPI.COMM_SELF, 4096, density=0.05)
    reused = 0
    for step in range(6):
        spares = [weakref.ref(s) for s in b._spares]  # not references
        out_a, out_b = a(_grad(step)), b(_grad(step))
        kept.append(a.residual)  # holds every old residual of a: a can never reuse one
        # A spare that is still alive after the step (the pool keeps one buffer only) was used.
        alive = [w() for w in spares if w() is not None]
        reused += any(buf is b.residual or any(buf is s for s in b._spares) for buf in alive)
        del alive
        np.testing.assert_array_equal(a.residual, b.residual)
        np.testing.assert_array_equal(out_a.indices, out_b.indices)
        np.testing.assert_array_equal(out_a.values, out_b.values)
    assert reused >= 3, f"b reused its spare buffer in {reused} of 5 steps"


@pytest.mark.parametrize("algorithm", ["spardl", "topka", "oktopk"])
def test_a_residual_the_caller_holds_is_never_overwritten(algorithm):
    ar = spardl.make(algorithm, MPI.COMM_SELF, 4096, density=0.05)
    ar(_grad(0))
    held = ar.residual
    copy = held.copy()
    view = ar.residual[:10]  # a view holds the buffer too
    del held
    for step in range(1, 5):
        ar(_grad(step))
    np.testing.assert_array_equal(view, copy[:10])


@pytest.mark.parametrize(
    "algorithm, options",
    [
        ("spardl", {}),
        ("spardl", {"residual": "local"}),
        ("topka", {}),
        ("gtopk", {}),
        ("oktopk", {"selector": "exact"}),
    ],
)
def test_selecting_while_accumulating_changes_nothing(algorithm, options, monkeypatch):
    """The first selection made inside the X = g + E pass (accumulate_topk, fused on blocks of
    at least WINDOW_MIN_N) gives the same bits as X first and the selection after."""
    n = 3 * (1 << 15) + 5
    fused = spardl.make(algorithm, MPI.COMM_SELF, n, density=0.01, **options)
    apart = spardl.make(algorithm, MPI.COMM_SELF, n, density=0.01, **options)
    monkeypatch.setattr(apart, "_first_selection", lambda: None)
    calls = []
    real = fused._accumulate_selecting
    monkeypatch.setattr(fused, "_accumulate_selecting", lambda *a: calls.append(1) or real(*a))
    for step in range(4):
        g = _grad(step, n) * np.float32(10.0 ** (step % 3))
        out_f, out_a = fused(g), apart(g)
        np.testing.assert_array_equal(out_f.indices, out_a.indices)
        assert out_f.values.tobytes() == out_a.values.tobytes()
        assert fused.residual.tobytes() == apart.residual.tobytes()
    assert len(calls) == 4


def test_buffer_pool_hands_out_only_buffers_nothing_else_holds():
    pool = BufferPool(2)
    a, b = np.zeros(8, np.float32), np.zeros(8, np.float32)
    pool.keep(a)
    pool.keep(b)
    pool.keep(b)  # kept once
    assert len(pool) == 2
    assert pool.take(8, np.float32) is None  # a and b are still held here
    a_id = id(a)
    del a
    assert id(pool.take(8, np.float32)) == a_id
    assert pool.take(8, np.float64) is None and pool.take(9, np.float32) is None
    c = np.zeros(8, np.float32)
    pool.keep(c)  # full: the oldest (a's buffer) is given up
    assert len(pool) == 2 and pool.take(8, np.float32) is None  # b and c are held
    del b
    assert pool.take(8, np.float32) is not None
    pool.clear()
    assert len(pool) == 0 and pool.take(8, np.float32) is None


@pytest.mark.parametrize("algorithm", SPARSE)
def test_residual_before_the_first_call_and_after_a_load_has_the_work_dtype(algorithm):
    """Before any call the residual is float32 zeros (the gradients' dtype is not known yet);
    after loading a state, the saved work dtype and values (float32 for float16 gradients)."""
    ar = spardl.make(algorithm, MPI.COMM_SELF, 64, density=0.25)
    assert ar.residual.dtype == np.float32 and not ar.residual.any()
    ar(np.random.default_rng(0).standard_normal(64))  # float64 gradient
    saved = ar.state_dict()
    fresh = spardl.make(algorithm, MPI.COMM_SELF, 64, density=0.25)
    fresh.load_state_dict(saved)
    assert fresh.residual.dtype == np.float64
    np.testing.assert_array_equal(fresh.residual, ar.residual)
    half = spardl.make(algorithm, MPI.COMM_SELF, 64, density=0.25)
    half(np.ones(64, np.float16))
    again = spardl.make(algorithm, MPI.COMM_SELF, 64, density=0.25)
    again.load_state_dict(half.state_dict())
    assert again.residual.dtype == np.float32  # float16 gradients accumulate in float32
