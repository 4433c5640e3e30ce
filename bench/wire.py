"""The wire formats against each other: ``wire="coo"`` and ``wire="compact"``, call by call.

Run under mpiexec, e.g.::

    mpiexec -n 4 python bench/wire.py --n 25000000 --density 0.01

For each algorithm, two allreducers (one per format) reduce the same heavy-tailed gradient as
bench/allreduce.py's (Student-t, ν = 3, × 1e-3, one fixed-seed stream per rank). After
``--warmup`` untimed calls of each, ``--repeat`` rounds each time one call of both (each after a
barrier, ``MPI.Wtime``, the slowest rank's time; the order alternates between rounds), so the
ratio compact / coo is *paired*: both calls of a round see the same load on a shared machine. A
row reports the median times and the median of the per-round ratios.

Bytes: ``stats["bytes_sent"]`` per rank per call (mean over ranks), what the allreducers count;
and **bytes per pair**: every sparse message packed during the timed calls, its bytes over the
(index, value) pairs it holds, summed over ranks and calls (``pack_blocks`` for coo, the compact
encoder for compact). Sizes, thresholds and other words that are not pairs are left out of that
ratio but not of ``bytes_sent``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import spardl  # noqa: E402
import spardl.algorithms.common  # noqa: E402
import spardl.algorithms.gtopk  # noqa: E402
import spardl.algorithms.oktopk  # noqa: E402
import spardl.algorithms.topkdsa  # noqa: E402
import spardl.comm  # noqa: E402
from bench._args import (  # noqa: E402
    DENSITY,
    ELEMENTS,
    NONNEGATIVE_INT,
    POSITIVE_INT,
    SEED,
    Parser,
    nonempty_names,
    output_file,
)

SPARSE = [a for a in sorted(spardl.ALGORITHMS) if a != "dense"]


def _args(argv):
    # One line from rank 0 for a usage error, before any allreducer is built.
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--algorithms",
        type=nonempty_names,
        default=",".join(SPARSE),
        help="comma-separated names (at least one)",
    )
    ap.add_argument(
        "--n", type=ELEMENTS, default=25_000_000, help="gradient length (at most 2**31 - 1)"
    )
    ap.add_argument("--density", type=DENSITY, default=0.01, help="ρ")
    ap.add_argument("--teams", type=POSITIVE_INT, default=1, help="SparDL's d (divides P)")
    ap.add_argument("--repeat", type=POSITIVE_INT, default=10, help="timed rounds per algorithm")
    ap.add_argument(
        "--warmup", type=NONNEGATIVE_INT, default=2, help="untimed calls per allreducer"
    )
    ap.add_argument("--seed", type=SEED, default=0)
    ap.add_argument("--json", metavar="PATH", type=output_file, help="write the rows as JSON")
    a = ap.parse_args(argv)
    bad = [s for s in a.algorithms if s not in SPARSE]
    if bad:
        ap.error(f"unknown or dense algorithm(s) {bad}; sparse ones: {SPARSE}")
    P = MPI.COMM_WORLD.size
    if "spardl" in a.algorithms and P % a.teams:
        ap.error(f"--teams must divide the number of ranks P={P}, got {a.teams}")
    return a


def gradient(n, rank, seed):
    """bench/allreduce.py's gradient: Student-t (ν = 3) × 1e-3, float32."""
    rng = np.random.default_rng(seed * 1000 + rank)
    return (rng.standard_t(3, n) * 1e-3).astype(np.float32)


