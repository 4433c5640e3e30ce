"""The DDP hook's overlap mode keeps an iteration a transaction (driven by
tests/test_torch_overlap.py; docs/reliability.md, "A step is a transaction").

Usage: mpiexec -n 2 python tests/scripts/torch_overlap_transaction.py OUT.json

For every case and every ``nonfinite`` mode ("skip", "raise"), two runs of the same model and
batches under DDP with several buckets: run A, in which rank 1's gradient of a parameter in a
middle bucket holds a NaN at iteration t, and its twin B, in which iteration t never happens.
For A, what the iteration left (the gradients, every bucket allreducer's ``state_dict()`` and
the hook state's, compared with those before it) and, for A and B, the parameters and the
states after three more iterations. Rank 0 writes everything to OUT.json, the outer test
asserts on it. Any exception aborts the whole job (non-zero exit).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import spardl
from spardl.cli import run_collective
from spardl.torch import SparseHookState, init_process_group_from_mpi, sparse_allreduce_hook

#: 209 bytes: four buckets of the model below (c and side.bias | side.weight | b | a).
BUCKET_CAP_MB = 0.0002
#: The parameter whose gradient holds the NaN (rank 1, iteration t): bucket 2 of 4.
POISONED = "b.weight"


@dataclass(frozen=True)
class Case:
    fail_at: int  # t
    find_unused: bool  # DDP's find_unused_parameters: buckets fixed from the first iteration
    warmup_steps: int = 1
    algorithm: str = "spardl"
    unused_at: tuple = ()  # iterations where the side branch takes no part (find_unused)
    options: dict = field(default_factory=dict)


CASES = {
    # The first iteration: the buckets and their allreducers are created inside it.
    "first": Case(0, True, warmup_steps=0),
    # An unused parameter's residual is set aside in a bucket applied before the failing one.
    "unused": Case(3, True, unused_at=(3, 5)),
    "unused_oktopk": Case(3, True, algorithm="oktopk", unused_at=(3, 5)),
    # Without find_unused_parameters DDP's first iteration has one bucket; its rebuilt buckets
    # arrive at iteration 1: the bucket allreducers are rebuilt inside the failing iteration.
    "rebuild": Case(1, False, warmup_steps=0),
    # Density warm-up (ρ moves at every step) and small parameters reduced dense.
    "later": Case(
        3, False, options={"density_warmup": 5, "warmup_density": 0.9, "dense_numel": 12}
    ),
}
MODES = ("skip", "raise")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 12)
        self.b = torch.nn.Linear(12, 12)
        self.side = torch.nn.Linear(12, 12)
        self.c = torch.nn.Linear(12, 4)

    def forward(self, x, use_side: bool):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        if use_side:
            h = h + self.side(h)
        return self.c(h)


def _digest(obj):
    """``obj`` (a state dict) as comparable plain data: arrays by dtype, shape and a hash of
    their bytes, floats by their bits."""
    if isinstance(obj, dict):
        return {str(k): _digest(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_digest(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu().numpy()
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        return ["array", str(arr.dtype), list(arr.shape), hashlib.sha256(arr.tobytes()).hexdigest()]
    if isinstance(obj, (float, np.floating)):
        return ["float", float(obj).hex()]
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def _diff(a, b, path="") -> list:
    """The paths where the digests ``a`` and ``b`` differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}/{k}")
            else:
                out += _diff(a[k], b[k], f"{path}/{k}")
        return out
    return [] if a == b else [path or "/"]


