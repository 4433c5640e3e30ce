"""Runs the collective tests of tests/mpi/ under `mpiexec -n P` for P in {1, 2, 3, 4, 5, 6, 8}."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZES = [1, 2, 3, 4, 5, 6, 8]
MPI_FILES = sorted(p.name for p in (ROOT / "tests" / "mpi").glob("test_*.py"))
TIMEOUT = int(os.environ.get("SPARDL_MPI_TIMEOUT", "600"))


def mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpiexec (pip install mpich)")
    return found


def run_mpi(P: int, args: list[str], timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    """Run `mpiexec -n P python <args>` from the repository root, killed after `timeout` s."""
    cmd = [mpiexec(), "-n", str(P), sys.executable, *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    try:
        return subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"mpiexec -n {P} timed out after {timeout}s\n{out[-5000:]}\n{err[-5000:]}")


@pytest.mark.mpi
@pytest.mark.parametrize("test_file", MPI_FILES)
@pytest.mark.parametrize("P", WORLD_SIZES)
def test_under_mpiexec(P, test_file):
    proc = run_mpi(
        P,
        ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly",
         f"tests/mpi/{test_file}"],
    )
    if proc.returncode != 0:
        pytest.fail(
            f"mpiexec -n {P} tests/mpi/{test_file} exited {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-8000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
        )
