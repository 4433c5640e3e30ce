"""``close()``: an allreducer frees the communicators it made (its duplicate, SparDL's teams,
``auto``'s candidates) and nothing it was given; a closed one refuses to run.

Runs on every rank under `mpiexec -n P` (tests/test_mpi.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import spardl
from spardl.comm import Comm

#: More allreducers than MPICH has communicators for one process (2,048 context ids); the
#: loops that build that many run at world sizes 1 and 2 (what they test does not depend on P;
#: at P = 8 on two cores they would cost a minute), a few rounds elsewhere.
MANY = 2200 if MPI.COMM_WORLD.Get_size() <= 2 else 16


def _freed(c: Comm) -> bool:
    return c._mpi == MPI.COMM_NULL


def test_closed_allreducers_do_not_exhaust_the_communicators():
    # On COMM_SELF: the same Dup and Free as on a larger communicator, without P-rank
    # collectives.
    for _ in range(MANY):
        with spardl.make("topka", MPI.COMM_SELF, 8, density=1.0) as ar:
            out = ar(np.ones(8, dtype=np.float32))
        assert ar.closed
    assert np.array_equal(out.to_dense(), np.ones(8, dtype=np.float32))


def test_close_frees_teams_and_duplicate_but_not_a_given_comm(comm):
    P = comm.Get_size()
    d = 2 if P % 2 == 0 else 1
    ar = spardl.make("spardl", comm, 64, density=0.25, teams=d)
    owned = [ar.comm, ar._team, ar._cross]
    ar.close()
    assert all(_freed(c) for c in owned if c is not None)
    ar.close()  # idempotent

    given = Comm(comm)
    ar = spardl.make("spardl", given, 64, density=0.25, teams=d)
    made = [c for c in (ar._team, ar._cross) if c is not None and c is not given]
    ar.close()
    assert all(_freed(c) for c in made)
    assert not _freed(given)
    assert given.allgather_object(given.rank, control=True) == list(range(P))


def test_closed_allreducer_raises_and_keeps_its_state(comm):
    ar = spardl.make("oktopk", comm, 32, density=0.125)
    ar(np.arange(32, dtype=np.float32))
    ar.close()
    with pytest.raises(ValueError, match="closed"):
        ar(np.arange(32, dtype=np.float32))
    with pytest.raises(ValueError, match="closed"):
        ar.set_density(0.5)
    state = ar.state_dict()
    assert state["step"] == 1 and state["residual"].shape == (32,)
    # Loading, gathering and checkpointing need the freed communicators: refused alike,
    # before any message (each rank closed its own).
    from spardl import elastic

    with pytest.raises(ValueError, match="closed"):
        ar.load_state_dict(state)
    with pytest.raises(ValueError, match="closed"):
        elastic.gather_state(ar)
    with pytest.raises(ValueError, match="closed"):
        elastic.save_checkpoint(ar, "never-written.zip")
    with pytest.raises(ValueError, match="closed"):
        elastic.load_gathered_state(ar, None)
    auto = spardl.make("auto", comm, 32, density=0.125)
    auto.close()
    with pytest.raises(ValueError, match="closed"):
        auto.load_state_dict(auto.state_dict())


def test_auto_closes_every_candidate_it_built(comm):
    P = comm.Get_size()
    ar = spardl.make(
        "auto", comm, 256, density=0.05, alpha=1e-5, beta=1e-9, trials=1, interval=2, prune=0
    )
    g = np.random.default_rng(comm.Get_rank()).standard_normal(256).astype(np.float32)
    for _ in range(2 * len(ar.cands)):
        ar(g)
    inners = list(ar._inners.values())
    assert len(inners) == len(ar.cands)  # every candidate was tried once
    owned = [c for a in inners for c in a._own_comms] + [ar.comm]
    assert all(not _freed(c) for c in owned)
    ar.close()
    assert all(a.closed for a in inners)
    assert all(_freed(c) for c in owned)
    assert P == comm.Get_size()


def test_failed_construction_frees_its_duplicate(comm):
    # Every rank fails the cross-rank check together; what the constructor made is freed, so
    # the loop would run out of communicators otherwise.
    for _ in range(MANY if comm.Get_size() == 1 else 8):  # P-rank checks: a few at P > 1
        with pytest.raises(ValueError, match="density"):
            spardl.make("topka", comm, 16, density=2.0)
        with pytest.raises(ValueError, match="algorithm must be one of"):
            spardl.make("nope", comm, 16)
        with pytest.raises(TypeError, match="algorithm must be a string, got int"):
            spardl.make(5, comm, 16)


def test_close_on_one_rank_while_another_calls_raises_on_both(comm):
    """close() is collective: a rank that closes while another calls once left the caller
    waiting forever; both raise now, nothing is freed, and both go on in step."""
    ar = spardl.make("topka", comm, 10, density=1.0)
    g = np.ones(10, dtype=np.float32)
    if comm.Get_size() > 1:
        with pytest.raises(ValueError, match="ranks disagree"):
            ar(g) if comm.Get_rank() == 0 else ar.close()
        assert not ar.closed
    assert np.array_equal(ar(g).to_dense(), np.ones(10, dtype=np.float32))
    ar.close()
    assert ar.closed and _freed(ar.comm)


def test_leaving_a_with_block_on_an_exception_frees_without_waiting_for_the_others(comm):
    """A ``with`` block left by an exception on one rank frees that rank's communicators at
    once (no cross-rank check there, which would wait for ranks that went on)."""
    with pytest.raises(RuntimeError, match="raised in the block"):
        with spardl.make("topka", MPI.COMM_SELF, 8, density=1.0) as ar:
            raise RuntimeError("raised in the block")
    assert ar.closed and _freed(ar.comm)


@pytest.mark.parametrize("algorithm", ["topka", "spardl", "dense"])
def test_allreducers_sharing_a_comm_called_in_another_order_raise(comm, algorithm):
    """Two allreducers on one spardl Comm (shared, not duplicated): a rank calling A where
    another calls B once summed A's gradient with B's on both, silently. Each call's check
    compares which allreducer of the communicator it is; in the right order both are exact."""
    P, rank = comm.Get_size(), comm.Get_rank()
    shared = Comm(comm)
    a = spardl.make(algorithm, shared, 8, density=1.0)
    b = spardl.make(algorithm, shared, 8, density=1.0)
    ga, gb = np.full(8, 1.0, np.float32), np.full(8, 100.0, np.float32)
    if P > 1:
        with pytest.raises(ValueError, match="in the order built on its communicator"):
            a(ga) if rank == 0 else b(gb)
        with pytest.raises(ValueError, match="in the order built on its communicator"):
            a.set_density(0.5) if rank == 0 else b.set_density(0.5)
    assert np.array_equal(a(ga).to_dense(), ga)
    assert np.array_equal(b(gb).to_dense(), gb)
    a.close()
    b.close()
    shared.free()
