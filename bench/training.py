"""Training acceptance benchmark: SparDL at 1% vs the dense allreduce, plus the local-residual
ablation, on the digits CNN under ``mpiexec -n P`` (the ``make train`` configuration).

    .venv/bin/python bench/training.py                # P = 4, seed 0
    .venv/bin/python bench/training.py --seeds 0 1 2  # several seeds

Every run is a separate ``mpiexec -n P python -m spardl train`` job with the same seed and
epochs. Prints one Markdown table (for docs/performance.md, "Training") and writes it with the
raw metrics to ``--out``/summary.json. "job s" is the wall time of the whole mpiexec job
(start-up included), "train s" the time inside the training loop.

Goals (docs/performance.md, "Training"): SparDL accuracy ≥ dense − 1 point and ≥ 95%; the SparDL
job ≤ 90 s on the 2-core development machine; SparDL bytes per rank ≤ 5% of dense.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spardl.cli import launch_train

CONFIGS = [
    ("spardl", ["--algorithm", "spardl", "--residual", "global"]),
    ("dense", ["--algorithm", "dense"]),
    ("spardl, residual=local", ["--algorithm", "spardl", "--residual", "local"]),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", "-n", type=int, default=4)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--epochs", type=int, default=None, help="default: the train default")
    p.add_argument("--out", type=Path, default=Path("runs/bench-training"))
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args(argv)

    rows = []
    for seed in args.seeds:
        for label, extra in CONFIGS:
            tag = label.replace(", ", "-").replace("=", "-")
            out = args.out / f"{tag}-seed{seed}"
            train_args = [
                *extra,
                "--density",
                str(args.density),
                "--seed",
                str(seed),
                "--out",
                str(out),
                "--no-progress",
            ]
            if args.epochs is not None:
                train_args += ["--epochs", str(args.epochs)]
            job_s = launch_train(args.world_size, train_args, args.timeout)
            m = json.loads((out / "metrics.json").read_text())
            m["job_seconds"] = job_s
            rows.append((label, seed, m))

    dense_by_seed = {s: m for lab, s, m in rows if lab == "dense"}
    lines = [
        f"P = {args.world_size}, density {args.density}, "
        f"{rows[0][2]['epochs']} epochs, batch {rows[0][2]['batch_size']}/rank, "
        f"lr {rows[0][2]['lr']}, {rows[0][2]['n_params']} parameters",
        "",
        "| run | seed | test acc | Δ vs dense (points) | MB sent/rank | % of dense bytes "
        "| train s | job s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, seed, m in rows:
        d = dense_by_seed[seed]
        delta = 100 * (m["final_test_accuracy"] - d["final_test_accuracy"])
        frac = 100 * m["bytes_sent_per_rank"] / d["bytes_sent_per_rank"]
        lines.append(
            f"| {label} | {seed} | {100 * m['final_test_accuracy']:.2f}% | {delta:+.2f} "
            f"| {m['bytes_sent_per_rank'] / 1e6:.3f} | {frac:.2f}% "
            f"| {m['wall_seconds']:.1f} | {m['job_seconds']:.1f} |"
        )
    table = "\n".join(lines)
    print()
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(
        json.dumps(
            {
                "command": " ".join(["bench/training.py", *(argv or sys.argv[1:])]),
                "table": table,
                "runs": [{"label": lab, "seed": s, **m} for lab, s, m in rows],
            },
            indent=1,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
