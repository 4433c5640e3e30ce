"""GPU benchmark of the CUDA kernels (spardl_kernels.cuda) beside torch on the same GPU.

One script, one GPU, a few minutes: every kernel at n = 25,000,000 and 110,000,000 float32
(density 1%), next to ``torch.topk``, ``torch.nonzero`` and a device-to-device copy of the same
bytes. Times are CUDA-event medians after warm-up (the first call of each kernel compiles it
and is never timed). Writes a JSON file and prints one table with the ratios behind the goals:

* ``select_above`` reads x at >= 50% of the copy bandwidth
  (bandwidth = bytes of x read once / time; copy = bytes read + written / time);
* ``topk_abs`` takes <= 1.0x the time of ``torch.topk(x.abs(), k, sorted=False)``.

Two rows go past the kernels: ``spardl_step`` (one SparDL step with GPU buffers) and
``hook_step`` (a DDP step whose sparse hook reduces CUDA buckets on the device, synchronous and
overlapped; a one-rank NCCL process group).

Usage (see docs/performance.md, "GPU kernels")::

    python bench/gpu.py results/gpu.json
    python bench/gpu.py out.json --sizes 1000000 --repeats 3     # a quick smoke run
"""

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._args import (  # noqa: E402
    DENSITY,
    ELEMENTS,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    Parser,
    comma_list,
    output_file,
)

KERNELS = [
    "copy",
    "topk_abs",
    "kth_largest_abs",
    "select_above",
    "count_above",
    "estimate_threshold",
    "merge_add",
    "coalesce",
    "scatter_add",
    "gather",
    "uniform_bounds",
    "balanced_bounds",
    "block_offsets",
    "spardl_step",
    "hook_step",
]


def parse_args(argv=None):
    p = Parser(
        description="Benchmark the CUDA kernels of spardl_kernels beside torch on one GPU.",
    )
    p.add_argument("json_path", type=output_file, help="where to write the results (JSON)")
    p.add_argument(
        "--sizes",
        type=comma_list(ELEMENTS),
        default="25000000,110000000",
        help="comma-separated vector lengths n (default: %(default)s)",
    )
    p.add_argument("--density", type=DENSITY, default=0.01, help="rho, k = rho * n (default 0.01)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=10, help="timed calls per row (median)")
    p.add_argument(
        "--warmup", type=POSITIVE_INT, default=2, help="untimed calls per row (>= 1: compile)"
    )
    p.add_argument(
        "--kernels",
        default=",".join(KERNELS),
        help="comma-separated subset of: " + ", ".join(KERNELS),
    )
    p.add_argument(
        "--budget-s",
        type=POSITIVE_FLOAT,
        default=420.0,
        help="stop starting new rows after this many seconds (default %(default)s: the whole "
        "run fits in 8 minutes)",
    )
    p.add_argument(
        "--P", type=POSITIVE_INT, default=64, help="blocks for the bounds kernels (default 64)"
    )
    args = p.parse_args(argv)
    args.kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = sorted(set(args.kernels) - set(KERNELS))
    if unknown or not args.kernels:
        p.error(f"argument --kernels: unknown {unknown}; choose from {KERNELS}")
    return args


class Timer:
    """CUDA-event timing of a callable on the current stream: warm-up, then a median.

    Numba launches on the legacy default stream, the same stream torch uses by default, so
    events recorded by torch bracket the kernels of both.
    """

    def __init__(self, torch, warmup, repeats):
        self.torch = torch
        self.warmup = warmup
        self.repeats = repeats

    def __call__(self, fn):
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.repeats):
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        return statistics.median(times)


def run(args):
    import numpy as np
    import torch
    from numba import cuda

    if not torch.cuda.is_available() or not cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU visible to both torch and numba-cuda")
    import spardl_kernels.cuda  # noqa: F401 - fails early, with its message, without CUDA

    timer = Timer(torch, args.warmup, args.repeats)
    t_start = time.monotonic()
    rows, notes = [], []

    def row(n, kernel, ms, peer=None, peer_ms=None, goal=None, met=None, **extra):
        r = {
            "n": n,
            "kernel": kernel,
            "median_ms": ms,
            "peer": peer,
            "peer_ms": peer_ms,
            "ratio": (ms / peer_ms) if (peer_ms and ms is not None) else None,
            "goal": goal,
            "met": met,
        }
        r.update(extra)
        rows.append(r)
        print(
            f"  {kernel:<20s} n={n:>11,d}  {ms if ms is not None else float('nan'):9.3f} ms"
            + (f"  vs {peer} {peer_ms:9.3f} ms  ratio {r['ratio']:.2f}" if peer_ms else ""),
            flush=True,
        )

    for n in args.sizes:
        _one_size(n, args, timer, row, notes, t_start)
        torch.cuda.empty_cache()

    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "density": args.density,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "config": _config(),
        "rows": rows,
        "notes": notes,
        "wall_s": time.monotonic() - t_start,
    }


