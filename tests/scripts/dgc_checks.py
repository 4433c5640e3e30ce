"""Checks of Deep Gradient Compression's techniques in spardl.torch (driven by
tests/test_torch_dgc.py): momentum correction, factor masking, local clipping, density warm-up.

Usage: mpiexec -n P python tests/scripts/dgc_checks.py OUT.json

Every rank runs every check (each is collective); rank 0 writes the measurements to OUT.json.
"""

from __future__ import annotations

import io
import json
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from spardl.cli import run_collective
from spardl.torch import (
    SparseGradientReducer,
    SparseHookState,
    init_process_group_from_mpi,
    sparse_allreduce_hook,
)

#: Every technique on (the checkpoint checks).
ALL_ON = {
    "momentum_correction": 0.9,
    "clip_norm": 0.5,
    "density_warmup": 3,
    "warmup_density": 0.5,
    "dense_numel": 4,  # the output layer's bias reduced dense
}


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _batches(rank, steps):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(steps)]


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)  # weights_only=True


def _train(world, model, batches, kind, algorithm, opts, momentum, state=None, opt_state=None):
    """The model trained over ``batches`` with the reducer or the DDP hook; returns
    (model, optimizer, reducer or hook state)."""
    if kind == "reducer":
        red = SparseGradientReducer(model.named_parameters(), world, algorithm, **opts)
        net = model
    else:
        red = SparseHookState(world, algorithm, model=model, **opts)
        net = DDP(model)
        net.register_comm_hook(red, sparse_allreduce_hook)
    if state is not None:
        red.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    for xb, yb in batches:
        opt.zero_grad()
        F.mse_loss(net(xb), yb).backward()
        if kind == "reducer":
            red.reduce()
        opt.step()
    return model, opt, red


def density_one(world, kind, algorithm):
    """Momentum correction at density 1 without masking against dense SGD with momentum (the
    mean gradient, reduced with MPI's allreduce)."""
    from mpi4py import MPI

    rank, P = world.Get_rank(), world.Get_size()
    batches = _batches(rank, 6)
    opts = {"density": 1.0, "momentum_correction": 0.9, "factor_masking": False}
    if kind == "hook":
        opts["warmup_steps"] = 2
    got, _, _ = _train(world, _mlp(), batches, kind, algorithm, opts, momentum=0.0)
    ref = _mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for xb, yb in batches:
        opt.zero_grad()
        F.mse_loss(ref(xb), yb).backward()
        for p in ref.parameters():
            g = p.grad.numpy()
            world.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
            g /= P
        opt.step()
    a, b = _flat(got), _flat(ref)
    return {
        "max_diff": float((a - b).abs().max()),
        "moved": float((b - _flat(_mlp())).abs().max()),
    }


def resume(world, kind, algorithm):
    """Every technique on: 3 steps, a checkpoint through torch.save/load, a fresh model and
    reducer (or DDP and hook), 4 more steps, against 7 in one go."""
    rank = world.Get_rank()
    batches = _batches(rank, 7)
    opts = {"density": 0.05, "warmup_steps": 1, **ALL_ON}
    full, _, full_red = _train(world, _mlp(), batches, kind, algorithm, opts, momentum=0.0)
    first, opt, red = _train(world, _mlp(), batches[:3], kind, algorithm, opts, momentum=0.0)
    ck = _roundtrip({"model": first.state_dict(), "opt": opt.state_dict(), "red": red.state_dict()})
    again = _mlp(seed=5)
    again.load_state_dict(ck["model"])
    resumed, _, red2 = _train(
        world, again, batches[3:], kind, algorithm, opts, 0.0, state=ck["red"], opt_state=ck["opt"]
    )
    vel = full_red.velocities()
    return {
        "bit_equal": _flat(resumed).numpy().tobytes() == _flat(full).numpy().tobytes(),
        "max_diff": float((_flat(resumed) - _flat(full)).abs().max()),
        "velocity_equal": all(np.array_equal(v, red2.velocities()[k]) for k, v in vel.items()),
        "velocity_keys": sorted(vel),
        "velocity_nonzero": bool(any(np.any(v) for v in vel.values())),
        "density": full_red.allreducer.density,
        "saved_density": float(ck["red"]["allreducer"]["density"]),
    }


