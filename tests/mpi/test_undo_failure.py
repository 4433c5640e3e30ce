"""An allreducer's undo that raises on one rank only, and a fault in one rank's load: every rank
raises (the failing rank its own error, the others a ValueError naming it), where that rank
raising alone left the others waiting in the call's agreement.

Runs on every rank under `mpiexec -n P` (tests/test_mpi.py); tests/test_undo_failure.py has
the single-rank behaviour (notes, every refused call, ``check=False``).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from mpiutil import grads_for

import spardl

N = 60
#: "auto:dense" is auto whose only candidate is dense: its steps are the candidate's own.
ALGORITHMS = ["dense", "spardl", "oktopk", "topka", "auto", "auto:dense"]
REFUSED = "state could not be restored"


def _stepped(comm, algorithm, **options):
    if algorithm == "auto:dense":
        algorithm, options = "auto", {**options, "candidates": ["dense"]}
    ar = spardl.make(algorithm, comm, N, density=0.1, **options)
    for s in range(2):
        ar(grads_for(comm, N, np.float32, seed=80 + s)[comm.rank])
    return ar


def _injected(*args):
    raise RuntimeError("injected undo failure")


def _assert_refused_everywhere(comm, ar, state) -> None:
    """A step, a load and a density change each raise on every rank: rank 0 (half restored) its
    RuntimeError, the others a ValueError naming it; the others' states stay as they were."""
    before = ar.step
    match = REFUSED if comm.rank == 0 else rf"rank 0 failed \(RuntimeError: .*{REFUSED}"
    error = RuntimeError if comm.rank == 0 else ValueError
    calls = (
        lambda: ar(grads_for(comm, N, np.float32, seed=90)[comm.rank]),
        lambda: ar.load_state_dict(state),
        lambda: ar.set_density(0.2),
    )
    for call in calls:
        with pytest.raises(error, match=match):
            call()
    if comm.rank != 0:
        assert ar.state_dict()["step"] == before
    ar.close()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_rollback_that_fails_on_one_rank_is_refused_on_every_rank(comm, algorithm, monkeypatch):
    """A NaN step raises NonFiniteError everywhere, and its rollback raises on rank 0 (injected,
    after putting the state back: close() compares the call counts across ranks, which a
    rollback that stopped midway may leave apart)."""
    ar = _stepped(comm, algorithm, nonfinite="raise")
    state = ar.state_dict()
    if comm.rank == 0:
        rollback = ar._rollback

        def fail(saved):
            rollback(saved)
            _injected()

        monkeypatch.setattr(ar, "_rollback", fail)
    with pytest.raises(spardl.NonFiniteError) as info:
        ar(np.full(N, np.nan, dtype=np.float32))
    notes = "".join(getattr(info.value, "__notes__", []))
    assert ("injected undo failure" in notes) == (comm.rank == 0), notes
    monkeypatch.undo()
    _assert_refused_everywhere(comm, ar, state)


@pytest.mark.parametrize("algorithm", ["dense", "spardl"])
def test_a_restore_that_fails_after_one_ranks_load_is_refused_on_every_rank(
    comm, algorithm, monkeypatch
):
    """Rank 0's state is refused (another n) and putting its state back raises there: every
    rank raises the load's error, and the next calls are refused on every rank."""
    ar = _stepped(comm, algorithm)
    state = ar.state_dict()
    bad = {**state, "n": N + 1} if comm.rank == 0 else state
    if comm.rank == 0:
        monkeypatch.setattr(ar, "_restore", _injected)
    match = "state was saved with n=" if comm.rank == 0 else "rank 0 rejected its arguments"
    with pytest.raises(ValueError, match=match):
        ar.load_state_dict(bad)
    monkeypatch.undo()
    _assert_refused_everywhere(comm, ar, state)


def _malformed_everywhere(comm, words: str):
    """What every rank raises when rank 0's state is malformed (``words``: its fault): that
    ValueError there, the others one naming rank 0 and quoting it."""
    said = rf"state is malformed \({re.escape(words)}\)"
    match = said if comm.rank == 0 else rf"rank 0 rejected its arguments \(ValueError: {said}"
    return pytest.raises(ValueError, match=match)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_fault_in_one_ranks_load_fails_on_every_rank(comm, algorithm, monkeypatch):
    """Rank 0's load raises a fault (no TypeError or ValueError) after changing its state: every
    rank raises, rank 0 a malformed state, and every rank keeps its state and goes on."""
    ar = _stepped(comm, algorithm)
    state = ar.state_dict()
    if comm.rank == 0:

        def fault(loaded):
            ar.step, ar._calls = 99, 99
            raise ZeroDivisionError("injected load fault")

        monkeypatch.setattr(ar, "_load_local", fault)
    with _malformed_everywhere(comm, "ZeroDivisionError: injected load fault"):
        ar.load_state_dict(state)
    monkeypatch.undo()
    after = ar.state_dict()
    assert (after["step"], after["calls"]) == (state["step"], state["calls"])
    ar(grads_for(comm, N, np.float32, seed=90)[comm.rank])
    ar.load_state_dict(state)
    ar.close()


def test_a_fault_in_one_ranks_pending_candidate_state_fails_on_every_rank(comm, monkeypatch):
    """auto keeps a loaded candidate's state until it builds that candidate, which a load
    does for the current one. A fault while applying it on rank 0 (injected: no TypeError or
    ValueError; a SparDL candidate state without its h raised a KeyError there) makes every
    rank raise, rank 0 a malformed state: that rank once raised alone and the others waited
    in the build's agreement."""
    from spardl.algorithms.auto import Auto

    opts = {"candidates": ["topka", "spardl:d=1"], "trials": 1}
    ar = spardl.make("auto", comm, N, density=0.1, **opts)
    for s in range(2):
        ar(grads_for(comm, N, np.float32, seed=80 + s)[comm.rank])
    state = ar.state_dict()
    fresh = spardl.make("auto", comm, N, density=0.1, **opts)
    if comm.rank == 0:

        def fault(self, inner, pending):
            raise ZeroDivisionError("injected apply fault")

        monkeypatch.setattr(Auto, "_set_inner_state", fault)
    with _malformed_everywhere(comm, "ZeroDivisionError: injected apply fault"):
        fresh.load_state_dict(state)
    monkeypatch.undo()
    fresh.close()
    ar.close()
