"""Faults: an exception on one rank mid-collective ends the whole job with a non-zero exit."""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpirun import run_mpi

import spardl


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", sorted(spardl.ALGORITHMS))
@pytest.mark.parametrize("mode", ["context", "mpi4py"])
def test_a_failing_rank_ends_the_job(algorithm, mode, tmp_path):
    script_mode = "context" if mode == "context" else "plain"
    args = ["tests/scripts/fault_injection.py", algorithm, script_mode, str(tmp_path)]
    if mode == "mpi4py":
        args = ["-m", "mpi4py", *args]
    t0 = time.monotonic()
    proc = run_mpi(3, args, timeout=60, check=False)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert "injected fault" in proc.stderr
    assert "finished" not in proc.stdout
    time.sleep(1)  # a rank that went on after its MPI_Abort returned has had time to write
    assert not list(tmp_path.iterdir()), "a rank went on after the failure"
    assert elapsed < 30, f"job took {elapsed:.1f}s to end"


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((None,), "comm must be an mpi4py communicator or a spardl Comm, got NoneType"),
        (("self", "x"), "code must be an integer, got str"),
        (("self", True), "code must be an integer, got bool"),
        (("self", 1, 5), "reraise must be an exception type or a tuple of them, got 5"),
        (("self", 1, (ValueError, int)), "reraise must be an exception type"),
    ],
)
def test_abort_on_exception_checks_its_arguments_before_the_body(args, match):
    """A bad argument is a TypeError on entering, before the body runs: found only when the
    body raised, it would end this rank without the abort that frees the others."""
    from mpi4py import MPI

    args = tuple(MPI.COMM_SELF if a == "self" else a for a in args)
    ran = []
    with pytest.raises(TypeError, match=match):
        with spardl.abort_on_exception(*args):
            ran.append(1)
    assert ran == []


def test_abort_on_exception_passes_reraise_types_through():
    from mpi4py import MPI

    with pytest.raises(KeyError):
        with spardl.abort_on_exception(MPI.COMM_SELF, reraise=(KeyError, ValueError)):
            raise KeyError("x")


def test_comm_checks_its_flags():
    from mpi4py import MPI

    with pytest.raises(TypeError, match="dup must be a bool, got str"):
        spardl.Comm(MPI.COMM_SELF, dup="no")
    c = spardl.Comm(MPI.COMM_SELF)
    try:
        with pytest.raises(TypeError, match="timed must be a bool, got int"):
            c.start_trace(timed=1)
        assert not c.tracing
    finally:
        c.free()


def test_comm_allreduce_names_an_unknown_op_before_any_message():
    from mpi4py import MPI

    c = spardl.Comm(MPI.COMM_SELF)
    try:
        with pytest.raises(ValueError, match=r"op must be one of .*, got 'avg'"):
            c.allreduce(np.ones(3), op="avg")
        assert c.stats["messages"] == 0
    finally:
        c.free()
