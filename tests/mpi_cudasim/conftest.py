"""Tests in this folder run on every rank under
`NUMBA_ENABLE_CUDASIM=1 mpiexec -n P python -m pytest tests/mpi_cudasim`, driven by
tests/test_gpu_pipeline.py. They are collective, like tests/mpi/, and reuse its conventions: the
first failing rank prints its report and aborts the whole job.
"""

import sys
from pathlib import Path

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
