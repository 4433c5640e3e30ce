"""Tests in this folder run on every rank under
`NUMBA_ENABLE_CUDASIM=1 mpiexec -n P python -m pytest tests/mpi_cudasim`, driven by
tests/test_gpu_pipeline.py. They are collective, like tests/mpi/, and reuse its conventions: the
first failing rank prints its report and aborts the whole job.
"""

import os
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

HERE = Path(__file__).resolve().parent
# tests/ (naive references) and tests/mpi/ (mpiutil) on the path, as in tests/mpi/conftest.py.
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "mpi"))


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
