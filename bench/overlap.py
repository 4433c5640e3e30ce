"""Step time of the DDP hook's overlap mode against its synchronous mode (not a test).

A model of 8 linear layers (8 × 400·400 + biases = 1,283,200 parameters) in several DDP buckets
(``--bucket-cap-mb``), with a fixed compute delay in backward after every layer (``time.sleep``
in an autograd function: the delay stands for a GPU's backward kernels, so the 2-core test
machine's CPUs are not what is measured). Per step: forward, backward with the hook, SGD step;
the step time is rank 0's wall time between two barriers. The modes run in alternating blocks
(default: one step each, so that a change in the machine's load hits both alike), and each
block's median step counts; the figures are the median over blocks per mode and the median of
the paired ratios overlap / sync (block by block).

Usage::

    mpiexec -n 4 python bench/overlap.py results/overlap.json
    mpiexec -n 4 python bench/overlap.py out.json --delay-ms 5 --blocks 3 --steps 3
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._args import (  # noqa: E402
    DENSITY,
    NONNEGATIVE_FLOAT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    Parser,
    option_type,
    output_file,
)

MODES = ("sync", "overlap")
# The first warm-up step of each mode is dense, the next ones build and warm the hook's state.
WARMUP = option_type(int, lambda v: v >= 3, "an integer >= 3")


def parse_args(argv=None):
    """The options; a bad one is one line from rank 0 and status 2 on every rank."""
    import spardl

    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("json_path", type=output_file, help="where rank 0 writes the results (JSON)")
    p.add_argument(
        "--algorithm",
        default="spardl",
        choices=sorted(spardl.ALGORITHMS),
        help="spardl.ALGORITHMS key (default spardl)",
    )
    p.add_argument("--density", type=DENSITY, default=0.01, help="rho (default 0.01)")
    p.add_argument("--width", type=POSITIVE_INT, default=400, help="layer width (default 400)")
    p.add_argument("--layers", type=POSITIVE_INT, default=8, help="linear layers (default 8)")
    p.add_argument(
        "--delay-ms", type=NONNEGATIVE_FLOAT, default=10.0, help="backward delay per layer"
    )
    p.add_argument(
        "--batch",
        type=POSITIVE_INT,
        default=32,
        help="samples per rank and step (default 32); the forward and backward passes run on "
        "this machine's CPUs beside the delays, so a small batch leaves the delays (the "
        "accelerator's share) as most of the step's compute",
    )
    p.add_argument("--bucket-cap-mb", type=POSITIVE_FLOAT, default=1.0, help="DDP's bucket_cap_mb")
    p.add_argument("--blocks", type=POSITIVE_INT, default=40, help="alternating blocks per mode")
    p.add_argument("--steps", type=POSITIVE_INT, default=1, help="timed steps per block")
    p.add_argument(
        "--warmup", type=WARMUP, default=4, help="untimed steps per mode (first: dense; >= 3)"
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="also record one overlapped step's bucket timeline on rank 0 (hook call, reduction "
        "start and end, ms from the step's start)",
    )
    return p.parse_args(argv)


def build(args):
    """The model: Linear layers, each followed (in backward: preceded) by the compute delay."""
    import torch

    delay_s = args.delay_ms / 1000.0

    class Delay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            time.sleep(delay_s)  # releases the GIL, as a GPU's kernels would
            return g

    class Delayed(torch.nn.Module):
        def forward(self, x):
            return Delay.apply(x)

    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.Tanh(), Delayed()]
    return torch.nn.Sequential(*layers)


def run_mode(mode, args, world):
    """A fresh DDP and hook in ``mode``: the warm-up steps, then ``blocks`` generators of
    per-step times (so the modes can alternate)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spardl.torch import SparseHookState, sparse_allreduce_hook

    torch.manual_seed(0)
    net = DDP(build(args), bucket_cap_mb=args.bucket_cap_mb)
    state = SparseHookState(
        world,
        args.algorithm,
        warmup_steps=1,
        density=args.density,
        overlap=(mode == "overlap"),
    )
    net.register_comm_hook(state, sparse_allreduce_hook)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(world.Get_rank())
    x = torch.randn(args.batch, args.width, generator=gen)

    def step():
        world.Barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
        world.Barrier()
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        step()
    return net, state, step


