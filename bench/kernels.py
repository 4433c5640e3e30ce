"""Benchmark of the CPU kernels against memory bandwidth and the usual peers.

Data: the gradients of a small torch MLP + CNN after one backward pass, concatenated and tiled to
n (each tile scaled by its own log-normal factor, so tiles are not exact copies), float32; k is
1% of n. Every timing is the median of --repeat runs after one warm-up call (which also compiles).

    python bench/kernels.py --sizes 1048576 25000000 --repeat 7

Prints one table per n with times and the ratios the project's goals are stated in
(docs/performance.md, "Kernels"), and the measured error of estimate_threshold.
"""

import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import spardl_kernels as sk  # noqa: E402
from bench._args import (  # noqa: E402
    DENSITY,
    ELEMENTS,
    NONNEGATIVE_INT,
    POSITIVE_INT,
    Parser,
    option_type,
)

#: The most torch threads --torch-threads sets (torch.set_num_threads(100000) segfaults).
MAX_TORCH_THREADS = 1024
TORCH_THREADS = option_type(
    int, lambda v: 1 <= v <= MAX_TORCH_THREADS, f"an integer in [1, {MAX_TORCH_THREADS}]"
)


def gradient_like(n, seed=0):
    """Real gradients of a small MLP + CNN (one backward pass), tiled to length n."""
    import torch

    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 8 * 8, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )
    images = torch.randn(64, 3, 32, 32)
    labels = torch.randint(0, 10, (64,))
    torch.nn.functional.cross_entropy(net(images), labels).backward()
    g = torch.cat([p.grad.reshape(-1) for p in net.parameters()]).numpy().astype(np.float32)
    rng = np.random.default_rng(seed)
    tiles = -(-n // g.shape[0])
    scale = rng.lognormal(0.0, 0.5, tiles).astype(np.float32)
    x = (g[None, :] * scale[:, None]).reshape(-1)[:n]
    return np.ascontiguousarray(x), g.shape[0]


def timeit(fn, repeat):
    fn()  # warm-up (and compile)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sorted_pairs(rng, m, n):
    idx = np.sort(rng.choice(n, m, replace=False)).astype(np.int64)
    return idx, rng.standard_normal(m).astype(np.float32)


def _time_dense_kernels(x, k, t_kth, repeat, torch):
    """Median seconds of the selection kernels and their peers on the gradient ``x``."""
    n = x.shape[0]
    dst = np.empty_like(x)
    xt = torch.from_numpy(x)
    rows = {}
    rows["np.copyto(x)"] = timeit(lambda: np.copyto(dst, x), repeat)
    rows["topk_abs"] = timeit(lambda: sk.topk_abs(x, k), repeat)
    rows["kth_largest_abs"] = timeit(lambda: sk.kth_largest_abs(x, k), repeat)
    rows["select_above(x, kth)"] = timeit(lambda: sk.select_above(x, t_kth), repeat)
    rows["count_above(x, kth)"] = timeit(lambda: sk.count_above(x, t_kth), repeat)
    rows["estimate_threshold"] = timeit(lambda: sk.estimate_threshold(x, k), repeat)
    rows["np.argpartition(|x|, n-k)"] = timeit(lambda: np.argpartition(np.abs(x), n - k), repeat)
    rows["torch.topk(|x|, k)"] = timeit(lambda: torch.topk(xt.abs(), k), repeat)
    return rows


def _plain_merge():
    """A floor for merge_add: the plainest branch-free merge of two sorted (index, value) lists
    (one output per step, the sum where indices meet), without the sorted-unique check, the NaN
    rule or the two interleaved parts; compiled on first use."""
    from numba import njit

    @njit(nogil=True, cache=True)
    def plain_merge(ia, va, ib, vb, out_i, out_v):
        a = b = o = 0
        while a < ia.shape[0] and b < ib.shape[0]:
            x, y = ia[a], ib[b]
            ta, tb = x <= y, y <= x
            u, w = va[a], vb[b]
            out_i[o] = min(x, y)
            out_v[o] = (u + w) if (ta and tb) else (u if ta else w)
            a += ta
            b += tb
            o += 1
        return o

    return plain_merge


def _time_sparse_kernels(rows, repeat):
    """Add to ``rows`` the median seconds of merge_add and coalesce and their peers."""
    # merge of two sorted lists of 250,000 (int64, float32) pairs each
    rng = np.random.default_rng(1)
    m = 250_000
    ia, va = sorted_pairs(rng, m, 40 * m)
    ib, vb = sorted_pairs(rng, m, 40 * m)
    pair_bytes = np.empty(ia.nbytes + va.nbytes + ib.nbytes + vb.nbytes, np.uint8)
    pair_dst = np.empty_like(pair_bytes)

    def unique_add_at():
        i = np.concatenate([ia, ib])
        u, inv = np.unique(i, return_inverse=True)
        out = np.zeros(u.shape[0], np.float32)
        np.add.at(out, inv, np.concatenate([va, vb]))
        return u, out

    rows["np.copyto(pair bytes)"] = timeit(lambda: np.copyto(pair_dst, pair_bytes), repeat)
    rows["merge_add 2x250k"] = timeit(lambda: sk.merge_add(ia, va, ib, vb), repeat)
    plain, out_i, out_v = _plain_merge(), np.empty(2 * m, np.int64), np.empty(2 * m, np.float32)
    rows["plain merge loop 2x250k"] = timeit(lambda: plain(ia, va, ib, vb, out_i, out_v), repeat)
    rows["np.unique+np.add.at 2x250k"] = timeit(unique_add_at, repeat)
    ci = np.concatenate([ia, ib])
    cv = np.concatenate([va, vb])
    rows["coalesce 500k (unsorted)"] = timeit(lambda: sk.coalesce(ci, cv), repeat)
    # what an all-gather of P = 8 sparse vectors of 20,000 entries returns: 8 sorted runs
    runs = [sorted_pairs(rng, 20_000, 2_000_000) for _ in range(8)]
    ri = np.concatenate([r[0] for r in runs])
    rv = np.concatenate([r[1] for r in runs])
    rows["coalesce 8 runs x 20k"] = timeit(lambda: sk.coalesce(ri, rv), repeat)
    # SparDL with d = P = 4 at n = 25 M, ρ = 1 %: four ranks' top-h (h = k/P) from 25 M entries
    runs4 = [sorted_pairs(rng, 62_500, 25_000_000) for _ in range(4)]
    qi = np.concatenate([r[0] for r in runs4])
    qv = np.concatenate([r[1] for r in runs4])
    rows["coalesce 4 runs x 62.5k"] = timeit(lambda: sk.coalesce(qi, qv), repeat)
    ui = rng.integers(0, 1 << 40, 1_000_000)
    uv = rng.standard_normal(ui.shape[0]).astype(np.float32)
    rows["coalesce 1M random"] = timeit(lambda: sk.coalesce(ui, uv), repeat)


def _ratios(rows):
    """(name, measured ratio, goal) of the ratios the project's goals are stated in."""
    return [
        ("select_above / copyto", rows["select_above(x, kth)"] / rows["np.copyto(x)"], "<= 0.75"),
        ("topk_abs / copyto", rows["topk_abs"] / rows["np.copyto(x)"], "<= 3"),
        (
            "topk_abs / argpartition",
            rows["topk_abs"] / rows["np.argpartition(|x|, n-k)"],
            "<= 0.25",
        ),
        ("topk_abs / torch.topk", rows["topk_abs"] / rows["torch.topk(|x|, k)"], "<= 0.10"),
        (
            "merge_add / copyto(same bytes)",
            rows["merge_add 2x250k"] / rows["np.copyto(pair bytes)"],
            "<= 3",
        ),
        (
            "plain merge loop / copyto(same bytes)",
            rows["plain merge loop 2x250k"] / rows["np.copyto(pair bytes)"],
            "report",
        ),
        (
            "merge_add / (unique+add.at)",
            rows["merge_add 2x250k"] / rows["np.unique+np.add.at 2x250k"],
            "report",
        ),
    ]


def _threshold_error(x, k, t_kth):
    """estimate_threshold's relative error against the exact threshold over 20 seeds, and the
    count above each estimate over k."""
    rel = []
    cnt = []
    for seed in range(20):
        est = sk.estimate_threshold(x, k, seed=seed)
        rel.append(abs(est / float(t_kth) - 1.0))
        cnt.append(sk.count_above(x, est) / k)
    return rel, cnt


def bench_size(n, repeat, density, torch_threads):
    """Time every kernel and peer at gradient length ``n``; the ratios and the threshold
    estimate's error."""
    import torch

    torch.set_num_threads(torch_threads)
    x, n_params = gradient_like(n)
    k = max(1, int(density * n))
    t_kth = sk.kth_largest_abs(x, k)
    rows = _time_dense_kernels(x, k, t_kth, repeat, torch)
    _time_sparse_kernels(rows, repeat)
    ratios = _ratios(rows)
    # estimate_threshold: relative error against the exact threshold over 20 seeds
    rel, cnt = _threshold_error(x, k, t_kth)
    return n, k, n_params, rows, ratios, rel, cnt


def _args(argv):
    # Numba's thread pool has NUMBA_NUM_THREADS threads, fixed at import: spardl_kernels uses at
    # most that many whatever config.CPU_THREADS says, so a larger --threads is refused.
    import numba

    limit = numba.config.NUMBA_NUM_THREADS
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sizes",
        type=ELEMENTS,
        nargs="+",
        default=[2**20, 25_000_000],
        help="gradient lengths n (each at most 2**31 - 1)",
    )
    ap.add_argument("--repeat", type=POSITIVE_INT, default=7, help="timed runs per entry (median)")
    ap.add_argument("--density", type=DENSITY, default=0.01)
    ap.add_argument(
        "--torch-threads",
        type=TORCH_THREADS,
        default=min(os.cpu_count() or 1, MAX_TORCH_THREADS),
        help=f"torch.set_num_threads (at most {MAX_TORCH_THREADS}; default: the core count)",
    )
    ap.add_argument(
        "--threads",
        type=option_type(
            int,
            lambda v: 1 <= v <= limit,
            f"an integer in [1, {limit}] (NUMBA_NUM_THREADS; set it to allow more)",
        ),
        default=None,
        help="spardl_kernels.config.CPU_THREADS, at most NUMBA_NUM_THREADS "
        f"(here {limit}; default: Numba's)",
    )
    ap.add_argument(
        "--merge-parallel-min",
        type=NONNEGATIVE_INT,
        default=None,
        help="spardl_kernels.config.MERGE_PARALLEL_MIN (default: the config's, threaded merge off)",
    )
    return ap.parse_args(argv)


