"""OSU-style benchmark of the sparse allreduces against the dense MPI Allreduce.

Run under mpiexec, e.g.::

    mpiexec -n 4 python bench/allreduce.py --algorithms spardl,dense --n 25000000 --density 0.01

Every rank builds a heavy-tailed gradient (Student-t, 3 degrees of freedom, scaled, a different
fixed-seed stream per rank). For each algorithm and density: ``--warmup`` untimed calls (Numba
compilation, first-touch of buffers, the threshold selectors' first exact steps), then
``--repeat`` timed calls, each preceded by a barrier and timed with ``MPI.Wtime``; a call's time is
the slowest rank's (a MAX reduction) and a row reports the median over the repeats. Bytes and
messages are the allreducer's own counters (``stats``), per rank per call, averaged over ranks.
Rank 0 prints one table with every number also as a ratio to ``dense`` measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

# Run as a script from a checkout: the repository root first, so `spardl` and `spardl_kernels`
# are this checkout's even where the editable install's finder is stale.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import spardl  # noqa: E402


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--algorithms",
        default=",".join(sorted(spardl.ALGORITHMS)),
        help="comma-separated names from spardl.ALGORITHMS (default: all)",
    )
    ap.add_argument("--n", type=int, default=25_000_000, help="gradient length")
    ap.add_argument(
        "--density",
        type=float,
        nargs="+",
        default=[0.01],
        help="one or several densities ρ (a sweep)",
    )
    ap.add_argument("--teams", type=int, default=1, help="SparDL's d")
    ap.add_argument("--repeat", type=int, default=10, help="timed calls per row")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per row")
    ap.add_argument("--dtype", default="float32", choices=["float16", "float32", "float64"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also time each phase of spardl (selection vs communication)",
    )
    ap.add_argument(
        "--check-cost",
        action="store_true",
        help="also run spardl with check=False (no cross-rank consistency check), "
        "to show what the check costs",
    )
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--plot", metavar="PATH.png", help="time and bytes vs density per algorithm")
    a = ap.parse_args(argv)
    a.algorithms = [s for s in a.algorithms.split(",") if s]
    unknown = [s for s in a.algorithms if s not in spardl.ALGORITHMS]
    if unknown:
        ap.error(f"unknown algorithm(s) {unknown}; known: {sorted(spardl.ALGORITHMS)}")
    return a


def gradient(n, rank, seed, dtype):
    """A heavy-tailed gradient: Student-t (ν = 3) scaled to gradient-like magnitudes (1e-3)."""
    rng = np.random.default_rng(seed * 1000 + rank)
    return (rng.standard_t(3, n) * 1e-3).astype(dtype)


def measure(comm, make, g, warmup, repeat):
    """Median over ``repeat`` of the slowest rank's time of one call, and per-call counters."""
    ar = make()
    for _ in range(warmup):
        ar(g)
    s0 = {k: ar.stats[k] for k in ("messages", "bytes_sent")}
    times = []
    for _ in range(repeat):
        comm.Barrier()
        t0 = MPI.Wtime()
        ar(g)
        t = MPI.Wtime() - t0
        times.append(comm.allreduce(t, op=MPI.MAX))
    per = {k: (ar.stats[k] - s0[k]) / repeat for k in s0}
    mean = {k: comm.allreduce(v, op=MPI.SUM) / comm.size for k, v in per.items()}
    del ar
    gc.collect()
    return float(np.median(times)), mean["bytes_sent"], mean["messages"]


