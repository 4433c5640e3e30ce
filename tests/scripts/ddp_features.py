"""The DDP feature table (driven by tests/test_ddp_features.py): the spardl hook under each DDP
feature a training job uses, against plain DDP on the same model, data and optimizer.

Usage: mpiexec -n P python tests/scripts/ddp_features.py OUT.json

For every feature, two runs with the hook and one of plain DDP (its own allreduce):
* density 1 (one dense warm-up step, then the sparse path at density 1): the parameters after
  the run against plain DDP's, bit for bit or to rounding (``max_diff``, ``bit_equal``);
* density 1%: the loss on each rank's fixed batches falls, and the replicas stay identical
  (``in_sync``: every rank's parameter bytes equal rank 0's).
Rank 0 writes one entry per feature to OUT.json.
"""

from __future__ import annotations

import contextlib
import json
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from spardl.cli import run_collective
from spardl.torch import SparseHookState, init_process_group_from_mpi, sparse_allreduce_hook

#: feature -> DDP keyword arguments; the other differences are in :func:`_run`.
FEATURES = {
    "one bucket": {},
    "several buckets": {"bucket_cap_mb": 0.002},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.002},
    "static_graph": {"static_graph": True},
    "no_sync (gradient accumulation)": {},
    "join (uneven inputs)": {},
    "frozen layer": {},
    "float64": {},
}
STEPS = 6


def _model(feature: str) -> torch.nn.Module:
    torch.manual_seed(0)
    dtype = torch.float64 if feature == "float64" else torch.float32
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 48),
        torch.nn.ReLU(),
        torch.nn.Linear(48, 48),
        torch.nn.ReLU(),
        torch.nn.Linear(48, 4),
    ).to(dtype)
    if feature == "frozen layer":
        for p in net[0].parameters():
            p.requires_grad_(False)
    return net


def _batches(feature: str, rank: int, dtype) -> list:
    """This rank's fixed batches: 2·STEPS micro-batches for no_sync, STEPS − rank for join (the
    ranks run out of data at different steps), STEPS otherwise."""
    g = torch.Generator().manual_seed(1000 + rank)
    count = {"no_sync (gradient accumulation)": 2 * STEPS, "join (uneven inputs)": STEPS - rank}
    n = count.get(feature, STEPS)
    return [
        (torch.randn(8, 16, generator=g, dtype=dtype), torch.randn(8, 4, generator=g, dtype=dtype))
        for _ in range(max(n, 1))
    ]


def _run(world, feature: str, density: float | None):
    """Train plain DDP (``density`` None) or DDP with the spardl hook; returns (model, losses:
    the mean loss over this rank's batches before and after)."""
    rank = world.Get_rank()
    model = _model(feature)
    net = DDP(model, **FEATURES[feature])
    if density is not None:
        state = SparseHookState(world, "spardl", warmup_steps=1, model=model, density=density)
        net.register_comm_hook(state, sparse_allreduce_hook)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    dtype = next(model.parameters()).dtype
    data = _batches(feature, rank, dtype)

    def loss_now():
        with torch.no_grad():
            return float(np.mean([float(F.mse_loss(model(x), y)) for x, y in data]))

    before = loss_now()
    join = feature.startswith("join")
    with Join([net]) if join else contextlib.nullcontext():
        if feature.startswith("no_sync"):
            for i in range(0, len(data), 2):
                opt.zero_grad()
                with net.no_sync():
                    F.mse_loss(net(data[i][0]), data[i][1]).backward()
                F.mse_loss(net(data[i + 1][0]), data[i + 1][1]).backward()
                opt.step()
        else:
            for x, y in data:
                opt.zero_grad()
                F.mse_loss(net(x), y).backward()
                opt.step()
    return model, (before, loss_now())


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def feature_row(world, feature: str) -> dict:
    ref, _ = _run(world, feature, None)
    one, _ = _run(world, feature, 1.0)
    sparse, (before, after) = _run(world, feature, 0.01)
    a, b, init = _flat(one), _flat(ref), _flat(_model(feature))
    scale = float(b.abs().max())
    mine = _flat(sparse).numpy().tobytes()
    in_sync = all(world.allgather(mine == world.bcast(mine, root=0)))
    frozen_moved = None
    if feature == "frozen layer":  # the first Linear's weight and bias lead the flat vector
        first = sum(p.numel() for p in sparse[0].parameters())
        frozen_moved = float((_flat(sparse)[:first] - init[:first]).abs().max())
    return {
        "bit_equal": a.numpy().tobytes() == b.numpy().tobytes(),
        "max_diff": float((a - b).abs().max()) / max(scale, 1e-30),
        "moved": float((b - init).abs().max()),
        "loss_before": world.allreduce(before) / world.Get_size(),
        "loss_after": world.allreduce(after) / world.Get_size(),
        "in_sync": in_sync,
        "frozen_moved": frozen_moved,
    }


def main(out_path, world):
    torch.set_num_threads(1)
    init_process_group_from_mpi(world)
    import torch.distributed as dist

    rows = {"world_size": world.Get_size()}
    for feature in FEATURES:
        rows[feature] = feature_row(world, feature)
    dist.destroy_process_group()
    if world.Get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(run_collective(main, sys.argv[1]))
