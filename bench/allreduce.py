"""OSU-style benchmark of the sparse allreduces against MPI's own Allreduce.

Run under mpiexec, e.g.::

    mpiexec -n 4 python bench/allreduce.py --algorithms spardl,dense --n 25000000 --density 0.01

Every rank builds a heavy-tailed gradient (Student-t, 3 degrees of freedom, scaled, a different
fixed-seed stream per rank). For each algorithm and density: ``--warmup`` untimed calls (Numba
compilation, first-touch of buffers, the threshold selectors' first exact steps), then
``--repeat`` timed calls, each preceded by a barrier and timed with ``MPI.Wtime``; a call's time is
the slowest rank's (a MAX reduction) and a row reports the median over the repeats. Bytes and
messages are the allreducer's own counters (``stats``), per rank per call, averaged over ranks.

The peers every ratio is quoted against are MPI's own collectives, measured the same way in the
same run, outside spardl's allreducers: "raw Allreduce" of the gradient buffer itself, in its
dtype (fp32 by default), into a preallocated buffer, and "raw Allreduce fp16" of a float16 copy
of the gradient (the cast is done once, outside the timed calls). mpi4py maps float16 to
``MPIX_C_FLOAT16``, which MPICH's wheels sum in software, several times slower than the float32
call of twice the bytes, and MPICH's ``Allreduce`` with a user operation sends n·log2(P) values;
so the fp16 row (and a ``--dtype float16`` gradient's raw row) is
``spardl.comm.float16_allreduce``: MPI's ``Reduce_scatter_block`` with a vectorised float16 sum,
then its ``Allgather``, the traffic of a ring allreduce, as a user of the 16-bit allreduce would
run it (``--mpi-float16-sum`` adds a row with ``Allreduce`` and MPI.SUM itself). Their bytes and
messages are counted as
spardl counts a dense allreduce: one message, 2·m·(P−1)/P bytes each way for m bytes. Rank 0
prints one table: time, bytes and messages per rank per call, and the time as a ratio to both
raw rows, bytes and messages as a ratio to the raw row of the gradient's dtype.

The ratio to the raw Allreduce of the gradient's dtype is *paired*: every timed call of every
later row is preceded by one timed raw Allreduce of the same buffer (after its own barrier), and
the row reports the median over the repeats of call time / that raw time. On a shared machine
the load moves by tens of percent within a run; the pair sees the same load, a ratio of two
medians taken a minute apart does not (the JSON keeps that one too, ``time_ratio_unpaired``).
The ratio to raw fp16 is median / median (pairing with a call 7× slower would cost the run too
much time).

Across emulated nodes (``spardl cluster run ... -- python bench/allreduce.py``, or
bench/cluster.py), each row also gets ``link_tx_bytes``: what each node's link sent per timed
call (Ethernet frames, from the node's interface counters, mean over nodes).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

# Run as a script from a checkout: the repository root first, so `spardl` and `spardl_kernels`
# are this checkout's even where the editable install's finder is stale.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import spardl  # noqa: E402
from bench._args import (  # noqa: E402
    ELEMENTS,
    check_gradient_scale,
    nonempty_names,
    output_file,
    plot_file,
)
from spardl.cli.common import (  # noqa: E402
    DENSITY,
    NONNEGATIVE_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    SEED,
    Parser,
)
from spardl.comm import float16_allreduce  # noqa: E402


def _args(argv):
    # One line from rank 0 for a usage error, before any allreducer is built.
    ap = Parser(prog="allreduce.py", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--algorithms",
        type=nonempty_names,
        default=",".join(sorted(spardl.ALGORITHMS)),
        help="comma-separated names from spardl.ALGORITHMS (default: all)",
    )
    ap.add_argument(
        "--n", type=ELEMENTS, default=25_000_000, help="gradient length (at most 2**31 - 1)"
    )
    ap.add_argument(
        "--density",
        type=DENSITY,
        nargs="+",
        default=[0.01],
        help="one or several densities ρ (a sweep)",
    )
    ap.add_argument("--teams", type=POSITIVE_INT, default=1, help="SparDL's d (divides P)")
    ap.add_argument(
        "--wire",
        nargs="+",
        choices=["coo", "compact"],
        default=["coo"],
        help="wire formats of the sparse allreducers (several: one row each; a row of another "
        "format than coo is labelled 'algorithm (format)')",
    )
    ap.add_argument("--repeat", type=POSITIVE_INT, default=10, help="timed calls per row")
    ap.add_argument("--warmup", type=NONNEGATIVE_INT, default=3, help="untimed calls per row")
    ap.add_argument("--dtype", default="float32", choices=["float16", "float32", "float64"])
    ap.add_argument("--seed", type=SEED, default=0)
    ap.add_argument(
        "--scale",
        type=POSITIVE_FLOAT,
        default=1e-3,
        help="the gradient's magnitude (Student-t values times this); below about 6e-5·P most "
        "values of the raw fp16 row's float16 copy are subnormal; refused where the gradients "
        "or their sums over P could overflow --dtype",
    )
    ap.add_argument(
        "--mpi-float16-sum",
        action="store_true",
        help="also time the fp16 Allreduce with MPI.SUM itself (the raw fp16 row is "
        "spardl.comm.float16_allreduce: a reduce-scatter with a vectorised float16 sum and an "
        "all-gather); the x raw fp16 ratios are then against the faster of the two",
    )
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
    ap.add_argument("--json", metavar="PATH", type=output_file, help="write the rows as JSON")
    ap.add_argument(
        "--plot", metavar="PATH.png", type=plot_file, help="time and bytes vs density per algorithm"
    )
    a = ap.parse_args(argv)
    unknown = [s for s in a.algorithms if s not in spardl.ALGORITHMS]
    if unknown:
        ap.error(f"unknown algorithm(s) {unknown}; known: {sorted(spardl.ALGORITHMS)}")
    P = MPI.COMM_WORLD.size
    problem = check_gradient_scale(a.scale, a.dtype, a.n, P)
    if problem:
        ap.error(problem)
    if "spardl" in a.algorithms and P % a.teams:
        ap.error(f"--teams must divide the number of ranks P={P}, got {a.teams}")
    return a


def gradient(n, rank, seed, dtype, scale=1e-3):
    """A heavy-tailed gradient: Student-t (ν = 3) scaled to gradient-like magnitudes (1e-3)."""
    rng = np.random.default_rng(seed * 1000 + rank)
    return (rng.standard_t(3, n) * scale).astype(dtype)


def _link_tx(comm):
    """Bytes the links of all nodes have sent so far (each node's counter read by its first
    rank), and the number of nodes; None outside an emulated cluster (``spardl cluster``)."""
    from spardl.cluster import node_counters

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    c = node_counters() if node.rank == 0 else None
    node.Free()
    here = comm.allreduce(0 if c is None else 1)
    return None if here == 0 else (comm.allreduce(0 if c is None else c["tx_bytes"]), here)


def _timed(comm, call):
    """The slowest rank's time of one ``call()`` started after a barrier."""
    comm.Barrier()
    t0 = MPI.Wtime()
    call()
    return comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX)


