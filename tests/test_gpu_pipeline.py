"""Runs tests/mpi_cudasim (GPU buffers through the whole collective pipeline) on the Numba CUDA
simulator under `mpiexec -n P` for P in {1, 4}: one rank (nothing to exchange), and four,
where with n = 42 the blocks are uneven and SparDL runs with 1, 2 and 4 teams (teams of four,
of two, of one). Other world sizes are left out for time (the simulator runs every kernel in
Python); the collectives' schedules, which host and device calls share, are tested at every P up
to 8 by tests/test_mpi.py.

Part of the cudasim line of ``make test``::

    NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/test_gpu_pipeline.py

Without ``NUMBA_ENABLE_CUDASIM=1`` (and without a GPU) it is skipped, so the plain test run does
not pay for the simulator twice (tests/skip_allowlist.py allows that skip only where neither the
simulator nor a GPU is there). Each run must report tests that passed inside (tests/mpirun.py).
"""

from __future__ import annotations

import os

import pytest
from mpirun import run_pytest_under_mpiexec

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def _gpu_or_sim() -> bool:
    if SIM:
        return True
    try:
        from numba import cuda

        return cuda.is_available()
    except Exception:  # noqa: BLE001 - no numba-cuda: no GPU path to test
        return False


@pytest.mark.cudasim
@pytest.mark.mpi
@pytest.mark.skipif(not _gpu_or_sim(), reason="needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU")
@pytest.mark.parametrize("P", [1, 4])
def test_gpu_pipeline_under_mpiexec(P):
    env = {"NUMBA_ENABLE_CUDASIM": "1"} if SIM else {}
    # The child module skips itself as a whole without the simulator or a GPU, and a skipped
    # run exits 0: the tests inside must have run.
    counts = run_pytest_under_mpiexec(P, ["tests/mpi_cudasim"], env=env, timeout=600)
    assert counts.passed > 0, str(counts)