def main(argv=None):
    args = _args(argv)
    import numba

    from spardl_kernels import config

    config.CPU_THREADS = args.threads
    if args.merge_parallel_min is not None:
        config.MERGE_PARALLEL_MIN = args.merge_parallel_min
    threads = args.threads if args.threads is not None else numba.get_num_threads()
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"numpy {np.__version__}, median of {args.repeat} after warm-up, float32, "
        f"density {args.density}, torch threads {args.torch_threads}, kernel threads {threads} "
        f"(select_above/count_above from n = {config.SELECT_PARALLEL_MIN_N:,}, merge_add from "
        f"{config.MERGE_PARALLEL_MIN:,} pairs), load average {os.getloadavg()[0]:.1f}"
    )
    for n in args.sizes:
        n, k, n_params, rows, ratios, rel, cnt = bench_size(
            n, args.repeat, args.density, args.torch_threads
        )
        print(
            f"\n## n = {n:,}  k = {k:,}  (gradients of a {n_params:,}-parameter MLP+CNN, tiled)\n"
        )
        print("| kernel | median ms |")
        print("|---|---:|")
        for name, t in rows.items():
            print(f"| {name} | {t * 1e3:.3f} |")
        print("\n| ratio | measured | goal |")
        print("|---|---:|---|")
        for name, r, goal in ratios:
            print(f"| {name} | {r:.3f} | {goal} |")
        rel = np.array(rel)
        cnt = np.array(cnt)
        print(
            f"\nestimate_threshold (default sample, 20 seeds): |est/exact - 1| median "
            f"{np.median(rel):.4f}, max {rel.max():.4f}; count_above(x, est)/k in "
            f"[{cnt.min():.3f}, {cnt.max():.3f}], median {np.median(cnt):.3f}"
        )


if __name__ == "__main__":
    main()