def _median_time(comm, call, warmup, repeat, peer=None):
    """Median over ``repeat`` timed calls (each after a barrier) of the slowest rank's time,
    the bytes each node's link sent per call (mean over nodes and calls, counters read around
    each timed call alone; None outside a cluster), and, with ``peer`` (a ``(call, link bytes
    per call)`` pair), the median over the repeats of time / the peer's time, the peer timed
    right before each call (a paired ratio: both see the same load on a shared machine); else
    None."""
    for _ in range(warmup):
        call()
    times, ratios, sent = [], [], []
    for _ in range(repeat):
        tp = None if peer is None else _timed(comm, peer[0])
        before = _link_tx(comm)  # read around this call only, not the peer's
        times.append(_timed(comm, call))
        after = _link_tx(comm)
        if before is not None:
            sent.append((after[0] - before[0]) / after[1])
        if tp is not None:
            ratios.append(times[-1] / tp)
    link = float(np.mean(sent)) if sent else None
    return float(np.median(times)), link, float(np.median(ratios)) if ratios else None


def measure(comm, make, g, warmup, repeat, peer=None):
    """Median over ``repeat`` of the slowest rank's time of one call, per-call counters, link
    bytes and the paired ratio to ``peer`` (see :func:`_median_time`)."""
    ar = make()
    for _ in range(warmup):
        ar(g)
    s0 = {k: ar.stats[k] for k in ("messages", "bytes_sent")}
    t, link, paired = _median_time(comm, lambda ar=ar: ar(g), 0, repeat, peer)
    per = {k: (ar.stats[k] - s0[k]) / repeat for k in s0}
    mean = {k: comm.allreduce(v, op=MPI.SUM) / comm.size for k, v in per.items()}
    del ar
    gc.collect()
    return t, mean["bytes_sent"], mean["messages"], link, paired


