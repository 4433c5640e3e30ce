"""bench/allreduce.py across emulated nodes: every algorithm against MPI's own Allreduce (fp32 and
fp16) over shaped TCP links, for several link rates and node layouts.

    sudo .venv/bin/python bench/cluster.py --bandwidth 1gbit 10gbit --layout 4x1 4x2 \\
        --n 25000000 --density 0.001 0.01 0.1 --out results/cluster

Each (rate, layout) is a fresh :class:`spardl.cluster.Cluster` (N nodes × R ranks, one link per
node shaped to the rate both ways) running ``bench/allreduce.py`` under its ``mpiexec``. Rank 0
of that job prints its table; this driver gathers every row into one Markdown section per
configuration (for docs/performance.md, "Over a network"), ``--out``/cluster.json, and a plot
``--out``/cluster.png (time per call against density, one panel per configuration, raw Allreduce
fp32 and fp16 as horizontal lines).

Times are the median over ``--repeat`` calls of the slowest rank; "link MB/node" is what each
node's interface sent per call (Ethernet frames, read from the node's counters: the proof that
the bytes crossed the link), beside the allreducer's own ``stats`` bytes per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench._args import (  # noqa: E402
    DENSITY,
    ELEMENTS,
    MAX_RANKS,
    NONNEGATIVE_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    Parser,
    output_dir,
    run_main,
)


def _layout(text: str) -> tuple[int, int]:
    try:
        nodes, per = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"layout must be NxR (e.g. 4x1), got {text!r}") from None
    from spardl.cluster import MAX_NODES

    if not 1 <= nodes <= MAX_NODES or per < 1 or nodes * per > MAX_RANKS:
        raise argparse.ArgumentTypeError(
            f"layout needs 1 <= N <= {MAX_NODES}, R >= 1 and N*R <= {MAX_RANKS} ranks, got {text!r}"
        )
    return nodes, per


def _args(argv):
    # Every option checked here, before any node is created.
    import spardl
    from spardl.cli.cluster import rate_type
    from spardl.cluster import check_quick

    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--bandwidth", type=rate_type, nargs="+", default=["1gbit", "10gbit"], help="link rates"
    )
    ap.add_argument("--layout", type=_layout, nargs="+", default=[(4, 1), (4, 2)], help="NxR")
    ap.add_argument(
        "--n", type=ELEMENTS, default=25_000_000, help="gradient length (at most 2**31 - 1)"
    )
    ap.add_argument("--density", type=DENSITY, nargs="+", default=[0.001, 0.01, 0.1])
    ap.add_argument("--algorithms", default=None, help="comma-separated (default: all)")
    ap.add_argument("--repeat", type=POSITIVE_INT, default=5)
    ap.add_argument("--warmup", type=NONNEGATIVE_INT, default=2)
    ap.add_argument(
        "--timeout", type=POSITIVE_FLOAT, default=1800, help="per configuration, seconds"
    )
    ap.add_argument(
        "--mpi-float16-sum",
        action="store_true",
        help="also time the fp16 Allreduce with MPI.SUM itself (bench/allreduce.py's option)",
    )
    ap.add_argument("--out", type=output_dir, default="results/cluster")
    a = ap.parse_args(argv)
    if a.algorithms is not None:
        names = [s for s in a.algorithms.split(",") if s]
        unknown = [s for s in names if s not in spardl.ALGORITHMS]
        if unknown or not names:
            ap.error(f"unknown algorithm(s) {unknown}; known: {sorted(spardl.ALGORITHMS)}")
    problem = check_quick()  # creates nothing
    if problem:
        ap.error(problem)
    return a


def run_one(bandwidth: str, nodes: int, per_node: int, a, tmp: Path) -> dict:
    """One configuration: bench/allreduce.py on a fresh cluster; its JSON report.

    Raises RuntimeError (:class:`spardl.cluster.ClusterError` included) if the cluster cannot
    be built or the job fails or runs past ``--timeout``."""
    from spardl.cluster import Cluster, measure_latency

    out = tmp / f"{bandwidth}-{nodes}x{per_node}.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "allreduce.py"),
        "--n",
        str(a.n),
        "--density",
        *map(str, a.density),
        "--repeat",
        str(a.repeat),
        "--warmup",
        str(a.warmup),
        "--json",
        str(out),
    ]
    if a.algorithms:
        cmd += ["--algorithms", a.algorithms]
    if a.mpi_float16_sum:
        cmd.append("--mpi-float16-sum")
    with Cluster(nodes, per_node, bandwidth=bandwidth) as cl:
        latency = measure_latency(cl) if nodes >= 2 else None
        print(f"# {cl.describe()}: {' '.join(cmd[1:])}", flush=True)
        proc = cl.run(cmd, timeout=a.timeout, cwd=ROOT)
    if proc.returncode == 124:
        raise RuntimeError(
            f"bench/allreduce.py on {nodes}x{per_node}, {bandwidth} timed out after "
            f"{a.timeout:g} s (--timeout)"
        )
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench/allreduce.py on {nodes}x{per_node}, {bandwidth} exited {proc.returncode}"
        )
    report = json.loads(out.read_text())
    report.update(bandwidth=bandwidth, nodes=nodes, ranks_per_node=per_node, latency_s=latency)
    return report


def table(report: dict) -> str:
    """One Markdown table of a configuration's rows."""
    head = [
        "algorithm",
        "density",
        "time (s)",
        "× Allreduce fp32",
        "× Allreduce fp16",
        "stats MB/rank",
        "link MB/node",
        "msgs/rank",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["rows"]:
        link = r.get("link_tx_bytes")
        dens = "—" if r.get("density") is None else f"{r['density']:g}"
        lines.append(
            f"| {r['algorithm']} | {dens} | {r['time_s']:.4f} "
            f"| {r.get('time_ratio', float('nan')):.3f} "
            f"| {r.get('time_ratio_fp16', float('nan')):.3f} "
            f"| {r['bytes_sent'] / 1e6:.3f} | {'—' if link is None else f'{link / 1e6:.3f}'} "
            f"| {r['messages']:.1f} |"
        )
    return "\n".join(lines)


def plot(reports: list[dict], path: Path) -> None:
    """Time per call against density, one panel per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reports), figsize=(4.2 * len(reports), 4), squeeze=False)
    for ax, rep in zip(axes[0], reports, strict=True):
        rows = rep["rows"]
        for alg in sorted({r["algorithm"] for r in rows if r.get("density") is not None}):
            rs = sorted(
                (r for r in rows if r["algorithm"] == alg and r.get("density") is not None),
                key=lambda r: r["density"],
            )
            if rs:
                ax.plot(
                    [r["density"] for r in rs], [r["time_s"] for r in rs], marker="o", label=alg
                )
        for r in rows:
            if r.get("density") is None:  # the dense baselines: one time each
                ax.axhline(
                    r["time_s"], ls="--", lw=1, color="k" if "fp32" in r["algorithm"] else "grey"
                )
                ax.annotate(
                    r["algorithm"],
                    (0.02, r["time_s"]),
                    xycoords=("axes fraction", "data"),
                    fontsize=7,
                    va="bottom",
                )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("density ρ")
        ax.set_title(
            f"{rep['nodes']} nodes × {rep['ranks_per_node']}, {rep['bandwidth']}", fontsize=9
        )
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("time per call (s, slowest rank)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(a, reports: list[dict], error: str | None = None) -> list[Path]:
    """Write ``--out``/cluster.json (the reports gathered, and ``error`` when the run stopped
    early) and, if there is a report, ``--out``/cluster.png; the paths written."""
    a.out.mkdir(parents=True, exist_ok=True)
    doc = {"argv": sys.argv, "reports": reports}
    if error is not None:
        doc["error"] = error
    paths = [a.out / "cluster.json"]
    paths[0].write_text(json.dumps(doc, indent=1) + "\n")
    if reports:
        plot(reports, a.out / "cluster.png")
        paths.append(a.out / "cluster.png")
    return paths


def main(argv=None) -> int:
    a = _args(argv)
    reports = []
    try:
        # Named as a cluster run's scratch folder, so that spardl.cluster.sweep (which every
        # later run calls) removes it if this process is killed before it can.
        prefix = f"spardl-{os.getpid()}-{secrets.token_hex(3)}-bench-"
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            for bw in a.bandwidth:
                for nodes, per in a.layout:
                    rep = run_one(bw, nodes, per, a, Path(tmp))
                    reports.append(rep)
                    lat = rep["latency_s"]
                    print(
                        f"\n### {nodes} nodes × {per} rank(s), {bw} links"
                        + ("" if lat is None else f" (one-way latency {lat * 1e6:.0f} µs)")
                        + f", n = {a.n}\n"
                    )
                    print(table(rep), flush=True)
    except RuntimeError as e:  # a configuration failed: keep what the earlier ones measured
        paths = write_results(a, reports, str(e))
        print(
            f"cluster.py: error: {e}; wrote the {len(reports)} earlier configuration(s) "
            f"to {paths[0]}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    paths = write_results(a, reports)
    print(f"\nwrote {' and '.join(map(str, paths))}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "cluster.py"))
