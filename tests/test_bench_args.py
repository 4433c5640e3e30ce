"""bench/allreduce.py's arguments: a bad one is one line from rank 0 and status 2 on every
rank, before any allreducer is built (not a traceback from inside the library)."""

from __future__ import annotations

import pytest
from mpirun import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--n", "0"], "argument --n: must be an integer >= 1, got 0"),
        (["--density", "2"], "argument --density: must be a density in (0, 1], got 2"),
        (["--repeat", "0"], "argument --repeat: must be an integer >= 1, got 0"),
        (["--teams", "3", "--n", "100"], "--teams must divide the number of ranks P=2, got 3"),
    ],
)
def test_bad_allreduce_bench_argument_is_one_line(args, message):
    proc = run_mpi(2, ["bench/allreduce.py", *args], timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"allreduce.py: error: {message}"