def measure_raw(comm, send, warmup, repeat, peer=None, op=None):
    """MPI's own ``Allreduce(send, recv, op)`` into a preallocated ``recv``, timed as
    :func:`measure` times an allreducer; bytes and messages as spardl counts a dense allreduce
    (one message, 2·m·(P−1)/P bytes for m bytes; nothing at P = 1). ``op`` None: MPI.SUM, and
    for float16 ``spardl.comm.float16_allreduce`` (MPI's reduce-scatter with a vectorised
    float16 sum, then its all-gather) in place of ``Allreduce``, with ``check=False``: no
    agreement message, as MPI's own call sends none."""
    recv = np.empty_like(send)
    if op is None and send.dtype == np.float16:
        call = lambda: float16_allreduce(comm, send, recv, check=False)  # noqa: E731
    else:
        op = MPI.SUM if op is None else op
        call = lambda: comm.Allreduce(send, recv, op=op)  # noqa: E731
    t, link, paired = _median_time(comm, call, warmup, repeat, peer)
    P = comm.size
    return t, 2 * send.nbytes * (P - 1) // P, 1.0 if P > 1 else 0.0, link, paired


SHORT = {"float16": "fp16", "float32": "fp32", "float64": "fp64"}


def _fmt_table(rows, dtype):
    raw = f"x raw {SHORT[dtype]}"
    head = (
        "algorithm",
        "density",
        "time (s)",
        raw,
        "x raw fp16",
        "bytes/rank",
        raw,
        "msgs/rank",
        raw,
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        dens = "-" if r["density"] is None else f"{r['density']:g}"
        lines.append(
            f"| {r['algorithm']} | {dens} | {r['time_s']:.4f} | {r['time_ratio']:.3f} "
            f"| {r['time_ratio_fp16']:.3f} | {r['bytes_sent']:.4g} | {r['bytes_ratio']:.4f} "
            f"| {r['messages']:.1f} | {r['messages_ratio']:.2f} |"
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


def _measure_peers(comm, a, g, results):
    """Time MPI's own Allreduce of ``g`` (its dtype) and of a float16 copy into ``results``;
    return both raw results and the peer every later row is paired with."""
    # The peers every ratio is quoted against: MPI's own Allreduce of the same gradient buffer
    # (its dtype) and of a float16 copy of it (cast here, outside the timed calls).
    raw = measure_raw(comm, g, a.warmup, a.repeat)
    results[(f"raw Allreduce {SHORT[a.dtype]}", None)] = (*raw[:4], 1.0)
    # Every later row times this same call right before each of its own (the paired ratio).
    peer_out = np.empty_like(g)
    if g.dtype == np.float16:
        peer = (lambda: float16_allreduce(comm, g, peer_out, check=False), raw[3])
    else:
        peer = (lambda: comm.Allreduce(g, peer_out, op=MPI.SUM), raw[3])
    raw16, g16 = raw, g
    if a.dtype != "float16":
        # Values past float16's range (a --scale far above 1e-3) become inf in this copy: MPI
        # sums them all the same, and only this row's time is taken from it.
        with np.errstate(over="ignore"):
            g16 = g.astype(np.float16)
        raw16 = measure_raw(comm, g16, a.warmup, a.repeat, peer)
        results[("raw Allreduce fp16", None)] = raw16
    if a.mpi_float16_sum:  # MPI.SUM itself: software float16 arithmetic in MPICH's wheels
        builtin = measure_raw(comm, g16, a.warmup, a.repeat, peer, op=MPI.SUM)
        results[("raw Allreduce fp16, MPI.SUM", None)] = builtin
        raw16 = min(raw16, builtin, key=lambda r: r[0])  # the faster 16-bit peer
    return raw, raw16, peer


def _measure_sparse(comm, a, g, alg, density, peer, results, profile):
    """Time one sparse algorithm at one density: one row per wire format, then spardl's
    ``check=False`` row and phase profile where asked."""
    for wire in a.wire:
        opts = {"density": density}
        if alg == "spardl":
            opts["teams"] = a.teams
        if wire != "coo":
            opts["wire"] = wire
        label = alg if wire == "coo" else f"{alg} ({wire})"
        results[(label, density)] = measure(
            comm,
            lambda alg=alg, opts=opts: spardl.make(alg, comm, a.n, **opts),
            g,
            a.warmup,
            a.repeat,
            peer,
        )
    opts = {"density": density}
    if alg == "spardl":
        opts["teams"] = a.teams
    if a.check_cost and alg == "spardl":
        unchecked = {**opts, "check": False}
        results[("spardl (check=False)", density)] = measure(
            comm,
            lambda o=unchecked: spardl.make("spardl", comm, a.n, **o),
            g,
            a.warmup,
            a.repeat,
            peer,
        )
    if a.profile and alg == "spardl":
        profile[density] = _profile_spardl(comm, a, g, opts)


def _measure_matrix(comm, a, g, peer, results, profile):
    """Time every (density, algorithm) pair of the run into ``results`` (and ``profile``)."""
    dense = None  # density-independent: measured once, listed once per density
    for density in a.density:
        for alg in a.algorithms:
            if alg == "dense":
                if dense is None:
                    dense = measure(
                        comm, lambda: spardl.make("dense", comm, a.n), g, a.warmup, a.repeat, peer
                    )
                    # The 16-bit dense allreduce (float16 on the wire, scaled by 2^e).
                    dense16 = measure(
                        comm,
                        lambda: spardl.make("dense", comm, a.n, wire_dtype="float16"),
                        g,
                        a.warmup,
                        a.repeat,
                        peer,
                    )
                results[(alg, density)] = dense
                results[("dense (fp16)", density)] = dense16
                continue
            _measure_sparse(comm, a, g, alg, density, peer, results, profile)


def _rows(results, raw, raw16):
    """The report's rows: each result with its ratios to the raw Allreduce rows."""
    rows = []
    for (alg, density), (t, b, m, link, paired) in results.items():
        rows.append(
            {
                "algorithm": alg,
                "density": density,
                "time_s": t,
                "bytes_sent": b,
                "messages": m,
                "link_tx_bytes": link,
                "time_ratio": paired,
                "time_ratio_unpaired": t / raw[0],
                "time_ratio_fp16": t / raw16[0],
                "bytes_ratio": b / raw[1] if raw[1] else float("nan"),
                "messages_ratio": m / raw[2] if raw[2] else float("nan"),
            }
        )
    return rows


def _print_report(a, P, load, rows, profile):
    """Print the run's header, the table and spardl's phase profiles (rank 0)."""
    print(f"# {' '.join(sys.argv)}")
    print(
        f"# P={P}, n={a.n}, dtype={a.dtype}, teams={a.teams}, repeat={a.repeat}, "
        f"warmup={a.warmup}, host={platform.node()}, "
        f"1-min load average {load[0]:.2f} at start, {load[1]:.2f} at end"
    )
    print(
        f"# ratios: time / raw Allreduce {SHORT[a.dtype]} (MPI_Allreduce of the gradient "
        "buffer: the median of per-call ratios, each call paired with a raw call timed "
        "right before it) and / raw Allreduce fp16 (of a float16 copy, by "
        "spardl.comm.float16_allreduce, or MPI's Allreduce with MPI.SUM where --mpi-float16-sum "
        "timed it faster: median / median); "
        f"bytes and messages / raw Allreduce {SHORT[a.dtype]}"
    )
    print(_fmt_table(rows, a.dtype))
    for density, ph in profile.items():
        print(
            f"# spardl profile at density {density:g} (rank 0, median s): "
            + ", ".join(f"{k} {v:.4f}" for k, v in ph.items())
        )


def _write_json(a, P, load, rows, profile):
    """Write the run's settings, rows and profiles to ``a.json``."""
    with open(a.json, "w") as f:
        json.dump(
            {
                "P": P,
                "n": a.n,
                "dtype": a.dtype,
                "teams": a.teams,
                "argv": sys.argv,
                "load_average": load,
                "peers": {
                    "time_ratio": f"raw Allreduce {SHORT[a.dtype]}",
                    "time_ratio_fp16": "raw Allreduce fp16"
                    + (" or raw Allreduce fp16, MPI.SUM: the faster" if a.mpi_float16_sum else ""),
                },
                "rows": rows,
                "profile": {str(k): v for k, v in profile.items()},
            },
            f,
            indent=1,
        )


def main(argv=None):
    """Time the raw Allreduce peers and every (density, algorithm) row; rank 0 reports."""
    a = _args(argv)
    comm = MPI.COMM_WORLD
    P = comm.size
    load = [os.getloadavg()[0]]
    g = gradient(a.n, comm.rank, a.seed, np.dtype(a.dtype), a.scale)
    profile = {}
    results = {}
    raw, raw16, peer = _measure_peers(comm, a, g, results)
    _measure_matrix(comm, a, g, peer, results, profile)
    load.append(os.getloadavg()[0])
    rows = _rows(results, raw, raw16)
    if comm.rank == 0:
        _print_report(a, P, load, rows, profile)
        if a.json:
            _write_json(a, P, load, rows, profile)
        if a.plot:
            _plot([r for r in rows if r["density"] is not None], a.plot)


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
