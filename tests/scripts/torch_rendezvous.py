"""Run init_process_group_from_mpi on every rank and print one JSON line per rank.

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
try:
    init_process_group_from_mpi(timeout=datetime.timedelta(seconds=60))
except Exception as e:  # noqa: BLE001 - the test reads what every rank raised
    line["error"] = f"{type(e).__name__}: {e}"
else:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    line["port"] = int(os.environ["MASTER_PORT"])
    line["sum"] = float(t.item())
    dist.destroy_process_group()
print(json.dumps(line), flush=True)
MPI.COMM_WORLD.Barrier()