def conservation(world, algorithm):
    """With momentum correction and masking: Σ_r (u_r + E_r,old) = P·out + Σ_r E_r,new each step
    (what was not sent stays in the residual), and u is zero exactly where this rank's value
    left its residual."""
    from mpi4py import MPI

    rank, P = world.Get_rank(), world.Get_size()
    model = _mlp()
    red = SparseGradientReducer(
        model.named_parameters(), world, algorithm, density=0.05, momentum_correction=0.9
    )
    worst, mask_ok, masked = 0.0, True, 0
    u_prev = None
    for xb, yb in _batches(rank, 4):
        model.zero_grad()
        F.mse_loss(model(xb), yb).backward()
        g = torch.cat([p.grad.flatten() for p in model.parameters()]).numpy().astype(np.float64)
        e_old = np.asarray(red.allreducer.residual, np.float64).copy()
        u = 0.9 * u_prev + g if u_prev is not None else g
        out = red.reduce().to_dense().astype(np.float64)
        e_new = np.asarray(red.allreducer.residual, np.float64)
        x = u + e_old
        sx, se = np.zeros_like(x), np.zeros_like(x)
        world.Allreduce(x, sx, op=MPI.SUM)
        world.Allreduce(e_new, se, op=MPI.SUM)
        worst = max(worst, float(np.max(np.abs(sx - P * out - se)) / np.max(np.abs(sx))))
        vel = np.concatenate(list(red.velocities().values())).astype(np.float64)
        sent = (e_new == 0) & (x != 0)
        mask_ok &= bool(np.all(vel[sent] == 0) and np.allclose(vel[~sent], u[~sent], rtol=1e-5))
        masked += int(sent.sum())
        u_prev = vel
    return {"conservation_error": worst, "mask_ok": mask_ok, "masked": masked}


def dense_small(world, algorithm):
    """``dense_numel=32`` (both biases reduced dense) with momentum correction over P ranks:
    each bias receives the mean of the ranks' velocities u (float32, to rounding), its
    velocity is not masked and its residual stays zero; the weights conserve as sparse ones:
    Σ_r (u_r + E_r,old) = P·out + Σ_r E_r,new there."""
    from mpi4py import MPI

    rank, P = world.Get_rank(), world.Get_size()
    model = _mlp()
    red = SparseGradientReducer(
        model.named_parameters(),
        world,
        algorithm,
        density=0.05,
        momentum_correction=0.9,
        dense_numel=32,
    )
    names = [k for k, _ in model.named_parameters()]
    sizes = [p.numel() for p in model.parameters()]
    offs = np.cumsum([0, *sizes])
    small = np.zeros(offs[-1], bool)
    for i, k in enumerate(names):
        small[offs[i] : offs[i + 1]] = k.endswith("bias")
    worst_mean, worst_cons, kept = 0.0, 0.0, True
    u_prev = np.zeros(offs[-1])
    for xb, yb in _batches(rank, 4):
        model.zero_grad()
        F.mse_loss(model(xb), yb).backward()
        g = torch.cat([p.grad.flatten() for p in model.parameters()]).numpy().astype(np.float64)
        e_old = np.asarray(red.allreducer.residual, np.float64).copy()
        u = 0.9 * u_prev + g
        out = red.reduce().to_dense().astype(np.float64)
        e_new = np.asarray(red.allreducer.residual, np.float64)
        mean = np.zeros_like(u)
        world.Allreduce(u, mean, op=MPI.SUM)
        mean /= P
        worst_mean = max(worst_mean, float(np.max(np.abs(out - mean)[small])))
        x = (u + e_old)[~small]
        sx, se = np.zeros_like(x), np.zeros_like(x)
        world.Allreduce(x, sx, op=MPI.SUM)
        world.Allreduce(np.ascontiguousarray(e_new[~small]), se, op=MPI.SUM)
        err = np.max(np.abs(sx - P * out[~small] - se)) / np.max(np.abs(sx))
        worst_cons = max(worst_cons, float(err))
        vel = np.concatenate([red.velocities()[k] for k in names]).astype(np.float64)
        kept &= bool(np.allclose(vel[small], u[small], rtol=1e-5) and not e_new[small].any())
        u_prev = vel
    # op="sum": the small parameters are summed like the rest, not averaged.
    summed = SparseGradientReducer(
        model.named_parameters(), world, algorithm, density=0.05, dense_numel=32, op="sum"
    )
    model.zero_grad()
    xb, yb = _batches(rank, 1)[0]
    F.mse_loss(model(xb), yb).backward()
    g = torch.cat([p.grad.flatten() for p in model.parameters()]).numpy().astype(np.float64)
    total = np.zeros_like(g)
    world.Allreduce(g, total, op=MPI.SUM)
    out = summed.reduce().to_dense().astype(np.float64)
    sum_error = float(np.max(np.abs(out - total)[small]) / np.max(np.abs(total[small])))
    return {
        "mean_error": worst_mean,
        "conservation_error": worst_cons,
        "velocity_kept": kept,
        "sum_error": sum_error,
    }


def main(out_path, world):
    torch.set_num_threads(1)
    init_process_group_from_mpi(world)
    import torch.distributed as dist

    results = {"world_size": world.Get_size()}
    for kind in ("reducer", "hook"):
        results[f"density_one_{kind}"] = density_one(world, kind, "spardl")
        results[f"resume_{kind}"] = {a: resume(world, kind, a) for a in ("spardl", "oktopk")}
    results["conservation"] = {a: conservation(world, a) for a in ("spardl", "oktopk", "topka")}
    results["dense_small"] = {a: dense_small(world, a) for a in ("spardl", "oktopk")}
    dist.destroy_process_group()
    if world.Get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(run_collective(main, sys.argv[1]))
