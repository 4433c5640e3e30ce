"""Runs the collective tests of tests/mpi/ under `mpiexec -n P` for P in {1, 2, 3, 4, 5, 6, 8}."""

from __future__ import annotations

import pytest
from mpirun import ROOT, run_mpi

WORLD_SIZES = [1, 2, 3, 4, 5, 6, 8]
MPI_FILES = sorted(p.name for p in (ROOT / "tests" / "mpi").glob("test_*.py"))


@pytest.mark.mpi
@pytest.mark.parametrize("test_file", MPI_FILES)
@pytest.mark.parametrize("P", WORLD_SIZES)
def test_under_mpiexec(P, test_file):
    run_mpi(P, ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"tests/mpi/{test_file}"])
