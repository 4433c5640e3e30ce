"""Spawning `mpiexec -n P` from pytest, always with a timeout, and counting what ran inside."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from skip_allowlist import allowed, in_ci

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = int(os.environ.get("SPARDL_MPI_TIMEOUT", "600"))


def mpiexec() -> str:
    """The mpiexec beside this Python (the `mpich` wheel), else the one on PATH.

    A missing mpiexec fails the calling test (never a skip: every collective test would
    otherwise pass unseen)."""
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        pytest.fail("no mpiexec beside this Python or on PATH (pip install mpich)")
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


@dataclass
class Counts:
    """What one pytest run under ``mpiexec -n P`` did (the same on every rank).

    Attributes
    ----------
    P : int
        World size.
    paths : list of str
        What was run.
    passed, skipped, failed : int
        Outcomes of rank 0 (every rank runs every test).
    skips : list of (str, str)
        Node id and reason of every skip.
    """

    P: int
    paths: list
    passed: int = 0
    skipped: int = 0
    failed: int = 0
    skips: list = field(default_factory=list)

    def __str__(self) -> str:
        return (
            f"mpiexec -n {self.P} pytest {' '.join(self.paths)}: {self.passed} passed, "
            f"{self.skipped} skipped, {self.failed} failed"
        )


#: Every :func:`run_pytest_under_mpiexec` of this session, for the terminal summary
#: (tests/conftest.py).
RUNS: list[Counts] = []


def run_pytest_under_mpiexec(
    P: int,
    paths: list[str],
    *,
    env: dict | None = None,
    timeout: int = TIMEOUT,
    min_passed: int = 1,
    extra_args: list[str] | None = None,
) -> Counts:
    """Run ``python -m pytest paths`` on every rank of ``mpiexec -n P`` and check what ran.

    Each rank writes its counts to a file (tests/mpi/mpiutil.py, ``SPARDL_PYTEST_REPORT``);
    P interleaved terminal outputs cannot be parsed reliably. The calling test fails if the
    job fails or times out, if a rank wrote no report or the ranks' counts differ, if fewer
    than ``min_passed`` tests passed (a run that skipped everything is not a pass), and, in CI
    (``CI=true``), if any skip's reason is not in tests/skip_allowlist.py.

    Parameters
    ----------
    P : int
        World size.
    paths : list of str
        Test paths, relative to the repository root.
    env : dict, optional
        Extra environment variables.
    timeout : int
        Seconds before the job is killed (a failure).
    min_passed : int, default 1
        Fewest tests that must have passed.
    extra_args : list of str, optional
        More pytest arguments (``-k``, ``-m``).

    Returns
    -------
    Counts
        Also recorded in :data:`RUNS` and printed in the session's terminal summary.
    """
    with tempfile.TemporaryDirectory(prefix="spardl-mpi-report-") as tmp:
        report = os.path.join(tmp, "report")
        args = ["-m", "pytest", "-q", "-x", "-rs", "-p", "no:cacheprovider"]
        args += [*(extra_args or []), *paths]
        proc = run_mpi(P, args, timeout, env={**(env or {}), "SPARDL_PYTEST_REPORT": report})
        per_rank = []
        for r in range(P):
            try:
                with open(f"{report}.{r}") as f:
                    per_rank.append(json.load(f))
            except (OSError, ValueError) as e:
                pytest.fail(
                    f"mpiexec -n {P} pytest {' '.join(paths)}: rank {r} wrote no report ({e})\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
                )
    first = per_rank[0]
    counts = Counts(
        P, list(paths), first["passed"], first["skipped"], first["failed"], first["skips"]
    )
    RUNS.append(counts)
    keys = ("passed", "skipped", "failed")
    for r, rep in enumerate(per_rank):
        if any(rep[k] != first[k] for k in keys):
            pytest.fail(f"{counts}; but rank {r}: " + ", ".join(f"{rep[k]} {k}" for k in keys))
    if counts.failed:
        pytest.fail(f"{counts}\n{proc.stdout[-8000:]}")
    if counts.passed < min_passed:
        pytest.fail(f"{counts}: fewer than {min_passed} passed; skips: {counts.skips}")
    if in_ci():
        bad = [(node, why) for node, why in counts.skips if allowed(why) is None]
        if bad:
            listing = "\n".join(f"  {node}: {why}" for node, why in bad)
            pytest.fail(
                f"{counts}; CI=true and these skips are not in tests/skip_allowlist.py:\n" + listing
            )
    return counts