class _Size:
    """One vector length's shared inputs: x (gradient-like, on the GPU), its Numba view, k, and
    the rows' plumbing (timer, row writer, the time budget)."""

    def __init__(self, n, args, timer, row, notes, t_start):
        import torch
        from numba import cuda

        self.n, self.args, self.timer, self.row = n, args, timer, row
        self.notes, self.t_start = notes, t_start
        self.dev = torch.device("cuda")
        self.k = max(1, int(args.density * n))
        gen = torch.Generator(device=self.dev).manual_seed(0)
        # gradient-like: normal values with a heavy tail of larger magnitudes
        self.x = torch.randn(n, device=self.dev, generator=gen) * torch.exp(
            torch.randn(n, device=self.dev, generator=gen)
        )
        self.xd = cuda.as_cuda_array(self.x)
        self.bytes_x = self.x.element_size() * n
        self.topk = None  # (indices, values) of topk_abs, reused by the sparse rows

    def want(self, name) -> bool:
        if name not in self.args.kernels:
            return False
        if time.monotonic() - self.t_start > self.args.budget_s:
            self.notes.append(
                f"n={self.n} {name}: skipped, time budget of {self.args.budget_s} s spent"
            )
            return False
        return True


def _one_size(n, args, timer, row, notes, t_start):
    """Every requested row at one vector length n."""
    s = _Size(n, args, timer, row, notes, t_start)
    _selection_rows(s)
    _sparse_rows(s)
    _bounds_rows(s)
    if s.want("spardl_step"):
        _spardl_step(n, s.x, args, timer, row, notes)
    if s.want("hook_step"):
        _hook_step(n, s.x, args, timer, row, notes)


def _selection_rows(s):
    """copy, topk_abs, kth_largest_abs (against torch.topk) and the threshold rows."""
    import torch

    import spardl_kernels.cuda as gk

    n, k, x, xd, timer, row = s.n, s.k, s.x, s.xd, s.timer, s.row
    s.copy_gbs = None
    if s.want("copy") or "select_above" in s.args.kernels:
        dst = torch.empty_like(x)
        copy_ms = timer(lambda dst=dst: dst.copy_(x))
        s.copy_gbs = 2 * s.bytes_x / copy_ms / 1e6
        row(n, "copy", copy_ms, bandwidth_GBps=s.copy_gbs)
        del dst
    torch_topk_ms = timer(lambda: torch.topk(x.abs(), k, sorted=False))
    if s.want("topk_abs"):
        ms = timer(lambda: gk.topk_abs(xd, k))
        s.topk = gk.topk_abs(xd, k)
        tv = torch.topk(x.abs(), k, sorted=False).values
        got = torch.as_tensor(s.topk[1], device=s.dev).abs().min().item()
        ok = bool(got == tv.min().item())
        goal = ms <= torch_topk_ms
        peer = ("torch.topk(|x|)", torch_topk_ms, "ratio <= 1.0", goal)
        row(n, "topk_abs", ms, *peer, threshold_matches_torch=ok)
    s.thr = float(gk.kth_largest_abs(xd, k))
    if s.want("kth_largest_abs"):
        ms = timer(lambda: gk.kth_largest_abs(xd, k))
        row(n, "kth_largest_abs", ms, "torch.topk(|x|)", torch_topk_ms)
    _threshold_rows(s, torch_topk_ms)


