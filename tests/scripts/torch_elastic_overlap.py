"""An overlap-mode hook checkpoint resumed at another world size (driven by
tests/test_torch_overlap.py; docs/reliability.md §4.1).

Usage:
    mpiexec -n P python tests/scripts/torch_elastic_overlap.py save CHECKPOINT
    mpiexec -n P' python tests/scripts/torch_elastic_overlap.py load CHECKPOINT OUT.json

``save``: three iterations of DDP with the hook in overlap mode (several buckets), then
``spardl.elastic.save_checkpoint``; rank 0 also writes CHECKPOINT.json, the world's sum of the
residuals by parameter. ``load``: the checkpoint loaded into a fresh hook state in overlap mode
and in the default mode; rank 0 writes, for each, the loaded residuals' world sum by parameter,
the step, and the conservation of the one iteration run after it. Any exception aborts the
whole job (non-zero exit).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

import spardl
from spardl import elastic
from spardl.torch import (
    SparseHookState,
    from_torch_state,
    init_process_group_from_mpi,
    sparse_allreduce_hook,
)

ALGORITHM = "spardl"
OPTIONS = {"warmup_steps": 0, "density": 0.05}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.ReLU(), torch.nn.Linear(300, 4))


def _hooked(world, overlap):
    model = _model()
    net = DDP(model, bucket_cap_mb=0.01)  # several buckets
    state = SparseHookState(world, ALGORITHM, model=model, overlap=overlap, **OPTIONS)
    net.register_comm_hook(state, sparse_allreduce_hook)
    return model, net, state


def _iteration(world, net, step):
    g = torch.Generator().manual_seed(1000 * step + world.Get_rank())
    net.module.zero_grad(set_to_none=True)
    net(torch.randn(5, 8, generator=g)).sum().backward()


def _residual_sums(world, state) -> dict:
    """Σ over the world's ranks of each parameter's residual (float64), from ``state_dict()``
    (a loaded state not applied yet included)."""
    saved = from_torch_state(state.state_dict())
    ar = saved["allreducer"]
    mine = {}
    if ar is not None and ar["residual"] is not None:
        res, off = np.asarray(ar["residual"], np.float64), 0
        for k, m in zip(saved["keys"], saved["numels"], strict=True):
            mine[k] = res[off : off + m]
            off += m
    keys = sorted(set().union(*world.allgather(sorted(mine))))
    sizes = _merged(world, dict(zip(saved["keys"] or [], saved["numels"] or [], strict=True)))
    return {k: world.allreduce(mine.get(k, np.zeros(sizes[k]))) for k in keys}


def _merged(world, sizes: dict) -> dict:
    out = {}
    for d in world.allgather(sizes):
        out.update(d)
    return out


def save(path, world):
    model, net, state = _hooked(world, overlap=True)
    for step in range(3):
        _iteration(world, net, step)
    elastic.save_checkpoint(state, path)
    sums = _residual_sums(world, state)
    if world.Get_rank() == 0:
        with open(f"{path}.json", "w") as f:
            json.dump({"sums": {k: v.tolist() for k, v in sums.items()}, "step": state.step}, f)
    state.close()


def _loaded(world, path, overlap) -> dict:
    """The checkpoint loaded into a fresh hook state (``overlap`` or the default mode), then
    one iteration: Σ_r E_r after + P·out = Σ_r E_r before + Σ_r g_r, by parameter."""
    model, net, state = _hooked(world, overlap)
    elastic.load_checkpoint(state, path)
    step = state.step
    before = _residual_sums(world, state)
    raw = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    for k, p in model.named_parameters():
        p.register_hook(lambda grad, k=k: raw[k].add_(grad))
    _iteration(world, net, 3)
    after = _residual_sums(world, state)
    P = world.Get_size()
    error, scale, same = 0.0, 0.0, True
    for k, p in model.named_parameters():
        out = p.grad.numpy().ravel().astype(np.float64)
        got = after[k] + P * out
        want = before.get(k, 0.0) + world.allreduce(raw[k].numpy().ravel().astype(np.float64))
        error = max(error, float(np.abs(got - want).max()))
        scale = max(scale, float(np.abs(want).max()))
        same = same and all(world.allgather(bool(np.array_equal(world.bcast(out), out))))
    result = {
        "step": step,
        "steps_after": state.step,
        "sums": {k: v.tolist() for k, v in before.items()},
        "conservation_error": error,
        "scale": scale,
        "same_everywhere": same,
        "moved": float(sum(p.grad.abs().sum() for p in model.parameters())),
    }
    state.close()
    return result


def load(path, out_path, world):
    results = {mode: _loaded(world, path, mode == "overlap") for mode in ("overlap", "default")}
    if world.Get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


def main(args, world):
    torch.set_num_threads(1)
    init_process_group_from_mpi(world)
    import torch.distributed as dist

    if args[0] == "save":
        save(args[1], world)
    else:
        load(args[1], args[2], world)
    dist.destroy_process_group()


if __name__ == "__main__":
    assert sys.argv[1:2] in (["save"], ["load"]), sys.argv
    world = MPI.COMM_WORLD
    with spardl.abort_on_exception(world):
        main(sys.argv[1:], world)