def _fmt_table(rows):
    head = (
        "algorithm",
        "density",
        "time (s)",
        "x dense",
        "bytes/rank",
        "x dense",
        "msgs/rank",
        "x dense",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(
            f"| {r['algorithm']} | {r['density']:g} | {r['time_s']:.4f} | {r['time_ratio']:.3f} "
            f"| {r['bytes_sent']:.4g} | {r['bytes_ratio']:.4f} | {r['messages']:.1f} "
            f"| {r['messages_ratio']:.2f} |"
        )
    return "\n".join(lines)


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for alg in sorted({r["algorithm"] for r in rows}):
        rs = sorted((r for r in rows if r["algorithm"] == alg), key=lambda r: r["density"])
        dens = [r["density"] for r in rs]
        axes[0].plot(dens, [r["time_s"] for r in rs], marker="o", label=alg)
        axes[1].plot(dens, [r["bytes_sent"] for r in rs], marker="o", label=alg)
    for ax, what in zip(
        axes, ("time per call (s, slowest rank)", "bytes sent per rank"), strict=True
    ):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("density ρ")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    a = _args(argv)
    comm = MPI.COMM_WORLD
    P = comm.size
    g = gradient(a.n, comm.rank, a.seed, np.dtype(a.dtype))
    algs = list(a.algorithms)
    if "dense" not in algs:
        algs.append("dense")  # the peer every ratio is quoted against
    profile = {}
    results = {}
    dense = measure(comm, lambda: spardl.make("dense", comm, a.n), g, a.warmup, a.repeat)
    for density in a.density:
        for alg in algs:
            if alg == "dense":
                results[(alg, density)] = dense
                continue
            opts = {"density": density}
            if alg == "spardl":
                opts["teams"] = a.teams
            results[(alg, density)] = measure(
                comm,
                lambda alg=alg, opts=opts: spardl.make(alg, comm, a.n, **opts),
                g,
                a.warmup,
                a.repeat,
            )
            if a.check_cost and alg == "spardl":
                unchecked = {**opts, "check": False}
                results[("spardl (check=False)", density)] = measure(
                    comm,
                    lambda o=unchecked: spardl.make("spardl", comm, a.n, **o),
                    g,
                    a.warmup,
                    a.repeat,
                )
            if a.profile and alg == "spardl":
                profile[density] = _profile_spardl(comm, a, g, opts)
    rows = []
    for (alg, density), (t, b, m) in results.items():
        rows.append(
            {
                "algorithm": alg,
                "density": density,
                "time_s": t,
                "bytes_sent": b,
                "messages": m,
                "time_ratio": t / dense[0],
                "bytes_ratio": b / dense[1] if dense[1] else float("nan"),
                "messages_ratio": m / dense[2] if dense[2] else float("nan"),
            }
        )
    if comm.rank == 0:
        print(f"# {' '.join(sys.argv)}")
        print(
            f"# P={P}, n={a.n}, dtype={a.dtype}, teams={a.teams}, repeat={a.repeat}, "
            f"warmup={a.warmup}, host={platform.node()}"
        )
        print(_fmt_table(rows))
        for density, ph in profile.items():
            print(
                f"# spardl profile at density {density:g} (rank 0, median s): "
                + ", ".join(f"{k} {v:.4f}" for k, v in ph.items())
            )
        if a.json:
            with open(a.json, "w") as f:
                json.dump(
                    {
                        "P": P,
                        "n": a.n,
                        "dtype": a.dtype,
                        "teams": a.teams,
                        "argv": sys.argv,
                        "rows": rows,
                        "profile": {str(k): v for k, v in profile.items()},
                    },
                    f,
                    indent=1,
                )
        if a.plot:
            _plot(rows, a.plot)


def _profile_spardl(comm, a, g, opts):
    """Wall time of each part of one spardl call on rank 0 (median over repeats), by wrapping
    the selector, the packed exchange and the kernels the algorithm calls."""
    import time

    import spardl.algorithms.spardl as mod

    ar = spardl.make("spardl", comm, a.n, **opts)
    acc = {}

    def timed(name, fn):
        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0

        return wrapper

    ar.selector.select = timed("select", ar.selector.select)
    for c in {id(c): c for c in (ar.comm, ar._team, ar._cross) if c is not None}.values():
        c.exchange_blocks = timed("exchange", c.exchange_blocks)
    orig_scatter = mod.K.scatter_add
    orig_reduce = ar._reduce
    ar._reduce = timed("_reduce", orig_reduce)
    samples = []
    try:
        mod.K.scatter_add = timed("scatter_add", orig_scatter)
        for i in range(a.warmup + a.repeat):
            acc.clear()
            comm.Barrier()
            t0 = time.perf_counter()
            ar(g)
            acc["call"] = time.perf_counter() - t0
            acc["base (X = g + E, checks)"] = acc["call"] - acc["_reduce"]
            acc["other in _reduce"] = acc["_reduce"] - sum(
                acc.get(k, 0.0) for k in ("select", "exchange", "scatter_add")
            )
            if i >= a.warmup:
                samples.append(dict(acc))
    finally:
        mod.K.scatter_add = orig_scatter
    return {k: float(np.median([s.get(k, 0.0) for s in samples])) for k in samples[0]}


if __name__ == "__main__":
    main()