def _timeline(net, state, step):
    """One overlapped step with each bucket's hook call and reduction (start, end) recorded, in
    ms from the step's start: [(bucket index, called, start, end)] in DDP's order."""
    core, marks = state._core, {}
    reduce_bucket, hook = core.reduce_bucket, state._bucket_overlap

    def timed_reduce(index, *a, **k):
        marks.setdefault(index, [None])[1:] = [time.perf_counter()]
        out = reduce_bucket(index, *a, **k)
        marks[index].append(time.perf_counter())
        return out

    def timed_hook(bucket):
        marks[bucket.index()] = [time.perf_counter()]
        return hook(bucket)

    core.reduce_bucket, state._bucket_overlap = timed_reduce, timed_hook
    t0 = time.perf_counter()
    step()
    core.reduce_bucket, state._bucket_overlap = reduce_bucket, hook
    return [(b, *(1000 * (t - t0) for t in m)) for b, m in sorted(marks.items())]


def _load():
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return None


def main(argv=None):
    args = parse_args(argv)
    import torch
    from mpi4py import MPI

    from spardl.torch import init_process_group_from_mpi

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    init_process_group_from_mpi(world, backend="gloo")
    runs = {m: run_mode(m, args, world) for m in MODES}
    medians = {m: [] for m in MODES}
    for _ in range(args.blocks):
        for m in MODES:
            step = runs[m][2]
            medians[m].append(statistics.median(step() for _ in range(args.steps)))
    buckets = len(runs["overlap"][1]._core.cores)
    timeline = _timeline(*runs["overlap"]) if args.timeline else None
    n = sum(p.numel() for p in runs["sync"][0].parameters())
    result = {
        "world_size": world.Get_size(),
        "algorithm": args.algorithm,
        "density": args.density,
        "n": n,
        "buckets": buckets,
        "batch": args.batch,
        "delay_ms_per_layer": args.delay_ms,
        "backward_delay_ms": args.delay_ms * args.layers,
        "block_medians_ms": {m: [1000 * t for t in v] for m, v in medians.items()},
        "median_ms": {m: 1000 * statistics.median(v) for m, v in medians.items()},
        "argv": sys.argv[1:] if argv is None else list(argv),
    }
    result["overlap_over_sync"] = result["median_ms"]["overlap"] / result["median_ms"]["sync"]
    paired = [o / s for o, s in zip(medians["overlap"], medians["sync"], strict=True)]
    result["paired_ratio_median"] = statistics.median(paired)
    result["load_average"] = _load()
    result["timeline_ms"] = timeline
    if world.Get_rank() == 0:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=1)
        print(
            f"P={result['world_size']} n={n:,} buckets={buckets} {args.algorithm} "
            f"rho={args.density} delay {args.delay_ms} ms x {args.layers} layers"
        )
        for m in MODES:
            times = sorted(result["block_medians_ms"][m])
            quart = f"{times[len(times) // 4]:.1f}-{times[(3 * len(times)) // 4]:.1f}"
            print(f"  {m:<8s} {result['median_ms'][m]:8.1f} ms  (quartiles {quart} ms)")
        for b, called, start, end in timeline or []:
            print(f"  bucket {b}: hook at {called:.1f} ms, reduced {start:.1f}-{end:.1f} ms")
        print(
            f"  overlap / sync = {result['overlap_over_sync']:.2f} (medians), "
            f"{result['paired_ratio_median']:.2f} (median of paired ratios); "
            f"load average {result['load_average']}"
        )
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
