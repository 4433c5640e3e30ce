"""Checks of spardl.torch under mpiexec (driven by tests/test_torch.py).

Usage: mpiexec -n P python tests/scripts/torch_checks.py OUT.json ALGORITHM

Every rank runs every check (each is collective); rank 0 writes the measurements to OUT.json and
the outer test asserts on them. Any exception aborts the whole job (non-zero exit).
"""

from __future__ import annotations

import copy
import json
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import spardl
from spardl.cli import run_collective
from spardl.torch import (
    SparseGradientReducer,
    SparseHookState,
    init_process_group_from_mpi,
    sparse_allreduce_hook,
)
from spardl.train import build_model, load_digits_split


def rank_batches(rank, steps, batch, seed=0):
    x, y, _, _ = load_digits_split(seed)
    rng = np.random.default_rng([seed, rank])
    for _ in range(steps):
        idx = rng.choice(len(x), batch, replace=False)
        yield torch.from_numpy(x[idx]), torch.from_numpy(y[idx])


def ddp_matches_allreduce(world, algorithm):
    """DDP with the hook at density 1 vs DDP's own allreduce, same data, a few steps."""
    rank = world.Get_rank()
    torch.manual_seed(0)
    base = build_model(4)
    ref_model, hook_model = base, copy.deepcopy(base)
    # A small bucket cap gives several buckets (and a rebuild after the first iteration).
    ref = DDP(ref_model, bucket_cap_mb=0.01)
    hooked = DDP(hook_model, bucket_cap_mb=0.01)
    state = SparseHookState(world, algorithm, warmup_steps=2, density=1.0)
    hooked.register_comm_hook(state, sparse_allreduce_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, hooked)]
    steps = 6
    for xb, yb in rank_batches(rank, steps, 16):
        for net, opt in zip((ref, hooked), opts, strict=True):
            opt.zero_grad()
            F.cross_entropy(net(xb), yb).backward()
            opt.step()
    diffs = [
        float((a - b).detach().abs().max())
        for a, b in zip(ref_model.parameters(), hook_model.parameters(), strict=True)
    ]
    scale = max(float(p.abs().max()) for p in ref_model.parameters())
    moved = max(
        float((a - b).detach().abs().max())
        for a, b in zip(
            ref_model.parameters(), build_model_like(base_seed=0).parameters(), strict=True
        )
    )
    same_everywhere = _same_everywhere(
        world, torch.cat([p.detach().flatten() for p in hook_model.parameters()])
    )
    return {
        "max_abs_diff": max(diffs),
        "param_scale": scale,
        "moved_from_init": moved,
        "hook_steps": state.step,
        "buckets": len(state.allreducers),
        "sparse_bytes_sent": state.stats["bytes_sent"],
        "same_everywhere": same_everywhere,
    }


def build_model_like(base_seed):
    torch.manual_seed(base_seed)
    return build_model(4)


def _same_everywhere(world, t):
    mine = t.detach().numpy().tobytes()
    return all(o == mine for o in world.allgather(mine))


def ddp_sparse_trains(world, algorithm):
    """DDP with the hook at density 1%: the training loss goes down."""
    rank = world.Get_rank()
    torch.manual_seed(1)
    net = DDP(build_model(8))
    state = SparseHookState(world, algorithm, warmup_steps=2, density=0.01)
    net.register_comm_hook(state, sparse_allreduce_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for xb, yb in rank_batches(rank, 120, 16, seed=1):
        opt.zero_grad()
        loss = F.cross_entropy(net(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    mean_losses = world.allreduce(np.array(losses)) / world.Get_size()
    n = sum(p.numel() for p in net.parameters())
    return {
        "first_loss": float(mean_losses[:10].mean()),
        "last_loss": float(mean_losses[-10:].mean()),
        "n_params": n,
        "bytes_sent": state.stats["bytes_sent"],
        "steps": state.step,
    }


class FakeBucket:
    """The part of torch.distributed.GradBucket the hook uses."""

    def __init__(self, index, buffer, last):
        self._i, self._b, self._last = index, buffer, last

    def index(self):
        return self._i

    def buffer(self):
        return self._b

    def is_last(self):
        return self._last


def bucket_resize(world, algorithm):
    """A bucket whose size changes gets a new allreducer; a same-size call reuses it."""
    rank, P = world.Get_rank(), world.Get_size()
    state = SparseHookState(world, algorithm, warmup_steps=0, density=0.5)
    record = []
    for n in (40, 40, 60, 60):
        g = torch.from_numpy(
            np.random.default_rng([n, rank, len(record)]).standard_normal(n).astype(np.float32)
        )
        fut = sparse_allreduce_hook(state, FakeBucket(0, g.clone(), True))
        out = fut.wait()
        ar = state.allreducers[0]
        record.append(
            {
                "n": n,
                "ar_n": ar.n,
                "ar_id": id(ar),
                "created": state.created,
                "shape": list(out.shape),
                "dtype": str(out.dtype),
                "same_everywhere": _same_everywhere(world, out),
            }
        )
    # The warm-up path: dense mean over ranks, exactly.
    warm = SparseHookState(world, algorithm, warmup_steps=1, density=0.01)
    g = torch.full((10,), float(rank + 1))
    out = sparse_allreduce_hook(warm, FakeBucket(0, g, True)).wait()
    expected = (P + 1) / 2
    return {
        "calls": record,
        "warmup_mean_ok": bool(torch.all(out == expected)),
        "warmup_created": warm.created,
    }


def reducer_writes_back(world, algorithm):
    """SparseGradientReducer writes exactly out.to_dense() into the .grad of each parameter."""
    rank = world.Get_rank()
    torch.manual_seed(2)
    model = build_model(4)
    frozen = model[0].bias
    frozen.requires_grad_(False)
    red = SparseGradientReducer(model.parameters(), world, algorithm, density=0.05)
    rng = np.random.default_rng([7, rank])
    no_grad = model[2].bias  # a trainable parameter without a gradient this step
    for p in model.parameters():
        if p.requires_grad and p is not no_grad:
            p.grad = torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32))
    out = red.reduce()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    dense = out.to_dense()
    return {
        "exact": bool(np.array_equal(grads.numpy(), dense)),
        "n": red.n,
        "n_expected": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "nnz": out.nnz,
        "frozen_untouched": frozen.grad is None,
        "no_grad_filled": no_grad.grad is not None and no_grad.grad.shape == no_grad.shape,
        "same_everywhere": _same_everywhere(world, grads),
        "bytes_sent": red.stats["bytes_sent"],
        "state_has_residual": red.state_dict()["allreducer"]["residual"] is not None,
    }


def main(out_path, algorithm, world):
    torch.set_num_threads(1)
    init_process_group_from_mpi(world)
    import torch.distributed as dist

    results = {
        "world_size": dist.get_world_size(),
        "rank_matches_mpi": dist.get_rank() == world.Get_rank(),
        "algorithm": algorithm,
        "ddp_dense_equivalence": ddp_matches_allreduce(world, algorithm),
        "ddp_sparse_trains": ddp_sparse_trains(world, algorithm),
        "bucket_resize": bucket_resize(world, algorithm),
        "reducer": reducer_writes_back(world, algorithm),
    }
    oks = world.allgather(results["rank_matches_mpi"])
    results["rank_matches_mpi"] = all(oks)
    dist.destroy_process_group()
    if world.Get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    assert sys.argv[2] in spardl.ALGORITHMS, sys.argv[2]
    sys.exit(run_collective(main, sys.argv[1], sys.argv[2]))
