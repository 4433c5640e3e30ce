"""Runs the collective tests of tests/mpi/ under `mpiexec -n P` for P in {1, 2, 3, 4, 5, 6, 8}.

One mpiexec per world size runs every file of tests/mpi/ (start-up of P interpreters costs more
than most of the tests); a failing test prints its report and aborts the job (see
tests/mpi/conftest.py), so the failure below names it. Every rank also reports its passed and
skipped counts (tests/mpirun.py), so skips inside tests/mpi cannot go unseen.
"""

from __future__ import annotations

import pytest
from mpirun import run_pytest_under_mpiexec

WORLD_SIZES = [1, 2, 3, 4, 5, 6, 8]


@pytest.mark.mpi
@pytest.mark.parametrize("P", WORLD_SIZES)
def test_under_mpiexec(P):
    # Fails on any failure, a rank without a report, nothing passed, or (CI=true) a skip
    # whose reason is not in tests/skip_allowlist.py; the counts appear in the summary.
    counts = run_pytest_under_mpiexec(P, ["tests/mpi"])
    assert counts.passed > 0, str(counts)
