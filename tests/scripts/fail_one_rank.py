"""Rank 1 raises while rank 0 waits in a collective: the job must end, non-zero, within seconds.

Usage: mpiexec -n 2 python tests/scripts/fail_one_rank.py
"""

import sys

import numpy as np

from spardl.cli import run_collective


def body(world):
    if world.Get_rank() == 1:
        raise RuntimeError("injected failure on rank 1")
    buf = np.zeros(1)
    world.Allreduce(np.ones(1), buf)  # never completes: rank 1 is gone
    print("rank 0 passed the collective", flush=True)


if __name__ == "__main__":
    sys.exit(run_collective(body))
