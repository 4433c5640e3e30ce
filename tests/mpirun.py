"""Spawning `mpiexec -n P` from pytest, always with a timeout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = int(os.environ.get("SPARDL_MPI_TIMEOUT", "600"))


def mpiexec() -> str:
    """The mpiexec beside this Python (the `mpich` wheel), else the one on PATH; skip if none."""
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpiexec (pip install mpich)")
    return found


def _text(b) -> str:
    if b is None:
        return ""
    return b.decode(errors="replace") if isinstance(b, bytes) else b


def run_mpi(
    P: int, args: list[str], timeout: int = TIMEOUT, env: dict | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """Run `mpiexec -n P python <args>` from the repository root, killed after `timeout` s.

    With ``check`` (default), a non-zero exit fails the calling test with both output streams.
    """
    cmd = [mpiexec(), "-n", str(P), sys.executable, *args]
    # A process manager's variables (if pytest itself runs under one) would make the child
    # job join the wrong process group.
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_"))}
    full_env = dict(inherited, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    full_env.update(env or {})
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(
            f"{' '.join(cmd[2:])}: mpiexec -n {P} timed out after {timeout}s\n"
            f"{_text(e.stdout)[-5000:]}\n{_text(e.stderr)[-5000:]}"
        )
    if check and proc.returncode != 0:
        pytest.fail(
            f"mpiexec -n {P} {' '.join(args)} exited {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-8000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
        )
    return proc
