"""The cost of the cross-rank agreement every allreducer call starts with.

Times ``spardl.algorithms.base.collective_check`` as an allreducer call makes it (the hashed
algorithm name, n, the gradient's dtype code, the call number, CPU or GPU; its words as a
callable) against a bare ``MPI_Allreduce`` (MAX) of the same 15 int64 that the check sends, in
the same run, and prints the median of each, per call, and their ratio on rank 0.

    mpiexec -n 2 python bench/agreement.py
    mpiexec -n 4 python bench/agreement.py --calls 5000 --rounds 5

The difference is the check's Python: building the signature, converting its fields, reading
the answer.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._args import POSITIVE_INT, Parser  # noqa: E402
from spardl.algorithms.base import SIGNATURE_LEN, _dtype_code, collective_check  # noqa: E402
from spardl.comm import Comm, name_hash  # noqa: E402


def main(argv=None) -> None:
    ap = Parser(description=__doc__.split("\n\n")[0])  # a usage error: one line, from rank 0
    ap.add_argument(
        "--calls", type=POSITIVE_INT, default=2000, help="calls per round (default 2000)"
    )
    ap.add_argument("--rounds", type=POSITIVE_INT, default=5, help="alternating rounds (default 5)")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    comm = Comm(world)
    dtype = np.dtype(np.float32)
    raw = np.zeros(1 + 2 * SIGNATURE_LEN, np.int64)
    out = np.empty_like(raw)

    def check(i):
        collective_check(
            comm,
            None,
            [name_hash("spardl"), 1000, _dtype_code(dtype), i, 0],
            lambda: {"grad dtype": str(dtype), "n": 1000, "call number": i},
        )

    def bare(i):
        world.Allreduce(raw, out, op=MPI.MAX)

    times = {"collective_check": [], "MPI_Allreduce": []}
    for _ in range(args.rounds):
        for name, f in (("collective_check", check), ("MPI_Allreduce", bare)):
            world.Barrier()
            t0 = time.perf_counter()
            for i in range(args.calls):
                f(i)
            times[name].append((time.perf_counter() - t0) / args.calls * 1e6)
    if world.rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"P = {world.size}, {args.calls} calls x {args.rounds} rounds, median per call:")
        for k, v in med.items():
            print(f"  {k:<17} {v:8.1f} us")
        ratio = med["collective_check"] / med["MPI_Allreduce"]
        print(f"  ratio              {ratio:8.2f}x the bare allreduce")


if __name__ == "__main__":
    main()
