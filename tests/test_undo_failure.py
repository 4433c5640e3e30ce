"""An allreducer whose undo raises: a step that raises (or is skipped) and a load that fails put
the state back (``_rollback``, ``_restore``); if that raises too, the caller still gets the
call's own error, the undo's failure in a note (PEP 678), and the half-restored allreducer
refuses every later call but ``close()`` (a RuntimeError saying that the state could not be
restored, the undo's error as its cause), rather than going on from it or saving it. A fault
in a load (no TypeError or ValueError) is reported as a malformed state, the state unchanged.

One rank, in this process (MPI.COMM_SELF); tests/mpi/test_undo_failure.py has every rank
raise when the undo fails on one.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from plain_state import plain_state

import spardl

N = 40
#: "auto:dense" is auto whose only candidate is dense: its steps are the candidate's own.
ALGORITHMS = ["dense", "spardl", "oktopk", "topka", "auto", "auto:dense"]
REFUSED = "state could not be restored"


def _grad(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(N).astype(np.float32)


def _stepped(algorithm: str, **options):
    if algorithm == "auto:dense":
        algorithm, options = "auto", {**options, "candidates": ["dense"]}
    ar = spardl.make(algorithm, MPI.COMM_SELF, N, density=0.1, **options)
    for s in range(2):
        ar(_grad(s))
    return ar


def _injected(*args):
    raise RuntimeError("injected undo failure")


def _notes(err: BaseException) -> str:
    return "".join(getattr(err, "__notes__", []))


def _assert_refuses_every_call_but_close(ar, state) -> None:
    """Every later call raises the RuntimeError, the undo's error as its cause; close() works."""
    calls = {
        "call": lambda: ar(_grad(5)),
        "load_state_dict": lambda: ar.load_state_dict(state),
        "state_dict": ar.state_dict,
        "set_density": lambda: ar.set_density(0.2),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=REFUSED) as info:
            call()
        assert "injected undo failure" in str(info.value.__cause__), name
    ar.close()
    assert ar.closed


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_rollback_that_raises_keeps_the_steps_error_and_refuses_every_later_call(
    monkeypatch, algorithm
):
    ar = _stepped(algorithm, nonfinite="raise")
    state = ar.state_dict()
    monkeypatch.setattr(ar, "_rollback", _injected)
    with pytest.raises(spardl.NonFiniteError) as info:
        ar(np.full(N, np.nan, dtype=np.float32))
    assert "injected undo failure" in _notes(info.value)
    assert "could not be restored" in _notes(info.value)
    monkeypatch.undo()
    _assert_refuses_every_call_but_close(ar, state)


@pytest.mark.parametrize("algorithm", ["dense", "spardl"])
def test_a_rollback_of_a_skipped_step_that_raises_refuses_every_later_call(monkeypatch, algorithm):
    """A step dropped by ``nonfinite="skip"`` has no error of its own: the undo's propagates."""
    ar = _stepped(algorithm, nonfinite="skip")
    state = ar.state_dict()
    monkeypatch.setattr(ar, "_rollback", _injected)
    with pytest.raises(RuntimeError, match="injected undo failure"):
        ar(np.full(N, np.nan, dtype=np.float32))
    monkeypatch.undo()
    _assert_refuses_every_call_but_close(ar, state)


