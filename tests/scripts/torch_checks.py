"""Checks of spardl.torch under mpiexec (driven by tests/test_torch.py).

Usage: mpiexec -n P python tests/scripts/torch_checks.py OUT.json ALGORITHM

Every rank runs every check (each is collective); rank 0 writes the measurements to OUT.json and
the outer test asserts on them. Any exception aborts the whole job (non-zero exit).
"""

from __future__ import annotations

import copy
import functools
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

try:  # run as a script: its own directory, tests/scripts, is on sys.path
    from fake_bucket import FakeBucket
except ImportError:  # loaded by a test in its process: tests/ is on sys.path
    from scripts.fake_bucket import FakeBucket


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
    scale = max(float(p.detach().abs().max()) for p in ref_model.parameters())
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
        "created": state.created,
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


def _fake_step(state, grads, groups):
    """One iteration of the hook over fake buckets ``groups`` (lists of parameter positions);
    returns every parameter's reduced gradient, by position."""
    futs = []
    for b, group in enumerate(groups):
        buf = torch.cat([grads[i][1].flatten() for i in group])
        params = [grads[i][0] for i in group]
        futs.append((group, state._bucket(FakeBucket(b, buf, params, b == len(groups) - 1))))
    out = {}
    for group, fut in futs:
        flat, off = fut.wait(), 0
        for i in group:
            out[i] = flat[off : off + grads[i][1].numel()].clone()
            off += grads[i][1].numel()
    return out


def bucket_layouts(world, algorithm):
    """The hook reduces by parameter: one bucket or several, in any order (DDP's rebuild, another
    bucket_cap_mb), the results are bit-identical; the dense warm-up is the exact mean."""
    rank, P = world.Get_rank(), world.Get_size()
    torch.manual_seed(5)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (30, 7, 50)]
    model = torch.nn.ParameterList(params)
    layouts = {"one": [[0, 1, 2]], "rebuilt": [[2], [1, 0]], "split": [[0], [1], [2]]}
    runs = {}
    for label, groups in layouts.items():
        state = SparseHookState(world, algorithm, warmup_steps=0, density=0.3, model=model)
        outs = []
        for step in range(3):
            rng = np.random.default_rng([step, rank])
            grads = [
                (p, torch.from_numpy(rng.standard_normal(p.numel()).astype(np.float32)))
                for p in params
            ]
            # The first iteration in DDP's initial order, then the label's layout.
            outs.append(_fake_step(state, grads, layouts["one"] if step == 0 else groups))
        runs[label] = {
            "bits": b"".join(o[i].numpy().tobytes() for o in outs for i in range(3)),
            "created": state.created,
            "steps": state.step,
            "same_everywhere": _same_everywhere(world, torch.cat([outs[-1][i] for i in range(3)])),
        }
    warm = SparseHookState(world, algorithm, warmup_steps=1, density=0.01)
    p = torch.nn.Parameter(torch.zeros(10))
    out = _fake_step(warm, [(p, torch.full((10,), float(rank + 1)))], [[0]])[0]
    return {
        "equal": all(r["bits"] == runs["one"]["bits"] for r in runs.values()),
        "created": [r["created"] for r in runs.values()],
        "steps": [r["steps"] for r in runs.values()],
        "same_everywhere": all(r["same_everywhere"] for r in runs.values()),
        "warmup_mean_ok": bool(torch.all(out == (P + 1) / 2)),
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
    no_grad = model[2].bias  # without a gradient this step on rank 0 only: reduced
    for p in model.parameters():
        if p.requires_grad and (p is not no_grad or rank != 0):
            p.grad = torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32))
    # An expanded gradient (stride 0: one row for all) and a transposed one (strided, written
    # in place): the first cannot hold the result and is replaced, the second keeps its tensor.
    expanded, transposed = model[8].weight, model[6].weight
    expanded.grad = torch.full((1, expanded.shape[1]), float(rank + 1)).expand(expanded.shape)
    transposed.grad = transposed.grad.t().contiguous().t()
    kept = transposed.grad
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
        "expanded_replaced": expanded.grad.stride() != (0, 1),
        "strided_kept": transposed.grad is kept,
    }


# -- parameter-keyed state, unused / frozen / sparse parameters, dtypes, launch and options ----
SPARSE_ALGORITHMS = [a for a in spardl.ALGORITHMS if a != "dense"]


def _small_mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(
        dtype
    )


def _mlp_batches(rank, steps, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(8, 16, generator=g).to(dtype), torch.randn(8, 4, generator=g).to(dtype))
        for _ in range(steps)
    ]