def _state(state) -> dict:
    """Every bucket allreducer's state (sparse, and the warm-up's dense one), and the hook
    state's ``state_dict()`` without ``stats`` (messages of a failed iteration were sent)."""
    core = state._core
    buckets = {
        str(i): {
            "sparse": None if c.sparse is None else _digest(c.sparse.state_dict()),
            "dense": None if c.dense is None else _digest(c.dense.state_dict()),
            "keys": list(c.keys),
        }
        for i, c in core.cores.items()
    }
    hook = {k: v for k, v in state.state_dict().items() if k != "stats"}
    return {
        "buckets": buckets,
        "hook": _digest(hook),
        "step": state.step,
        "created": state.created,
    }


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def run(world, case: Case, mode: str, fail_at):
    """Run A (``fail_at`` = t) or its twin B (``fail_at`` None: iteration t is left out)."""
    rank = world.Get_rank()
    torch.manual_seed(0)
    model = Net()
    names = {id(p): k for k, p in model.named_parameters()}
    net = DDP(model, bucket_cap_mb=BUCKET_CAP_MB, find_unused_parameters=case.find_unused)
    state = SparseHookState(
        world,
        case.algorithm,
        case.warmup_steps,
        model=model,
        overlap=True,
        density=0.3,
        nonfinite=mode,
        **case.options,
    )
    layouts, seen = [], []

    def hook(st, bucket):
        seen.append([bucket.index(), [names[id(p)] for p in bucket.parameters()]])
        return sparse_allreduce_hook(st, bucket)

    net.register_comm_hook(state, hook)
    poison = {"on": False}

    def poisoned(grad):
        if poison["on"] and rank == 1:
            grad = grad.clone()
            grad.view(-1)[0] = float("nan")
        return grad

    dict(model.named_parameters())[POISONED].register_hook(poisoned)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}
    t = case.fail_at
    for it in range(t + 4):
        if it == t and fail_at is None:
            continue
        g = torch.Generator().manual_seed(1000 * it + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        opt.zero_grad(set_to_none=True)
        seen.clear()
        if it == fail_at:
            before = _state(state)
            res = state.residuals()
            out["side_residual_before"] = bool(np.any(res.get("side.weight", 0)))
            out["residual_before"] = any(bool(np.any(v)) for v in res.values())
            out["params_at_t"] = _params(model).clone()
        poison["on"] = it == fail_at
        outcome = "ok"
        try:
            F.mse_loss(net(x, it not in case.unused_at), y).backward()
        except spardl.NonFiniteError:
            outcome = "NonFiniteError"
        poison["on"] = False
        layouts.append(list(seen))
        if it == fail_at:
            after = _state(state)
            grads = [p.grad for p in model.parameters()]
            out["outcome"] = world.allgather(outcome)
            out["grads_present"] = world.allgather(sum(g is not None for g in grads))
            out["grads_zero"] = world.allgather(
                all(g is None or bool((g == 0).all()) for g in grads)
            )
            out["state_changed"] = world.allgather(_diff(before, after))
            out["steps_before_after"] = [before["step"], after["step"]]
            out["skipped_steps"] = state.stats.get("skipped_steps", 0)
            if outcome != "ok":
                continue  # the loop catches the error and skips optimizer.step()
        opt.step()
    params = _params(model)
    out["layouts"] = layouts
    out["final"] = _state(state)
    out["params"] = params
    out["same_everywhere"] = all(
        o == params.numpy().tobytes() for o in world.allgather(params.numpy().tobytes())
    )
    state.close()
    return out


def main(out_path, world):
    torch.set_num_threads(1)
    init_process_group_from_mpi(world)
    import torch.distributed as dist

    results = {}
    for name, case in CASES.items():
        for mode in MODES:
            a = run(world, case, mode, case.fail_at)
            b = run(world, case, mode, None)
            t = case.fail_at
            moved = float((a["params"] - a.pop("params_at_t")).abs().max())
            results[f"{name}-{mode}"] = {
                "fail_at": t,
                "outcome": a["outcome"],
                "grads_present": a["grads_present"],
                "grads_zero": a["grads_zero"],
                "state_changed": a["state_changed"],
                "steps_before_after": a["steps_before_after"],
                "skipped_steps": a["skipped_steps"],
                "residual_before": a["residual_before"],
                "side_residual_before": a["side_residual_before"],
                "unused_at_t": t in case.unused_at,
                "failing_layout": a["layouts"][t],
                "first_layout": a["layouts"][0],
                "moved_after_t": moved,
                "params_equal_twin": world.allgather(
                    a["params"].numpy().tobytes() == b["params"].numpy().tobytes()
                ),
                "final_differs_from_twin": world.allgather(_diff(a["final"], b["final"])),
                "same_everywhere": a["same_everywhere"] and b["same_everywhere"],
            }
    dist.destroy_process_group()
    if world.Get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(run_collective(main, sys.argv[1]))
