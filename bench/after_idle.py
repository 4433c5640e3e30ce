"""One allreducer's call time back to back, after a raw ``Allreduce``, and after an idle pause.

    spardl cluster run --nodes 4 --bandwidth 1gbit -- \\
        python bench/after_idle.py --algorithm spardl --teams 4 --n 25000000 --density 0.01

bench/allreduce.py pairs every timed call with MPI's own ``Allreduce`` of the same buffer, timed
right before it. On a slow link that peer leaves the cores idle for seconds, and a short call
that follows an idle pause can run slower than the same call back to back (cold caches, a
virtual CPU that the host took away). This script measures that effect for one allreducer:
each mode runs ``--repeat`` calls, each after a barrier, preceded by nothing ("back to back"),
by a raw fp32 ``Allreduce`` ("after raw"), or by ``--pause`` seconds of sleep ("after pause");
rank 0 prints the median over calls of the slowest rank's wall time and the median of rank 0's
CPU time (``time.process_time``) per mode.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import spardl  # noqa: E402
from bench._args import (  # noqa: E402
    DENSITY,
    ELEMENTS,
    NONNEGATIVE_FLOAT,
    NONNEGATIVE_INT,
    POSITIVE_INT,
    Parser,
)


def _args(argv):
    # One line from rank 0 for a usage error, before any allreducer is built.
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--algorithm", default="spardl", choices=sorted(spardl.ALGORITHMS))
    ap.add_argument("--teams", type=POSITIVE_INT, default=1, help="SparDL's d (divides P)")
    ap.add_argument("--n", type=ELEMENTS, default=25_000_000)
    ap.add_argument("--density", type=DENSITY, default=0.01)
    ap.add_argument("--repeat", type=POSITIVE_INT, default=8)
    ap.add_argument("--warmup", type=NONNEGATIVE_INT, default=6)
    ap.add_argument(
        "--pause", type=NONNEGATIVE_FLOAT, nargs="+", default=[0.2, 1.9], help="seconds"
    )
    a = ap.parse_args(argv)
    P = MPI.COMM_WORLD.size
    if a.algorithm == "spardl" and P % a.teams:
        ap.error(f"--teams must divide the number of ranks P={P}, got {a.teams}")
    return a


def main(argv=None) -> int:
    a = _args(argv)
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(comm.rank)
    g = (rng.standard_t(3, a.n) * 1e-3).astype(np.float32)  # as bench/allreduce.py's
    peer_out = np.empty_like(g)
    opts = {"teams": a.teams} if a.algorithm == "spardl" else {}
    ar = spardl.make(a.algorithm, comm, a.n, density=a.density, **opts)
    for _ in range(a.warmup):
        ar(g)
    modes = [("back to back", None), ("after raw", "raw")]
    modes += [(f"after pause {s:g} s", s) for s in a.pause]
    rows = []
    for label, before in modes:
        walls, cpus = [], []
        for _ in range(a.repeat):
            if before == "raw":
                comm.Barrier()
                comm.Allreduce(g, peer_out, op=MPI.SUM)
            elif before is not None:
                time.sleep(before)
            comm.Barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            ar(g)
            wall = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            walls.append(wall)
            cpus.append(time.process_time() - c0)
        rows.append((label, float(np.median(walls)), float(np.median(cpus))))
    if comm.rank == 0:
        name = f"{a.algorithm}" + (f" d={a.teams}" if a.algorithm == "spardl" else "")
        print(f"# {name}, P={comm.size}, n={a.n}, density {a.density}, {a.repeat} calls per mode")
        print(f"{'mode':<22} {'wall ms':>9} {'CPU ms (rank 0)':>16}")
        for label, wall, cpu in rows:
            print(f"{label:<22} {wall * 1e3:>9.1f} {cpu * 1e3:>16.1f}")
    ar.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