class _Packed:
    """Counts (bytes, pairs) of every sparse message packed while ``on`` (coo: pack_blocks,
    wherever the algorithms call it from; compact: the encoder)."""

    def __init__(self):
        self.on = False
        self.counts = {"coo": [0, 0], "compact": [0, 0]}
        pack_blocks = spardl.comm.pack_blocks
        encode = spardl.comm.wire_codec.encode_blocks

        def counted_blocks(blocks, *args, **kwargs):
            buf = pack_blocks(blocks, *args, **kwargs)
            if self.on:
                c = self.counts["coo"]
                c[0] += buf.nbytes
                c[1] += sum(int(b[0].shape[0]) for b in blocks)
            return buf

        def counted_encode(indices, values, counts, **kwargs):
            buf, dec = encode(indices, values, counts, **kwargs)
            if self.on:
                c = self.counts["compact"]
                c[0] += buf.nbytes
                c[1] += len(indices)
            return buf, dec

        spardl.comm.wire_codec.encode_blocks = counted_encode
        for mod in (
            spardl.comm,
            spardl.algorithms.common,
            spardl.algorithms.gtopk,
            spardl.algorithms.oktopk,
            spardl.algorithms.topkdsa,
        ):
            if hasattr(mod, "pack_blocks"):
                mod.pack_blocks = counted_blocks


def _timed(comm, call):
    comm.Barrier()
    t0 = MPI.Wtime()
    call()
    return comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX)


def _measure(comm, a, g, alg, packed):
    """One algorithm's row: both formats warmed up, then ``--repeat`` paired rounds (the order
    alternating); median times, the paired ratio, bytes per rank and bytes per pair."""
    P = comm.size
    opts = {"density": a.density}
    if alg == "spardl":
        opts["teams"] = a.teams
    ars = {w: spardl.make(alg, comm, a.n, wire=w, **opts) for w in ("coo", "compact")}
    for ar in ars.values():
        for _ in range(a.warmup):
            ar(g)
    sent0 = {w: ar.stats["bytes_sent"] for w, ar in ars.items()}
    packed.counts = {"coo": [0, 0], "compact": [0, 0]}
    times = {"coo": [], "compact": []}
    packed.on = True
    for r in range(a.repeat):
        order = ("coo", "compact") if r % 2 == 0 else ("compact", "coo")
        for w in order:
            times[w].append(_timed(comm, lambda ar=ars[w]: ar(g)))
    packed.on = False
    ratios = [c / o for c, o in zip(times["compact"], times["coo"], strict=True)]
    row = {"algorithm": alg, "P": P}
    for w, ar in ars.items():
        per_rank = (ar.stats["bytes_sent"] - sent0[w]) / a.repeat
        b, p = (comm.allreduce(v, op=MPI.SUM) for v in packed.counts[w])
        row[f"time_{w}"] = float(np.median(times[w]))
        row[f"bytes_sent_{w}"] = comm.allreduce(per_rank, op=MPI.SUM) / P
        row[f"bytes_per_pair_{w}"] = b / p if p else float("nan")
    row["time_ratio"] = float(np.median(ratios))
    return row


def _print_report(a, P, load, rows):
    """Print the run's header and the table (rank 0)."""
    print(f"# {' '.join(sys.argv)}")
    print(
        f"# P={P}, n={a.n}, density={a.density}, teams={a.teams}, repeat={a.repeat}, "
        f"warmup={a.warmup}, 1-min load average {load[0]:.2f} at start, {load[1]:.2f} at end"
    )
    head = (
        "algorithm",
        "time coo (s)",
        "time compact (s)",
        "compact / coo (paired)",
        "bytes/rank coo",
        "bytes/rank compact",
        "bytes/pair coo",
        "bytes/pair compact",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print(
            f"| {r['algorithm']} | {r['time_coo']:.4f} | {r['time_compact']:.4f} "
            f"| {r['time_ratio']:.3f} | {r['bytes_sent_coo']:.4g} "
            f"| {r['bytes_sent_compact']:.4g} | {r['bytes_per_pair_coo']:.3f} "
            f"| {r['bytes_per_pair_compact']:.3f} |"
        )


def main(argv=None):
    """Time both wire formats of every algorithm, paired; rank 0 prints the table."""
    a = _args(argv)
    comm = MPI.COMM_WORLD
    P = comm.size
    load = [os.getloadavg()[0]]
    g = gradient(a.n, comm.rank, a.seed)
    packed = _Packed()
    rows = [_measure(comm, a, g, alg, packed) for alg in a.algorithms]
    load.append(os.getloadavg()[0])
    if comm.rank == 0:
        _print_report(a, P, load, rows)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"argv": sys.argv, "load_average": load, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
