"""Tests in this folder run on every rank under `mpiexec -n P python -m pytest tests/mpi`.

Every test is collective. A failure on one rank would leave the others waiting in the next
collective, so the first failing rank prints its report and aborts the whole job (non-zero exit),
which the outer runner (tests/test_mpi.py) shows.
"""

import os
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

# tests/ holds the NumPy references (naive.py, ref_*.py) shared with the single-process tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def pytest_configure(config):
    # Hypothesis draws the same examples on every rank only without a shared database.
    try:
        from hypothesis import settings

        settings.register_profile("mpi", database=None, derandomize=True, deadline=None)
        settings.load_profile("mpi")
    except ImportError:  # pragma: no cover
        pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and os.environ.get("SPARDL_TEST_NO_ABORT") != "1":
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write(f"\n===== rank {rank}: {item.nodeid} FAILED ({rep.when}) =====\n")
        sys.stderr.write(str(rep.longrepr) + "\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


@pytest.fixture
def comm():
    return MPI.COMM_WORLD
