"""A parameter no rank used, beside used ones, under mpiexec (driven by tests/test_torch_unused.py).

Usage: mpiexec -n P python tests/scripts/torch_unused_checks.py OUT.json ALGORITHM...

A branch of the model is used at the first step only (a large gradient, most of it left in its
residual) and by no rank afterwards. For the plain-loop reducer and the DDP hook in both modes
(``find_unused_parameters=True``), rank 0 writes to OUT.json, per algorithm and kind, what the
used layer received, whether the branch's residual stayed as it was, and the largest value that
a result (the reducer's ``last_result``, the hook's returned bucket) held on the branch. Any
exception aborts the whole job (non-zero exit).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

import spardl
from spardl.torch import (
    SparseGradientReducer,
    SparseHookState,
    init_process_group_from_mpi,
    sparse_allreduce_hook,
)

KINDS = ("reducer", "hook", "overlap")
STEPS = 12
DENSITY = 0.05  # k = 10 of the 200 elements


class Branch(torch.nn.Module):
    """A layer used at every step beside a branch taken at step 0 only (50 times larger)."""

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(10, 10, bias=False)
        self.branch = torch.nn.Linear(10, 10, bias=False)

    def forward(self, x, take_branch):
        y = self.used(x)
        return y + 50 * self.branch(x) if take_branch else y


def _spy(model, leaked, phase):
    """The hook, recording the largest |value| its returned bucket holds on the branch."""

    def hook(state, bucket):
        fut = sparse_allreduce_hook(state, bucket)
        params = list(bucket.parameters())

        def look(f):
            buf, off = f.value(), 0
            for p in params:
                if p is model.branch.weight and phase["step"] >= 1:
                    leaked.append(float(buf[off : off + p.numel()].abs().max()))
                off += p.numel()
            return buf

        return fut.then(look)

    return hook


def unused_branch(world, algorithm, kind):
    """STEPS steps, the branch unused by every rank after the first; positive gradients, so
    that the used layer's reduced mass can be compared with its input mass."""
    rank, P = world.Get_rank(), world.Get_size()
    torch.manual_seed(0)
    model = Branch()
    names = [k for k, _ in model.named_parameters()]
    raw = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    applied = {k: torch.zeros_like(p) for k, p in model.named_parameters()}

    def capture(k):
        def hook(grad):  # this rank's gradient, before any reduction; left as it is
            raw[k].add_(grad)

        return hook

    for k, p in model.named_parameters():
        p.register_hook(capture(k))
    leaked, phase = [], {"step": 0}
    if kind == "reducer":
        net = model
        state = SparseGradientReducer(model.named_parameters(), world, algorithm, density=DENSITY)
        core = state._core
        i = core.keys.index("branch.weight")
        branch = slice(core.offsets[i], core.offsets[i + 1])
    else:
        net = DDP(model, find_unused_parameters=True)
        state = SparseHookState(
            world,
            algorithm,
            warmup_steps=0,
            density=DENSITY,
            model=model,
            overlap=kind == "overlap",
        )
        net.register_comm_hook(state, _spy(model, leaked, phase))
    g = torch.Generator().manual_seed(rank)
    moved, input_after_first, grads_none, same = 0.0, 0.0, [], []
    branch_before = None
    for step in range(STEPS):
        phase["step"] = step
        model.zero_grad(set_to_none=True)
        x, w = torch.rand(4, 10, generator=g), torch.rand(4, 10, generator=g)
        before = raw["used.weight"].sum().item()
        (net(x, take_branch=step == 0) * w).sum().backward()
        if kind == "reducer":
            state.reduce()
            if step >= 1:
                dense = np.asarray(state.last_result.to_dense())
                leaked.append(float(np.abs(dense[branch]).max()))
        if step == 0:
            branch_before = state.residuals()["branch.weight"].copy()
        else:
            grads_none.append(model.branch.weight.grad is None)
            moved += model.used.weight.grad.abs().sum().item()
            input_after_first += raw["used.weight"].sum().item() - before
            mine = model.used.weight.grad.numpy().ravel()
            same.append(bool(np.array_equal(world.bcast(mine, root=0), mine)))
        for k, p in model.named_parameters():
            if p.grad is not None:
                applied[k] += p.grad
    res = state.residuals()
    # Conservation over every parameter (op="mean"): Σ_r Σ_t g_r = P·Σ_t out_t + Σ_r E_r.
    residuals = world.allreduce(np.concatenate([res[k] for k in names]).astype(np.float64))
    out_sum = np.concatenate([applied[k].numpy().ravel() for k in names]).astype(np.float64)
    rhs = world.allreduce(
        np.concatenate([raw[k].numpy().ravel() for k in names]).astype(np.float64)
    )
    lhs = P * out_sum + residuals
    out = {
        "moved": moved,
        # The mean over ranks of the used layer's input mass after the first step.
        "input": world.allreduce(input_after_first) / P,
        "branch_residual_nonzero": bool(np.any(branch_before != 0)),
        "branch_residual_kept": all(
            world.allgather(bool(np.array_equal(branch_before, res["branch.weight"])))
        ),
        "leaked": max(world.allgather(max(leaked))),
        "results_seen": len(leaked),
        "branch_grad_none": all(world.allgather(all(grads_none))),
        "same_everywhere": all(world.allgather(all(same))),
        "conservation_error": float(np.abs(lhs - rhs).max()),
        "scale": float(np.abs(rhs).max()),
    }
    state.close()
    return out


def main(out_path, algorithms, world):
    torch.set_num_threads(1)
    init_process_group_from_mpi(world)
    import torch.distributed as dist

    results = {
        algorithm: {kind: unused_branch(world, algorithm, kind) for kind in KINDS}
        for algorithm in algorithms
    }
    dist.destroy_process_group()
    if world.Get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    names = sys.argv[2:]
    assert names and all(a in spardl.ALGORITHMS for a in names), names
    world = MPI.COMM_WORLD
    with spardl.abort_on_exception(world):
        main(sys.argv[1], names, world)