def _threshold_rows(s, torch_topk_ms):
    """select_above, count_above and estimate_threshold at the k-th largest |x|."""
    import torch

    import spardl_kernels.cuda as gk

    n, k, x, xd, timer, row, thr = s.n, s.k, s.x, s.xd, s.timer, s.row, s.thr
    if s.want("select_above"):
        nz_ms = timer(lambda: torch.nonzero(x.abs() >= thr))
        ms = timer(lambda: gk.select_above(xd, thr))
        gbs = s.bytes_x / ms / 1e6
        frac = gbs / s.copy_gbs
        goal = ("read bandwidth >= 50% of copy", frac >= 0.5)
        extra = {"bandwidth_GBps": gbs, "fraction_of_copy_bandwidth": frac}
        row(n, "select_above", ms, "torch.nonzero(|x|>=t)", nz_ms, *goal, **extra)
    if s.want("count_above"):
        peer = timer(lambda: (x.abs() >= thr).sum().item())
        ms = timer(lambda: gk.count_above(xd, thr))
        row(n, "count_above", ms, "(|x|>=t).sum()", peer, bandwidth_GBps=s.bytes_x / ms / 1e6)
    if s.want("estimate_threshold"):
        ms = timer(lambda: gk.estimate_threshold(xd, k))
        est = gk.estimate_threshold(xd, k)
        err = abs(est / thr - 1.0) if thr else None
        row(n, "estimate_threshold", ms, "torch.topk(|x|)", torch_topk_ms, relative_error=err)


def _sparse_rows(s):
    """merge_add, coalesce, scatter_add and gather on two ranks' top-k selections."""
    import torch
    from numba import cuda

    import spardl_kernels.cuda as gk

    n, k, x, xd, dev, timer, row = s.n, s.k, s.x, s.xd, s.dev, s.timer, s.row
    ia, va = s.topk or gk.topk_abs(xd, k)
    ib, vb = gk.topk_abs(cuda.as_cuda_array(torch.roll(x, 12345)), k)
    if s.want("merge_add"):
        ms = timer(lambda: gk.merge_add(ia, va, ib, vb))
        row(n, "merge_add", ms, entries=2 * k)
    if s.want("coalesce"):
        cat_i = torch.cat([torch.as_tensor(ib, device=dev), torch.as_tensor(ia, device=dev)])
        cat_v = torch.cat([torch.as_tensor(vb, device=dev), torch.as_tensor(va, device=dev)])
        ci, cv = cuda.as_cuda_array(cat_i), cuda.as_cuda_array(cat_v)
        ms = timer(lambda: gk.coalesce(ci, cv))
        peer = timer(lambda: torch.unique(cat_i, return_inverse=True))
        row(n, "coalesce", ms, "torch.unique(inverse)", peer, entries=2 * k)
    if s.want("scatter_add"):
        dense = torch.zeros(n, device=dev)
        dd = cuda.as_cuda_array(dense)
        ms = timer(lambda: gk.scatter_add(dd, ia, va))
        ti, tv = torch.as_tensor(ia, device=dev), torch.as_tensor(va, device=dev)
        peer = timer(lambda: dense.index_add_(0, ti, tv))
        row(n, "scatter_add", ms, "index_add_", peer, entries=k)
        del dense
    if s.want("gather"):
        ms = timer(lambda: gk.gather(xd, ia))
        ti = torch.as_tensor(ia, device=dev)
        peer = timer(lambda: x[ti])
        row(n, "gather", ms, "x[idx]", peer, entries=k)
    s.ib = ib


def _bounds_rows(s):
    """uniform_bounds, balanced_bounds and block_offsets for P blocks."""
    import spardl_kernels.cuda as gk

    n, k, P, timer, row = s.n, s.k, s.args.P, s.timer, s.row
    ia = (s.topk or gk.topk_abs(s.xd, k))[0]
    if s.want("uniform_bounds"):
        row(n, "uniform_bounds", timer(lambda: gk.uniform_bounds(n, P)), P=P)
    if s.want("balanced_bounds"):
        ms = timer(lambda: gk.balanced_bounds(s.ib, n, P))
        row(n, "balanced_bounds", ms, entries=k, P=P)
    if s.want("block_offsets"):
        b = gk.uniform_bounds(n, P)
        ms = timer(lambda: gk.block_offsets(ia, b))
        row(n, "block_offsets", ms, entries=k, P=P)


def _spardl_step(n, x, args, timer, row, notes):
    """One single-rank SparDL step with GPU buffers: X = g + E, the selection, the residual and
    the result stay on the device (the collective layer's GPU path); P = 1, so no message."""
    try:
        from mpi4py import MPI

        import spardl
        from spardl import _arrays
        from spardl.comm import cuda_aware

        ar = spardl.make("spardl", MPI.COMM_SELF, n, density=args.density)
        out = ar(x)  # also the warm-up (compilation)
        on_device = _arrays.is_device(out.values) and _arrays.is_device(ar.residual)
    except Exception as e:  # noqa: BLE001 - any failure makes this row a note, not a crash
        notes.append(f"n={n} spardl_step: failed ({type(e).__name__}: {e})")
        print(f"  spardl_step failed: {type(e).__name__}: {e}", flush=True)
        return
    row(
        n,
        "spardl_step",
        timer(lambda: ar(x)),
        P=1,
        device_buffers=on_device,
        cuda_aware_mpi=cuda_aware(),
    )