def _train_ddp(
    world,
    algorithm,
    model,
    batches,
    *,
    state=None,
    opt_state=None,
    cap=25.0,
    keyed=True,
    density=0.05,
):
    """DDP + hook over ``batches``; returns (model, optimizer, hook state)."""
    net = DDP(model, bucket_cap_mb=cap)
    hook = SparseHookState(
        world, algorithm, warmup_steps=2, density=density, model=model if keyed else None
    )
    if state is not None:
        hook.load_state_dict(state)
    net.register_comm_hook(hook, sparse_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    for xb, yb in batches:
        opt.zero_grad()
        F.mse_loss(net(xb).float(), yb.float()).backward()
        opt.step()
    return model, opt, hook


def _train_reducer(world, algorithm, model, batches, density=0.05):
    red = SparseGradientReducer(
        model.named_parameters(), world, algorithm, warmup_steps=2, density=density
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for xb, yb in batches:
        opt.zero_grad()
        F.mse_loss(model(xb).float(), yb.float()).backward()
        red.reduce()
        opt.step()
    return model, red


def _roundtrip(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)  # weights_only=True


def _bits(model):
    return torch.cat([p.detach().float().flatten() for p in model.parameters()]).numpy().tobytes()


def _max_diff(a, b):
    return max(
        float((p - q).detach().abs().max())
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def hook_resume(world, algorithm):
    """Edge case 1: 3 steps, checkpoint, a fresh DDP + hook, 3 more steps vs 6 in one go; also
    with positional keys (no model=), with another bucket_cap_mb on resume, and hook vs reducer."""
    rank = world.Get_rank()
    batches = _mlp_batches(rank, 6)
    full, _, full_hook = _train_ddp(world, algorithm, _small_mlp(), batches)
    out = {"n": sum(p.numel() for p in full.parameters()), "created": full_hook.created}
    for label, keyed, cap in (
        ("named", True, 25.0),
        ("positional", False, 25.0),
        ("other_cap", True, 0.0005),
    ):
        first, opt, hook = _train_ddp(world, algorithm, _small_mlp(), batches[:3], keyed=keyed)
        ck = _roundtrip(
            {"model": first.state_dict(), "opt": opt.state_dict(), "hook": hook.state_dict()}
        )
        again = _small_mlp(seed=9)  # other initial values: all of them come from the checkpoint
        again.load_state_dict(ck["model"])
        resumed, _, _ = _train_ddp(
            world,
            algorithm,
            again,
            batches[3:],
            state=ck["hook"],
            opt_state=ck["opt"],
            cap=cap,
            keyed=keyed,
        )
        out[label] = {
            "bit_equal": _bits(resumed) == _bits(full),
            "max_diff": _max_diff(resumed, full),
        }
    ref, red = _train_reducer(world, algorithm, _small_mlp(), batches)
    out["hook_equals_reducer"] = _bits(ref) == _bits(full)
    out["moved"] = _max_diff(full, _small_mlp())
    res = full_hook.residuals()
    out["residual_keys"] = sorted(res)
    out["residual_nonzero"] = bool(any(np.any(v != 0) for v in res.values()))
    out["same_everywhere"] = _same_everywhere(
        world, torch.cat([p.detach().flatten() for p in full.parameters()])
    )
    return out


class _Heads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.body = torch.nn.Linear(6, 8)
        self.head1 = torch.nn.Linear(8, 3)
        self.head2 = torch.nn.Linear(8, 3)

    def forward(self, x, use):
        h = torch.relu(self.body(x))
        return sum(getattr(self, name)(h).sum() for name in use)


# Which heads each rank uses at each step: both, both, head1 only everywhere (head2 unused on
# every rank), head2 on rank 1 only (used by some ranks: reduced).
_USE = [("head1", "head2")] * 2 + [("head1",)] + [None]


def _use(step, rank):
    u = _USE[step]
    return u if u is not None else (("head1", "head2") if rank == 1 else ("head1",))


def unused_parameters(world, algorithm, kind):
    """Edge case 2 (and 4 for the reducer): residual mass of parameters no rank used stays,
    .grad of those stays None, conservation over every parameter."""
    rank = world.Get_rank()
    model = _Heads()
    names = [k for k, _ in model.named_parameters()]
    raw = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    applied = {k: torch.zeros_like(p) for k, p in model.named_parameters()}

    def capture(k):
        def hook(grad):  # returns None: the gradient itself is left as it is
            raw[k].add_(grad)

        return hook

    for k, p in model.named_parameters():
        p.register_hook(capture(k))
    if kind == "hook":
        net = DDP(model, find_unused_parameters=True)
        state = SparseHookState(world, algorithm, warmup_steps=0, density=0.1, model=model)
        net.register_comm_hook(state, sparse_allreduce_hook)
    else:
        net = model
        state = SparseGradientReducer(model.named_parameters(), world, algorithm, density=0.1)
    g = torch.Generator().manual_seed(rank)
    head2_before = head2_after = None
    grads_none, shared = [], []
    for step in range(len(_USE)):
        model.zero_grad(set_to_none=True)
        net(torch.randn(4, 6, generator=g), _use(step, rank)).backward()
        if kind == "reducer":
            state.reduce()
        if step == 1:
            head2_before = state.residuals()["head2.weight"].copy()
        if step == 2:
            head2_after = state.residuals()["head2.weight"].copy()
            grads_none.append(model.head2.weight.grad is None and model.head2.bias.grad is None)
        if step == 3:
            shared.append(model.head2.weight.grad is not None)
            if shared[-1]:
                shared.append(_same_everywhere(world, model.head2.weight.grad))
        for k, p in model.named_parameters():
            if p.grad is not None:
                applied[k] += p.grad
    res = state.residuals()
    lhs = np.concatenate([res[k] + applied[k].numpy().ravel() for k in names]).astype(np.float64)
    rhs = np.concatenate([raw[k].numpy().ravel() for k in names]).astype(np.float64)
    lhs, rhs = world.allreduce(lhs), world.allreduce(rhs)
    return {
        "head2_residual_kept": bool(np.array_equal(head2_before, head2_after)),
        "head2_residual_nonzero": bool(np.any(head2_before != 0)),
        "unused_grad_none": all(grads_none),
        "some_ranks_reduced": all(shared),
        "conservation_error": float(np.abs(lhs - rhs).max()),
        "scale": float(np.abs(rhs).max()),
    }


def _outcome(world, fn):
    """Run fn on every rank: ('ok', None) or (exception type, message) per rank."""
    try:
        fn()
        mine = ("ok", "")
    except (TypeError, ValueError) as e:
        mine = (type(e).__name__, str(e))
    return world.allgather(mine)


def sparse_gradients(world, algorithm):
    """Edge case 3: an Embedding(sparse=True) used by rank 1 only: a TypeError naming the
    parameter on every rank (reducer and hook), no hang."""
    rank = world.Get_rank()

    def model():
        torch.manual_seed(4)
        return torch.nn.Sequential(torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 1))

    def reducer_step():
        m = model()
        red = SparseGradientReducer(m.named_parameters(), world, algorithm, density=1.0)
        if rank == 1:
            m(torch.tensor([1, 2])).sum().backward()
        else:
            m[1](torch.ones(2, 3)).sum().backward()  # the embedding unused here
        red.reduce()

    def hook_step():
        m = model()
        net = DDP(m, find_unused_parameters=True)
        st = SparseHookState(world, algorithm, warmup_steps=0, density=1.0, model=m)
        net.register_comm_hook(st, sparse_allreduce_hook)
        idx = torch.tensor([1, 2]) if rank == 1 else torch.tensor([3])
        net(idx).sum().backward()

    return {"reducer": _outcome(world, reducer_step), "hook": _outcome(world, hook_step)}


def changed_layout(world):
    """A parameter resized or cast after the reducer was built (on one rank, or on every
    rank): a ValueError / TypeError naming it on every rank, before the allreduce."""
    rank = world.Get_rank()

    def step(change, on):
        torch.manual_seed(5)
        m = torch.nn.Linear(4, 2)
        red = SparseGradientReducer(m.named_parameters(), world, "spardl", density=0.5)
        m(torch.ones(3, 4)).sum().backward()
        red.reduce()
        if rank in on:
            if change == "resize":
                m.weight.data = torch.randn(3, 4)
            else:
                m.double()
        for p in m.parameters():  # a backward of its own (the resized model has none)
            p.grad = torch.ones_like(p)
        red.reduce()

    return {
        f"{change}_{where}": _outcome(world, lambda c=change, o=on: step(c, o))
        for change in ("resize", "cast")
        for where, on in (("one", (world.Get_size() - 1,)), ("all", range(world.Get_size())))
    }


class _MixedDtypes(torch.nn.Module):
    """A float32 layer, then a float64 one: DDP makes a bucket per dtype."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4).double()

    def forward(self, x):
        return self.b(self.a(x).double()).sum()


def static_graph_mixed(world):
    """DDP(static_graph=True) over two dtypes numbers both buckets of its (delayed) first
    iteration 0 and never says is_last(): with model= the hook ends the iteration when every
    parameter has come, and at density 1 trains as DDP's own allreduce does; without it, a
    ValueError on every rank instead of a hang."""
    rank = world.Get_rank()
    xs = [
        torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * s + rank)) for s in range(3)
    ]

    def train(hooked, with_model):
        net = _MixedDtypes()
        ddp = DDP(net, static_graph=True)
        if hooked:
            model = net if with_model else None
            st = SparseHookState(world, "spardl", warmup_steps=1, density=1.0, model=model)
            ddp.register_comm_hook(st, sparse_allreduce_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for x in xs:
            opt.zero_grad()
            ddp(x).backward()
            opt.step()
        return torch.cat([p.detach().double().flatten() for p in net.parameters()])

    ref, got = train(False, False), train(True, True)
    return {
        "max_abs_diff": float((ref - got).abs().max()),
        "moved": float(
            (ref - torch.cat([p.detach().double().flatten() for p in _MixedDtypes().parameters()]))
            .abs()
            .max()
        ),
        "without_model": _outcome(world, lambda: train(True, False)),
    }


def foreign_model(world):
    """Edge case 8: ``model=`` a module DDP does not wrap: a ValueError on every rank, in both
    hook modes, instead of checkpoints silently keyed by position."""

    def hook_step(overlap):
        torch.manual_seed(5)
        m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
        net = DDP(m)
        other = torch.nn.Linear(3, 3)
        st = SparseHookState(
            world, "spardl", warmup_steps=0, density=1.0, model=other, overlap=overlap
        )
        net.register_comm_hook(st, sparse_allreduce_hook)
        try:
            net(torch.ones(2, 3)).sum().backward()
        finally:
            st.close()

    return {
        mode: _outcome(world, functools.partial(hook_step, mode == "overlap"))
        for mode in ("default", "overlap")
    }


def shared_state(world):
    """One SparseHookState without model= registered on a second DDP model after the first
    one's iterations: the second model's parameters are refused on every rank at each of its
    iterations, in both hook modes (the first model then trains on)."""

    def run(overlap):
        torch.manual_seed(7)
        nets = [DDP(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)))]
        nets.append(DDP(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))))
        st = SparseHookState(world, "spardl", warmup_steps=0, density=0.5, overlap=overlap)
        outcomes = []
        try:
            for net in nets:
                net.register_comm_hook(st, sparse_allreduce_hook)
            for net in (nets[0], nets[0], nets[1], nets[1], nets[0]):
                outcomes.append(_outcome(world, lambda n=net: n(torch.ones(2, 3)).sum().backward()))
        finally:
            st.close()
        return outcomes

    return {mode: run(mode == "overlap") for mode in ("default", "overlap")}


def frozen_and_unused(world, algorithm):
    """Edge case 4 (reducer): a parameter without a gradient on every rank and one frozen after
    the reducer was built keep .grad None and do not move under SGD(weight_decay)."""
    model = _Heads()
    red = SparseGradientReducer(model.parameters(), world, algorithm, density=0.5)
    model.head2.bias.requires_grad_(False)  # frozen after the reducer was built
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(2, 6), ("head1",)).backward()  # head2 used by no rank
        red.reduce()
        opt.step()
    after = dict(model.named_parameters())
    return {
        "head2_weight_grad_none": model.head2.weight.grad is None,
        "frozen_grad_none": model.head2.bias.grad is None,
        "head2_unmoved": bool(torch.equal(after["head2.weight"], before["head2.weight"])),
        "frozen_unmoved": bool(torch.equal(after["head2.bias"], before["head2.bias"])),
        "head1_moved": not torch.equal(after["head1.weight"], before["head1.weight"]),
    }


def low_precision(world, algorithm):
    """Edge case 5: bfloat16 and float16 models through the hook: accumulated in float32, the
    same parameters as the reducer's (bit for bit)."""
    rank = world.Get_rank()
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        batches = _mlp_batches(rank, 4, dtype)
        hooked, _, hook = _train_ddp(
            world, algorithm, _small_mlp(dtype=dtype), batches, density=0.2
        )
        ref, _ = _train_reducer(world, algorithm, _small_mlp(dtype=dtype), batches, density=0.2)
        out[str(dtype)] = {
            "equal_to_reducer": _bits(hooked) == _bits(ref),
            "dtype": str(next(hooked.parameters()).dtype),
            "residual_dtype": str(hook.allreducer.residual.dtype),
            "moved": _max_diff(hooked, _small_mlp(dtype=dtype)),
        }
    return out


def launch_mismatch(world):
    """Edge case 6: the hook's communicator is not DDP's process group (as under torchrun, where
    each process's COMM_WORLD has size 1): an error on every rank at the first call."""
    from mpi4py import MPI

    def step():
        m = _small_mlp()
        net = DDP(m)
        st = SparseHookState(MPI.COMM_SELF, "topka", warmup_steps=0, density=0.5)
        net.register_comm_hook(st, sparse_allreduce_hook)
        F.mse_loss(net(torch.ones(2, 16)), torch.zeros(2, 4)).backward()

    return _outcome(world, step)


def option_errors(world, algorithm):
    """Edge case 7: bad options fail at construction on every rank, also when only one rank's
    options are bad, with make's messages; unknown options list every accepted one."""
    rank = world.Get_rank()
    m = _small_mlp()
    cases = {
        "misspelt": {"densty": 0.01},
        "range_on_rank1": {"density": 5.0 if rank == 1 else 0.5},
    }
    out = {}
    for label, opts in cases.items():
        out[label] = {
            "hook": _outcome(world, lambda o=opts: SparseHookState(world, algorithm, **o)),
            "reducer": _outcome(
                world, lambda o=opts: SparseGradientReducer(m.parameters(), world, algorithm, **o)
            ),
        }
    out["SparDL"] = _outcome(world, lambda: SparseHookState(world, "SparDL"))
    return out


def trains_on_after_an_error(world, algorithm):
    """nonfinite="raise" with DDP, a NaN in rank 0's input at iteration 2 (of 5), the error
    caught by the training loop: backward raises NonFiniteError on every rank, the gradients
    of that iteration are zero, and the next iterations run and train as usual (DDP's reducer
    is left in a usable state), in the default and the overlap mode, on several buckets."""
    rank = world.Get_rank()
    out = {}
    for overlap in (False, True):
        model = _small_mlp(7)
        net = DDP(model, bucket_cap_mb=0.001)  # several buckets
        st = SparseHookState(
            world, algorithm, warmup_steps=0, density=0.2, model=model, overlap=overlap
        )
        net.register_comm_hook(st, sparse_allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        outcomes, zero_grads, moved = [], None, []
        for it, (x, y) in enumerate(_mlp_batches(rank, 5)):
            if it == 2 and rank == 0:
                x = x.clone()
                x[0, 0] = float("nan")
            before = torch.cat([p.detach().flatten() for p in model.parameters()])
            opt.zero_grad()
            try:
                F.mse_loss(net(x), y).backward()
            except spardl.NonFiniteError:
                outcomes.append("NonFiniteError")
                zero_grads = all(bool((p.grad == 0).all()) for p in model.parameters())
                continue
            opt.step()
            outcomes.append("ok")
            after = torch.cat([p.detach().flatten() for p in model.parameters()])
            moved.append(float((after - before).abs().max()))
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        out["overlap" if overlap else "default"] = {
            "outcomes": world.allgather(outcomes),
            "zero_grads": world.allgather(zero_grads),
            "moved": world.allgather(moved),
            "same_everywhere": _same_everywhere(world, flat),
            "finite": bool(torch.isfinite(flat).all()),
            "steps": st.step,
        }
        st.close()
    return out


def edge_case_checks(world):
    torch.manual_seed(0)
    out = {
        "launch_mismatch": launch_mismatch(world),
        "foreign_model": foreign_model(world),
        "changed_layout": changed_layout(world),
        "static_graph_mixed": static_graph_mixed(world),
        "shared_state": shared_state(world),
    }
    for algorithm in SPARSE_ALGORITHMS:
        out[algorithm] = {
            "resume": hook_resume(world, algorithm),
            "unused_hook": unused_parameters(world, algorithm, "hook"),
            "unused_reducer": unused_parameters(world, algorithm, "reducer"),
            "sparse": sparse_gradients(world, algorithm),
            "frozen": frozen_and_unused(world, algorithm),
            "low_precision": low_precision(world, algorithm),
            "options": option_errors(world, algorithm),
        }
    return out


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
        "bucket_layouts": bucket_layouts(world, algorithm),
        "reducer": reducer_writes_back(world, algorithm),
        "trains_on_after_an_error": trains_on_after_an_error(world, algorithm),
        "edge_cases": edge_case_checks(world),
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
