"""Tests in this folder run on every rank under
`NUMBA_ENABLE_CUDASIM=1 mpiexec -n P python -m pytest tests/mpi_cudasim`, driven by
tests/test_gpu_pipeline.py. They are collective, like tests/mpi/, and reuse its conventions: the
first failing rank prints its report and aborts the whole job.
"""

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# tests/ (naive references) and tests/mpi/ (mpiutil) on the path, as in tests/mpi/conftest.py.
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "mpi"))


# The abort-on-failure hook, the outcome report (for tests/mpirun.py) and the `comm` fixture,
# shared by every folder run on every rank.
from mpiutil import (  # noqa: E402, F401
    comm,
    pytest_collectreport,
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_sessionfinish,
)


@pytest.fixture(scope="session", autouse=True)
def _atomic_simulator_shared_arrays():
    # The simulator's shared-array allocation races now and then on a loaded machine (several
    # simulated ranks beside other tests on the cores): a kernel then computes garbage on one
    # rank (tests/cudasim_launch.py). Real GPUs have no such allocation; nothing to patch there.
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        yield
        return
    from cudasim_launch import atomic_shared_arrays

    undo = atomic_shared_arrays()
    yield
    undo()
