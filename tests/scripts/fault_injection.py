"""One rank raises in the middle of a collective; the job must end, not hang.

usage: python tests/scripts/fault_injection.py ALGORITHM MODE [DIR]
MODE "context": the loop runs inside spardl.abort_on_exception(comm), and a rank that gets past
the block writes DIR/after-RANK (no rank should: the failing one must not go on);
MODE "plain": nothing special (run it as `python -m mpi4py fault_injection.py ...`).
"""

import sys

import numpy as np
from mpi4py import MPI

import spardl
from spardl.comm import Comm

algorithm, mode = sys.argv[1], sys.argv[2]
comm = MPI.COMM_WORLD
victim = comm.Get_size() - 1
n = 4000

if comm.Get_rank() == victim:
    # Fail inside the data exchange: after the first point-to-point or collective call.
    calls = {"n": 0}
    for name in ("sendrecv_bytes", "allreduce", "allgatherv_bytes", "allgather_array", "bcast"):
        orig = getattr(Comm, name)

        def failing(self, *a, _orig=orig, **kw):
            calls["n"] += 1
            if calls["n"] >= 2:
                raise RuntimeError("injected fault")
            return _orig(self, *a, **kw)

        setattr(Comm, name, failing)


def main():
    ar = spardl.make(algorithm, comm, n, density=0.01)
    rng = np.random.default_rng(comm.Get_rank())
    for _ in range(5):
        ar(rng.standard_normal(n).astype(np.float32))
    print("finished", flush=True)


if mode == "context":
    with spardl.abort_on_exception(comm):
        main()
    # Never reached by the failing rank: MPI_Abort may return before the process manager
    # ends the job, and the rank must not go on to code after the block meanwhile. (A file,
    # since the job's output may be cut off by then.)
    if len(sys.argv) > 3:
        with open(f"{sys.argv[3]}/after-{comm.Get_rank()}", "w") as f:
            f.write("got past the block\n")
else:
    main()
