"""Run init_process_group_from_mpi on every rank; rank 0 prints one JSON line per rank.

Each line holds the rank, the port the group met on (or the error it raised) and, where the group
formed, the sum of an all-reduce of rank + 1 over it (a group that formed really communicates).
Every rank exits 0: the test reads the lines.
"""

import datetime
import json
import os

import torch
import torch.distributed as dist
from mpi4py import MPI

from spardl.torch import init_process_group_from_mpi

rank = MPI.COMM_WORLD.Get_rank()
line = {"rank": rank}
# The backend of this rank: TEST_BACKEND_<rank>, else TEST_BACKEND, else None (the default).
backend = os.environ.get(f"TEST_BACKEND_{rank}", os.environ.get("TEST_BACKEND")) or None
try:
    init_process_group_from_mpi(backend=backend, timeout=datetime.timedelta(seconds=60))
except Exception as e:  # noqa: BLE001 - the test reads what every rank raised
    line["error"] = f"{type(e).__name__}: {e}"
else:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    line["port"] = int(os.environ["MASTER_PORT"])
    line["sum"] = float(t.item())
    dist.destroy_process_group()
lines = MPI.COMM_WORLD.gather(line, root=0)  # printed by one rank: no interleaved lines
if rank == 0:
    for one in lines:
        print(json.dumps(one), flush=True)
