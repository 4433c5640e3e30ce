"""Tests in this folder run on every rank under `mpiexec -n 4 python -m pytest tests/mpi_elastic`,
driven by tests/test_elastic.py (one world size: the tests resize within it, by sub-communicators).
They are collective, like tests/mpi/, and reuse its conventions: the same Hypothesis examples on
every rank, and the first failing rank prints its report and aborts the whole job.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# tests/ (naive references) and tests/mpi/ (mpiutil) on the path, as in tests/mpi/conftest.py.
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "mpi"))


def pytest_configure(config):
    # Hypothesis draws the same examples on every rank only without a shared database.
    from hypothesis import settings

    settings.register_profile("mpi", database=None, derandomize=True, deadline=None)
    settings.load_profile("mpi")


# The abort-on-failure hook, the outcome report (for tests/mpirun.py) and the `comm` fixture,
# shared by every folder run on every rank.
from mpiutil import (  # noqa: E402, F401
    comm,
    pytest_collectreport,
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_sessionfinish,
)
