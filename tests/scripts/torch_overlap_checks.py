"""Checks of the DDP hook's overlap mode under mpiexec (driven by tests/test_torch_overlap.py).

Usage: mpiexec -n 2 python tests/scripts/torch_overlap_checks.py OUT.json

Every rank runs every check (each is collective); rank 0 writes the measurements to OUT.json and
the outer test asserts on them. Any exception aborts the whole job (non-zero exit).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
from fake_bucket import FakeBucket
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_checks import _same_everywhere, build_model_like, rank_batches

from spardl import elastic
from spardl.cli import run_collective
from spardl.torch import SparseHookState, init_process_group_from_mpi, sparse_allreduce_hook
from spardl.train import build_model


def dense_equivalence(world):
    """Overlap mode at density 1 (dense warm-up, then sparse steps) vs DDP's own allreduce."""
    rank = world.Get_rank()
    torch.manual_seed(0)
    base = build_model(4)
    ref_model, hook_model = base, copy.deepcopy(base)
    ref = DDP(ref_model, bucket_cap_mb=0.01)
    hooked = DDP(hook_model, bucket_cap_mb=0.01)
    state = SparseHookState(world, "spardl", warmup_steps=2, density=1.0, overlap=True)
    hooked.register_comm_hook(state, sparse_allreduce_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, hooked)]
    for xb, yb in rank_batches(rank, 6, 16):
        for net, opt in zip((ref, hooked), opts, strict=True):
            opt.zero_grad()
            F.cross_entropy(net(xb), yb).backward()
            opt.step()
    diff = max(
        float((a - b).detach().abs().max())
        for a, b in zip(ref_model.parameters(), hook_model.parameters(), strict=True)
    )
    moved = max(
        float((a - b).detach().abs().max())
        for a, b in zip(ref_model.parameters(), build_model_like(0).parameters(), strict=True)
    )
    return {
        "max_abs_diff": diff,
        "param_scale": max(float(p.detach().abs().max()) for p in ref_model.parameters()),
        "moved_from_init": moved,
        "steps": state.step,
        "buckets": len(state._core.cores),
        "sparse_bytes_sent": state.stats["bytes_sent"],
        "same_everywhere": _same_everywhere(
            world, torch.cat([p.detach().flatten() for p in hook_model.parameters()])
        ),
    }


def sparse_trains(world):
    """Overlap mode at density 1%: the ranks stay in sync and the training loss goes down."""
    rank = world.Get_rank()
    torch.manual_seed(1)
    net = DDP(build_model(8), bucket_cap_mb=0.02)
    state = SparseHookState(world, "spardl", warmup_steps=2, density=0.01, overlap=True)
    net.register_comm_hook(state, sparse_allreduce_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for xb, yb in rank_batches(rank, 80, 16, seed=1):
        opt.zero_grad()
        loss = F.cross_entropy(net(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    mean_losses = world.allreduce(np.array(losses)) / world.Get_size()
    params = torch.cat([p.detach().flatten() for p in net.parameters()])
    # Elastic checkpoints of an overlap-mode state: gathered, saved and loaded on every rank.
    gathered = elastic.gather_state(state, root=None)
    folder = world.bcast(tempfile.mkdtemp() if rank == 0 else None, root=0)
    path = os.path.join(folder, "overlap.zip")
    elastic.save_checkpoint(state, path)
    fresh = SparseHookState(world, "spardl", warmup_steps=2, density=0.01, overlap=True)
    elastic.load_checkpoint(fresh, path)
    world.Barrier()
    if rank == 0:
        os.remove(path)
        os.rmdir(folder)
    return {
        "first_loss": float(mean_losses[:10].mean()),
        "last_loss": float(mean_losses[-10:].mean()),
        "steps": state.step,
        "buckets": len(state._core.cores),
        "n_params": int(params.numel()),
        "bytes_sent": state.stats["bytes_sent"],
        "same_everywhere": _same_everywhere(world, params),
        "residual_keys": sorted(state.residuals()),
        "gathered_n": gathered["n"],
        "gathered_ranks": len(gathered["states"]),
        "loaded_step": fresh.step,
    }


def _backward_outcome(world, fn):
    """Run fn on every rank: ('ok', '') or (exception type, message) per rank."""
    try:
        fn()
        mine = ("ok", "")
    except Exception as e:  # noqa: BLE001 - DDP re-raises the future's error as its own type
        mine = (type(e).__name__, str(e))
    return world.allgather(mine)


def errors(world):
    """An error inside the communication thread reaches backward() on every rank (DDP), and
    every future of that iteration holds zeros (fake buckets); the next iteration then runs
    normally."""
    rank = world.Get_rank()

    def sparse_embedding():  # found when the bucket is taken, raised after the control check
        torch.manual_seed(4)
        m = torch.nn.Sequential(torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 1))
        net = DDP(m, find_unused_parameters=True)
        st = SparseHookState(world, "spardl", warmup_steps=0, density=1.0, model=m, overlap=True)
        net.register_comm_hook(st, sparse_allreduce_hook)
        try:
            net(torch.tensor([1, 2]) if rank == 1 else torch.tensor([3])).sum().backward()
        finally:
            st.drain()

    def nonfinite():  # found by the allreducer itself
        torch.manual_seed(5)
        m = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 1))
        net = DDP(m)
        st = SparseHookState(
            world, "spardl", warmup_steps=0, density=0.5, nonfinite="raise", overlap=True
        )
        net.register_comm_hook(st, sparse_allreduce_hook)
        x = torch.ones(2, 6)
        if rank == 0:
            x[0, 0] = float("nan")
        try:
            net(x).sum().backward()
        finally:
            st.drain()

    # Fake buckets (outside a backward pass, so the hook raises at once): every future
    # completes with zeros (the whole iteration is undone, the buckets reduced before and after
    # the failing one too); the hook raises the error at the last bucket; the next iteration
    # runs normally.
    ps = [torch.nn.Parameter(torch.zeros(m)) for m in (8, 5, 3)]
    st = SparseHookState(
        world, "spardl", warmup_steps=0, density=0.5, nonfinite="raise", overlap=True
    )
    futures, raised = [], []
    for it in range(2):
        grads = [torch.full((p.numel(),), float(rank + 1)) for p in ps]
        if it == 0 and rank == 1:
            grads[0][3] = float("inf")
        futs = [st._bucket(FakeBucket(b, grads[b], [ps[b]], False)) for b in (0, 1)]
        try:
            futs.append(st._bucket(FakeBucket(2, grads[2], [ps[2]], True)))
            raised.append("ok")
        except Exception as e:  # noqa: BLE001 - the first failing bucket's error
            raised.append(type(e).__name__)
        for f in futs:
            futures.append("zeros" if bool((f.wait() == 0).all()) else "ok")
    return {
        "sparse_embedding": _backward_outcome(world, sparse_embedding),
        "nonfinite": _backward_outcome(world, nonfinite),
        "futures": world.allgather(futures),
        "hook_raised": world.allgather(raised),
        "steps_after": st.step,
    }


def main(out_path, world):
    torch.set_num_threads(1)
    init_process_group_from_mpi(world)
    import torch.distributed as dist

    results = {
        "dense_equivalence": dense_equivalence(world),
        "sparse_trains": sparse_trains(world),
        "errors": errors(world),
    }
    dist.destroy_process_group()
    if world.Get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(run_collective(main, sys.argv[1]))
