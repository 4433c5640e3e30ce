"""Faults: an exception on one rank mid-collective ends the whole job with a non-zero exit."""

from __future__ import annotations

import time

import pytest
from mpirun import run_mpi

import spardl


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", sorted(spardl.ALGORITHMS))
@pytest.mark.parametrize("mode", ["context", "mpi4py"])
def test_a_failing_rank_ends_the_job(algorithm, mode):
    script_mode = "context" if mode == "context" else "plain"
    args = ["tests/scripts/fault_injection.py", algorithm, script_mode]
    if mode == "mpi4py":
        args = ["-m", "mpi4py", *args]
    t0 = time.monotonic()
    proc = run_mpi(3, args, timeout=60, check=False)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert "injected fault" in proc.stderr
    assert "finished" not in proc.stdout
    assert elapsed < 30, f"job took {elapsed:.1f}s to end"
