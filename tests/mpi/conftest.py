"""Tests in this folder run on every rank under `mpiexec -n P python -m pytest tests/mpi`.

Every test is collective. A failure on one rank would leave the others waiting in the next
collective, so the first failing rank prints its report and aborts the whole job (non-zero exit),
which the outer runner (tests/test_mpi.py) shows.
"""

import sys
from pathlib import Path

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


# The abort-on-failure hook, the outcome report (for tests/mpirun.py) and the `comm` fixture,
# shared by every folder run on every rank; here also the `every_comm` mark's parametrisation
# and the freeing of what each test's allreducers and Comms hold.
from mpiutil import (  # noqa: E402, F401
    comm,
    free_communicators,
    pytest_collectreport,
    pytest_generate_tests,
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_sessionfinish,
)
