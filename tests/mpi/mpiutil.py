"""Helpers for the collective tests: gathering results and checking them on every rank."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from mpi4py import MPI


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Abort the whole job at the first failure: the other ranks would wait in a collective.

    Re-exported by the conftest.py of every folder whose tests run on every rank.
    """
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and os.environ.get("SPARDL_TEST_NO_ABORT") != "1":
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write(f"\n===== rank {rank}: {item.nodeid} FAILED ({rep.when}) =====\n")
        sys.stderr.write(str(rep.longrepr) + "\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


_OUTCOMES = {"passed": 0, "skipped": 0, "failed": 0, "skips": []}


def _skip_reason(rep) -> str:
    lr = rep.longrepr
    reason = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    return reason.removeprefix("Skipped: ")


def pytest_runtest_logreport(report):
    """Count this rank's outcomes (for the report file, see :func:`pytest_sessionfinish`)."""
    if report.skipped:
        _OUTCOMES["skipped"] += 1
        _OUTCOMES["skips"].append([report.nodeid, _skip_reason(report)])
    elif report.failed:
        _OUTCOMES["failed"] += 1
    elif report.when == "call":
        _OUTCOMES["passed"] += 1


def pytest_collectreport(report):
    """A file skipped as a whole (``pytest.skip(allow_module_level=True)``) counts as a skip."""
    if report.skipped:
        _OUTCOMES["skipped"] += 1
        _OUTCOMES["skips"].append([report.nodeid, _skip_reason(report)])
    elif report.failed:
        _OUTCOMES["failed"] += 1


def pytest_sessionfinish(session, exitstatus):
    """With ``SPARDL_PYTEST_REPORT=<path>``, write this rank's counts to ``<path>.<rank>`` as
    JSON (passed, skipped, failed, skips: [node id, reason]) for the runner outside mpiexec
    (tests/mpirun.py), which cannot read P interleaved terminal outputs reliably."""
    path = os.environ.get("SPARDL_PYTEST_REPORT")
    if not path:
        return
    import json

    rank = MPI.COMM_WORLD.Get_rank()
    with open(f"{path}.{rank}", "w") as f:
        json.dump({**_OUTCOMES, "exitstatus": int(exitstatus)}, f)


#: The communicators a test marked ``every_comm`` runs on, as mpi4py's own tests do: the world;
#: the world with its ranks reversed (a rank's number in ``comm`` is not its world rank, and its
#: neighbours are others); the world split into two halves that run the test side by side
#: (``comm`` is smaller than the world, and another group's traffic runs alongside).
COMM_KINDS = ("world", "reversed", "halves")


#: World sizes at which ``every_comm`` tests also run on the reversed and halved communicators.
#: P = 1 has nothing new (both are the world again); P = 8 is left out to keep the suite's time
#: in bounds (three passes of every marked test at 8 ranks on a 2-core runner are the costliest
#: part); 2 … 6 cover even and uneven halves (5 splits into 2 and 3) and non-powers of two.
EXTRA_KINDS_AT = (2, 3, 4, 5, 6)


def comm_kinds(world_size: int) -> list[str]:
    """The kinds of :data:`COMM_KINDS` that ``every_comm`` tests run on at this world size."""
    return list(COMM_KINDS) if world_size in EXTRA_KINDS_AT else ["world"]


def make_comm(kind: str):
    """A new communicator of ``kind`` over the world's ranks (collective; free it after use)."""
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if kind == "reversed":
        return world.Split(0, size - 1 - rank)
    if kind == "halves":
        return world.Split(2 * rank // size, rank)
    raise ValueError(f"unknown communicator kind {kind!r}")


def pytest_generate_tests(metafunc):
    """A test marked ``every_comm`` runs once per communicator kind (:data:`COMM_KINDS`).

    Re-exported by the conftest.py of the folders that use the mark."""
    if "comm" in metafunc.fixturenames and metafunc.definition.get_closest_marker("every_comm"):
        kinds = comm_kinds(MPI.COMM_WORLD.Get_size())
        metafunc.parametrize("comm", kinds, indirect=True, ids=[f"comm_{k}" for k in kinds])


@pytest.fixture
def comm(request):
    """The world communicator (every rank runs every test), or for a test marked
    ``every_comm`` each communicator of :data:`COMM_KINDS` in turn."""
    kind = getattr(request, "param", "world")
    if kind == "world":
        yield MPI.COMM_WORLD
        return
    c = make_comm(kind)
    try:
        yield c
    finally:
        c.Free()


@pytest.fixture(autouse=True)
def free_communicators(monkeypatch):
    """Close every allreducer and free every :class:`spardl.comm.Comm` a test made, when it
    ends (collective: every rank runs the same tests in the same order). A test session under
    mpiexec builds thousands of them, and MPICH allows about 2,000 communicators per process.

    Re-exported by the conftest.py of the folders whose tests are independent of each other."""
    from spardl.algorithms.base import Allreducer
    from spardl.comm import Comm

    made: list = []

    def track(cls):
        init = cls.__init__

        def tracked(self, *args, **kwargs):
            made.append(self)
            init(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", tracked)

    track(Allreducer)
    track(Comm)
    yield
    # Allreducers first (their close() checks across ranks on their communicator), then
    # the Comms: an allreducer is listed before the duplicate it makes of its comm.
    for obj in reversed(made):
        if isinstance(obj, Allreducer):
            obj.close()
    for obj in reversed(made):
        if not isinstance(obj, Allreducer) and hasattr(obj, "_mpi"):
            obj.free()


def gather_all(comm, obj):
    """Every rank's object, on every rank."""
    return comm.allgather(obj)


def assert_identical_everywhere(comm, result):
    """The sparse result is bit-identical on every rank."""
    mine = (result.indices.tobytes(), result.values.tobytes(), result.n)
    everyone = comm.allgather(mine)
    for r, other in enumerate(everyone):
        assert other == mine, f"rank {comm.rank} and rank {r} hold different results"


def grads_for(comm, n, dtype, seed, kind="normal"):
    """Every rank's gradient (rank r gets stream seed + r), on every rank, as a list."""
    out = []
    for r in range(comm.size):
        rng = np.random.default_rng(seed * 1000 + r)
        if kind == "normal":
            g = rng.standard_normal(n)
        elif kind == "heavy":
            g = rng.standard_t(2, n) * (rng.random(n) < 0.5)
        else:
            raise ValueError(kind)
        out.append(g.astype(dtype))
    return out


def conservation_error(comm, x_local, out_dense, residual_new, op):
    """max |Σ_r X_r − P·out − Σ_r E_r,new| relative to max |Σ_r X_r| (float64 sums)."""
    P = comm.size
    sx = np.zeros(len(x_local), np.float64)
    comm.Allreduce(np.asarray(x_local, np.float64), sx, op=MPI.SUM)
    se = np.zeros(len(x_local), np.float64)
    comm.Allreduce(np.asarray(residual_new, np.float64), se, op=MPI.SUM)
    scale = P if op == "mean" else 1
    diff = sx - scale * np.asarray(out_dense, np.float64) - se
    return float(np.max(np.abs(diff), initial=0.0) / max(np.max(np.abs(sx), initial=0.0), 1e-30))


def assert_sparse_equal(out, ref_indices, ref_values):
    """``out`` holds exactly the reference's entries, bit for bit, less its explicit zeros.

    The allreducers drop entries whose reduced value is exactly ±0 (a selection may pick zeros
    when fewer than k entries are non-zero); the references keep them. NaN entries are kept.
    """
    ref_indices = np.asarray(ref_indices)
    ref_values = np.asarray(ref_values)
    keep = ref_values != 0
    np.testing.assert_array_equal(out.indices, ref_indices[keep])
    np.testing.assert_array_equal(out.values, ref_values[keep])
