"""Runs the collective tests of tests/mpi/ under `mpiexec -n P` for P in {1, 2, 3, 4, 5, 6, 8}.

One mpiexec per world size runs every file of tests/mpi/ (start-up of P interpreters costs more
than most of the tests); a failing test prints its report and aborts the job (see
tests/mpi/conftest.py), so the failure below names it.
"""

from __future__ import annotations

import pytest
from mpirun import run_mpi

WORLD_SIZES = [1, 2, 3, 4, 5, 6, 8]


@pytest.mark.mpi
@pytest.mark.parametrize("P", WORLD_SIZES)
def test_under_mpiexec(P):
    proc = run_mpi(P, ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/mpi"])
    assert " passed" in proc.stdout, proc.stdout[-2000:]