def _hook_step(n, x, args, timer, row, notes):
    """DDP with the sparse hook on CUDA buckets, one rank: a one-rank NCCL process group (gloo
    if NCCL is missing), the model's n parameters in 8 tensors (several buckets), the gradient
    x; the hook's sparse allreduce runs over MPI.COMM_SELF with its buffers on the device (no
    message at P = 1; across ranks comm.py sends device buffers directly with a CUDA-aware MPI
    and stages them through the host otherwise). One row per mode: the synchronous hook and the
    overlap mode (each bucket reduced on the communication thread)."""
    try:
        import os
        import tempfile

        import torch.distributed as dist
        from mpi4py import MPI
        from torch.nn.parallel import DistributedDataParallel as DDP

        from spardl import _arrays
        from spardl.comm import cuda_aware
        from spardl.torch import SparseHookState, sparse_allreduce_hook

        if not dist.is_initialized():
            backend = "nccl" if dist.is_nccl_available() else "gloo"
            rdv = os.path.join(tempfile.mkdtemp(), "rendezvous")
            dist.init_process_group(backend, init_method=f"file://{rdv}", rank=0, world_size=1)
        chunks = [c.contiguous() for c in x.chunk(8)]
        for overlap in (False, True):
            model = _chunks_model([c.numel() for c in chunks]).to(x.device)
            net = DDP(model, bucket_cap_mb=max(1, n * 4 // 8 // 2**20))
            state = SparseHookState(
                MPI.COMM_SELF, "spardl", 0, density=args.density, overlap=overlap
            )
            net.register_comm_hook(state, sparse_allreduce_hook)

            def step(net=net):
                net.zero_grad(set_to_none=False)
                net(chunks).backward()

            ms = timer(step)
            ar = state.allreducer or next(iter(state._core.cores.values())).sparse
            name = "hook_overlap" if overlap else "hook_sync"
            extra = {"buckets": len(state._core.cores) if overlap else None}
            on_device = _arrays.is_device(ar.residual)
            row(n, name, ms, P=1, device_buffers=on_device, cuda_aware_mpi=cuda_aware(), **extra)
            del net, model
    except Exception as e:  # noqa: BLE001 - any failure makes this row a note, not a crash
        notes.append(f"n={n} hook_step: failed ({type(e).__name__}: {e})")
        print(f"  hook_step failed: {type(e).__name__}: {e}", flush=True)


def _chunks_model(sizes):
    """Parameters w_1..w_8 (zero); forward(x_1..x_8) = Σ_i w_i·x_i, so grad w_i = x_i."""
    import torch

    class Chunks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(m)) for m in sizes)

        def forward(self, xs):
            return sum((w * c).sum() for w, c in zip(self.w, xs, strict=True))

    return Chunks()


def _config():
    from spardl_kernels import config

    return {k: getattr(config, k) for k in dir(config) if k.startswith("CUDA_")}


def print_table(result):
    print()
    print(f"device: {result['device']}  torch {result['torch']}  density {result['density']}")
    head = (
        f"{'kernel':<20s} {'n':>12s} {'ms':>9s}  {'peer':<24s} {'peer ms':>9s} {'ratio':>6s}  goal"
    )
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        peer_ms = f"{r['peer_ms']:9.3f}" if r["peer_ms"] else f"{'':9s}"
        ratio = f"{r['ratio']:6.2f}" if r["ratio"] else f"{'':6s}"
        goal = ""
        if r["goal"]:
            goal = f"{r['goal']}: {'met' if r['met'] else 'NOT met'}"
            if "fraction_of_copy_bandwidth" in r:
                goal += f" ({r['fraction_of_copy_bandwidth']:.0%} of copy)"
        print(
            f"{r['kernel']:<20s} {r['n']:>12,d} {r['median_ms']:9.3f}  {r['peer'] or '':<24s} "
            f"{peer_ms} {ratio}  {goal}"
        )
    for note in result["notes"]:
        print("note:", note)


def main(argv=None):
    args = parse_args(argv)
    result = run(args)
    with open(args.json_path, "w") as f:
        json.dump(result, f, indent=2, default=lambda o: None if o != o else str(o))
    print_table(result)
    print(f"\nwrote {args.json_path} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