def test_without_check_a_half_restored_allreducer_refuses_on_its_own_rank(monkeypatch):
    ar = _stepped("topka", nonfinite="raise", check=False)
    monkeypatch.setattr(ar, "_rollback", _injected)
    with pytest.raises(spardl.NonFiniteError):
        ar(np.full(N, np.nan, dtype=np.float32))
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match=REFUSED):
        ar(_grad(5))
    ar.close()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_restore_that_raises_keeps_the_loads_error_and_refuses_every_later_call(
    monkeypatch, algorithm
):
    ar = _stepped(algorithm)
    state = ar.state_dict()
    monkeypatch.setattr(ar, "_restore", _injected)
    with pytest.raises(ValueError, match="state was saved with n=") as info:
        ar.load_state_dict({**state, "n": N + 1})
    assert "injected undo failure" in _notes(info.value)
    monkeypatch.undo()
    _assert_refuses_every_call_but_close(ar, state)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_fault_in_a_load_is_a_malformed_state_and_changes_nothing(monkeypatch, algorithm):
    """A fault (not a TypeError or ValueError) that ``_load_local`` raises, after changing the
    state: a ValueError saying the state is malformed, the fault as its cause, and the state
    as it was; the allreducer goes on."""
    ar = _stepped(algorithm)
    state = ar.state_dict()
    before = plain_state(state)

    def fault(loaded):
        ar.step, ar._calls = 99, 99
        raise ZeroDivisionError("injected load fault")

    monkeypatch.setattr(ar, "_load_local", fault)
    with pytest.raises(ValueError, match=r"state is malformed \(ZeroDivisionError") as info:
        ar.load_state_dict(state)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    monkeypatch.undo()
    assert plain_state(ar.state_dict()) == before
    ar(_grad(5))
    ar.load_state_dict(state)
    assert plain_state(ar.state_dict()) == before
    ar.close()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_restore_that_fails_inside_a_faulty_load_keeps_the_fault_as_the_cause(algorithm):
    """A fault while ``_load_local`` applies a state (in the algorithm's own state, the
    counters changed already), and putting the state back there raises too (injected, once):
    the load raises the malformed state of the fault, the fault its cause and the restore's
    failure in a note (the restore's failure once became the cause, and the message, hiding
    the fault); load_state_dict's own restore then puts the state back, and it goes on."""
    ar = _stepped(algorithm)
    state = ar.state_dict()
    ar(_grad(5))
    before = plain_state(ar.state_dict())

    def fault(extra):  # once: the restores load their saved extra state
        del ar._load_extra_state
        raise ZeroDivisionError("injected load fault")

    def fail(saved):  # once: load_state_dict's own restore then works
        del ar._restore
        raise RuntimeError("injected undo failure")

    ar._load_extra_state, ar._restore = fault, fail
    said = r"state is malformed \(ZeroDivisionError: injected load fault\)"
    with pytest.raises(ValueError, match=said) as info:
        ar.load_state_dict(state)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert "injected undo failure" in _notes(info.value)
    assert ar.broken is None
    assert plain_state(ar.state_dict()) == before
    ar(_grad(6))
    ar.load_state_dict(state)
    ar.close()


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (ValueError("bad"), "rank 2 rejected its arguments (ValueError: bad)"),
        (spardl.NonFiniteError("nan"), "rank 2 rejected its arguments (NonFiniteError: nan)"),
        (RuntimeError("could not"), "rank 2 failed (RuntimeError: could not)"),
        (ZeroDivisionError("zero"), "rank 2 failed (ZeroDivisionError: zero)"),
    ],
)
def test_the_other_ranks_say_rejected_for_argument_errors_and_failed_for_the_rest(error, words):
    """What a rank without an error of its own raises after rank 2's: an argument error
    (TypeError or ValueError, subclasses included) is a rejection, anything else a failure."""
    from spardl.algorithms.base import error_report, raise_rejected

    with pytest.raises(ValueError) as info:
        raise_rejected(None, [None, None, error_report(error)])
    assert str(info.value) == words


def test_a_restore_that_raises_has_put_the_counters_back_first(monkeypatch):
    """The step and call count go back before anything that can raise (the density, the
    algorithm's own state): every rank's close() and next agreement compare them, so a rank
    whose restore failed half way still closes with the others."""
    ar = spardl.make("oktopk", MPI.COMM_SELF, 40, density=0.1)
    snap = ar._snapshot()
    for s in range(3):
        ar(np.random.default_rng(s).standard_normal(40))
    ar.set_density(0.2)  # so the restore puts the density back first

    def fail(density):
        raise RuntimeError("injected")

    monkeypatch.setattr(ar, "_apply_density", fail)
    with pytest.raises(RuntimeError, match="injected"):
        ar._restore(snap)
    assert (ar.step, ar._calls) == (snap[0], snap[1])
    monkeypatch.undo()
    ar.close()
    assert ar.closed
