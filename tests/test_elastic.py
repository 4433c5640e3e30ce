"""Runs tests/mpi_elastic (elastic resume: checkpoints written at P ranks, loaded at P') under
`mpiexec -n 4`: the tests resize inside that world by sub-communicators (P, P' in 1 … 4: growing,
shrinking, P' not dividing P), so one world size covers them. Every rank reports its passed and
skipped counts (tests/mpirun.py), so a skip inside cannot go unseen."""

from __future__ import annotations

import pytest
from mpirun import run_pytest_under_mpiexec


@pytest.mark.mpi
def test_elastic_resume_under_mpiexec():
    # Fails on any failure, a rank without a report, fewer passed than the collective tests
    # that need no torch, or (CI=true) a skip not in tests/skip_allowlist.py.
    run_pytest_under_mpiexec(4, ["tests/mpi_elastic"], min_passed=11)
