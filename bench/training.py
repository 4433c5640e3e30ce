"""Training benchmark: sparse allreduces against the dense MPI allreduce on the digits CNN, over
shared memory or across emulated nodes, judged by accuracy and by time to accuracy.

    .venv/bin/python bench/training.py                      # P = 4 on shared memory, seed 0
    .venv/bin/python bench/training.py --seeds 0 1 2        # several seeds
    .venv/bin/python bench/training.py --bandwidth 1gbit --configs dense spardl oktopk \\
        --width 96                                          # 4 emulated nodes, 1 Gbit/s links

Every run is a separate ``mpiexec -n P python -m spardl train`` job with the same seed, epochs and
hyper-parameters; with ``--bandwidth`` each job runs on P fresh emulated nodes (one rank each,
``spardl cluster``, needs root). Prints one Markdown table (for docs/performance.md) and writes
it with the raw metrics to ``--out``/summary.json, and a time-to-accuracy plot (test accuracy
against seconds inside the training loop, evaluation excluded) to ``--out``/time-to-accuracy.png.

Each run writes to ``--out``/``<config>-rho<ρ>-seed<s>`` (``<config>-seed<s>`` for the dense
configs, which take no density). ``--reuse`` reads a run that an earlier invocation made there,
completed with the same options on the same links and host, instead of running it again, so a
table of many runs, at several densities, can be built over several invocations
(``bench-run.json`` beside each run's metrics.json records its links, job seconds, host and
commit).

"Time to dense − 1 pt" is the training time a run needs to first reach the dense run's final test
accuracy minus one point (same seed), at epoch granularity; "—" if it never does.

``--task lm`` runs the character-level transformer instead (``spardl train --task lm``, by
``--steps``): the table reports the final validation bits per character, and the time to reach
the dense run's final bits per character + 3%, at evaluation granularity.
"""

from __future__ import annotations

import hashlib
import json
import socket
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._args import (  # noqa: E402
    DENSITY,
    LEARNING_RATE,
    MAX_RANKS,
    NONNEGATIVE_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    SEED,
    Parser,
    option_type,
    output_dir,
    run_main,
)
from spardl.cli import launch_train  # noqa: E402
from spardl.cli.cluster import rate_type  # noqa: E402
from spardl.cluster import MAX_NODES, check_quick  # noqa: E402
from spardl.train import _TASK_ONLY  # noqa: E402

# P: every table compares bytes and times with the dense allreduce's, and at P = 1 no allreduce
# sends a byte (nothing to compare); MAX_RANKS is far more ranks than one machine has cores for.
WORLD_SIZE = option_type(
    int,
    lambda v: 2 <= v <= MAX_RANKS,
    f"an integer in [2, {MAX_RANKS}] (at P = 1 no allreduce sends a byte: nothing to compare)",
)

CONFIGS = {
    "spardl": ["--algorithm", "spardl", "--residual", "global"],
    "dense": ["--algorithm", "dense"],
    # The 16-bit dense allreduce: MPI's float16 sum, half of dense's bytes.
    "dense-fp16": ["--algorithm", "dense", "--wire", "fp16"],
    "spardl-local": ["--algorithm", "spardl", "--residual", "local"],
    "oktopk": ["--algorithm", "oktopk"],
    "topka": ["--algorithm", "topka"],
    "gtopk": ["--algorithm", "gtopk"],
    "gaussiank": ["--algorithm", "gaussiank"],
    "topkdsa": ["--algorithm", "topkdsa"],
    "spardl-d2": ["--algorithm", "spardl", "--teams", "2"],
    # d = 4 teams (it must divide the world size; at the default P = 4 every rank is its own
    # team): one X = g + E pass selecting the top-h, a Bruck all-gather, the top-k of the union.
    "spardl-d4": ["--algorithm", "spardl", "--teams", "4"],
    # The library's own choice among dense, SparDL (each d), Ok-Topk and TopkA (docs/design.md §12).
    "auto": ["--algorithm", "auto", "--explain"],
    # Deep Gradient Compression's techniques on SparDL (spardl.torch; arXiv 1712.01887 §3.2-3.3),
    # one at a time and together; "dgc" = momentum correction with factor masking, local
    # clipping and the density warm-up. --clip-norm and --density-warmup set their parameters.
    "spardl-mc": ["--algorithm", "spardl", "--momentum-correction"],
    "spardl-mc-nomask": ["--algorithm", "spardl", "--momentum-correction", "--no-factor-masking"],
    "spardl-clip": ["--algorithm", "spardl", "@clip"],
    "spardl-warmup": ["--algorithm", "spardl", "@warmup"],
    "spardl-dgc": ["--algorithm", "spardl", "--momentum-correction", "@clip", "@warmup"],
    "oktopk-dgc": ["--algorithm", "oktopk", "--momentum-correction", "@clip", "@warmup"],
    # Parameters of at most 1024 elements (biases, LayerNorm) reduced dense, the rest sparsely.
    "spardl-mc-dn": ["--algorithm", "spardl", "--momentum-correction", "--dense-numel", "1024"],
    "spardl-mcw-dn": [
        "--algorithm",
        "spardl",
        "--momentum-correction",
        "@warmup",
        "--dense-numel",
        "1024",
    ],
    "topka-mc": ["--algorithm", "topka", "--momentum-correction"],
    # Ok-Topk with the techniques of spardl-d4-mcw-dn below, for a like-for-like comparison.
    "oktopk-mcw-dn": [
        "--algorithm",
        "oktopk",
        "--momentum-correction",
        "@warmup",
        "--dense-numel",
        "1024",
    ],
    # The same techniques with d = 4 teams: the language model's best SparDL setting.
    "spardl-d4-mcw-dn": [
        "--algorithm",
        "spardl",
        "--teams",
        "4",
        "--momentum-correction",
        "@warmup",
        "--dense-numel",
        "1024",
    ],
}


def expand(config: list[str], clip_norm: float, density_warmup: int) -> list[str]:
    """A config's ``spardl train`` arguments with ``@clip`` / ``@warmup`` filled in."""
    out = []
    for a in config:
        if a == "@clip":
            out += ["--clip-norm", str(clip_norm)]
        elif a == "@warmup":
            out += ["--density-warmup", str(density_warmup)]
        else:
            out.append(a)
    return out


def time_to(history: list[dict], target: float) -> float | None:
    """Training seconds until the test accuracy first reaches ``target`` (None if never); for
    lm histories, until the validation bits per character first fall to ``target``."""
    t = 0.0
    for e in history:
        if "val_bits_per_char" in e:  # lm: seconds are cumulative
            if e["val_bits_per_char"] is not None and e["val_bits_per_char"] <= target:
                return e["seconds"]
            continue
        t += e["seconds"]
        if e["test_accuracy"] is not None and e["test_accuracy"] >= target:
            return t
    return None


def _curve(m: dict) -> list[tuple[float, float]]:
    """(training seconds, test accuracy % or validation bits/char) after each evaluation."""
    if m.get("task") == "lm":
        return [(e["seconds"], e["val_bits_per_char"]) for e in m["history"]]
    t, out = 0.0, []
    for e in m["history"]:
        t += e["seconds"]
        out.append((t, 100 * e["test_accuracy"]))
    return out


def _plot(rows, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    seed0 = rows[0][1]
    for label, seed, m in rows:
        if seed != seed0:
            continue
        ax.plot(*zip(*_curve(m), strict=True), marker="o", ms=3, label=label)
    dense = [m for lab, s, m in rows if lab == "dense" and s == seed0]
    lm = rows[0][2].get("task") == "lm"
    if dense:
        d = dense[0]
        target = 1.03 * d["final_val_bits_per_char"] if lm else 100 * d["final_test_accuracy"] - 1
        ax.axhline(target, color="grey", ls=":", lw=1)
    ax.set_xlabel("training seconds (evaluation excluded)")
    ax.set_ylabel("validation bits per character" if lm else "test accuracy (%)")
    if not lm:
        ax.set_ylim(80, 100)
    ax.set_title(textwrap.fill(title, 90), fontsize=9)  # a long title wraps, not clips
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _seconds(s: float | None) -> str:
    """A job's seconds for a table; "—" where unknown (a reused run made without this script)."""
    return "—" if s is None else f"{s:.1f}"


def _ratio(tt: float | None, td: float | None) -> str:
    """A run's time to the target over dense's; "—" if either never reached it."""
    return "—" if tt is None or not td else f"{tt / td:.2f}"


def _lm_table(rows, dense_by_seed: dict, where: str, density: float) -> list[str]:
    """The Markdown table of an lm run: final validation bits/char, bytes, time to dense + 3%."""
    m0 = rows[0][2]
    lines = [
        f"{where}; lm, density {density}, {m0['steps']} steps, batch "
        f"{m0['batch_size']}×{m0['context']} chars/rank, lr {m0['lr']}, {m0['n_params']} params",
        "",
        "| run | seed | val bits/char | Δ vs dense (%) | val acc | MB sent/rank "
        "| % of dense bytes | train s | time to dense + 3% (s) | × dense's time | job s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, seed, m in rows:
        d = dense_by_seed[seed]
        bpc, dense_bpc = m["final_val_bits_per_char"], d["final_val_bits_per_char"]
        frac = 100 * m["bytes_sent_per_rank"] / d["bytes_sent_per_rank"]
        target = 1.03 * dense_bpc
        tt, td = time_to(m["history"], target), time_to(d["history"], target)
        m["time_to_dense_plus_3pct"] = tt
        lines.append(
            f"| {label} | {seed} | {bpc:.3f} | {100 * (bpc / dense_bpc - 1):+.2f} "
            f"| {100 * m['final_val_accuracy']:.2f}% | {m['bytes_sent_per_rank'] / 1e6:.3f} "
            f"| {frac:.2f}% | {m['train_seconds']:.1f} | {'—' if tt is None else f'{tt:.1f}'} "
            f"| {_ratio(tt, td)} | {_seconds(m['job_seconds'])} |"
        )
    return lines


def _digits_table(rows, dense_by_seed: dict, where: str, density: float) -> list[str]:
    """The Markdown table of a digits run: final test accuracy, bytes, time to dense − 1 pt."""
    m0 = rows[0][2]
    lines = [
        f"{where}; density {density}, {m0['epochs']} epochs, "
        f"batch {m0['batch_size']}/rank, lr {m0['lr']}, {m0.get('model', 'cnn')} of "
        f"{m0['n_params']} parameters",
        "",
        "| run | seed | test acc | Δ vs dense (points) | MB sent/rank | % of dense bytes "
        "| train s | time to dense − 1 pt (s) | × dense's time | job s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, seed, m in rows:
        d = dense_by_seed[seed]
        delta = 100 * (m["final_test_accuracy"] - d["final_test_accuracy"])
        frac = 100 * m["bytes_sent_per_rank"] / d["bytes_sent_per_rank"]
        target = d["final_test_accuracy"] - 0.01
        tt, td = time_to(m["history"], target), time_to(d["history"], target)
        m["time_to_dense_minus_1pt"] = tt
        lines.append(
            f"| {label} | {seed} | {100 * m['final_test_accuracy']:.2f}% | {delta:+.2f} "
            f"| {m['bytes_sent_per_rank'] / 1e6:.3f} | {frac:.2f}% "
            f"| {m['train_seconds']:.1f} | {'—' if tt is None else f'{tt:.1f}'} "
            f"| {_ratio(tt, td)} | {_seconds(m['job_seconds'])} |"
        )
    return lines


def _args(argv):
    """The command line's options."""
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--world-size",
        "-n",
        type=WORLD_SIZE,
        default=4,
        help=f"P, 2 to {MAX_RANKS} ({MAX_NODES} with --bandwidth; default: %(default)s)",
    )
    p.add_argument("--density", type=DENSITY, default=0.01)
    p.add_argument("--seeds", type=SEED, nargs="+", default=[0])
    p.add_argument(
        "--configs",
        nargs="+",
        default=["spardl", "dense", "spardl-local"],
        choices=sorted(CONFIGS),
        help="runs per seed (default: %(default)s); dense is added if missing",
    )
    p.add_argument("--task", choices=("digits", "lm"), default="digits")
    p.add_argument("--epochs", type=POSITIVE_INT, default=None, help="default: the train default")
    p.add_argument(
        "--steps", type=POSITIVE_INT, default=None, help="lm: default: the train default"
    )
    p.add_argument(
        "--eval-every", type=POSITIVE_INT, default=None, help="lm: default: the train default"
    )
    p.add_argument(
        "--lr",
        type=LEARNING_RATE,
        default=None,
        help="peak learning rate of every run (default: the train default of the task)",
    )
    p.add_argument(
        "--lr-warmup",
        type=NONNEGATIVE_INT,
        default=None,
        help="lm: steps (default: the train default)",
    )
    p.add_argument("--model", choices=("cnn", "mlp"), default=None, help="digits: the model")
    p.add_argument(
        "--width", type=POSITIVE_INT, default=None, help="model width (default: the train one)"
    )
    p.add_argument(
        "--batch-size", type=POSITIVE_INT, default=None, help="per rank (default: the train one)"
    )
    p.add_argument(
        "--clip-norm",
        type=POSITIVE_FLOAT,
        default=4.0,
        help="C of the configs with local clipping (default: %(default)s: each rank's gradient "
        "is clipped to C/sqrt(P); the digits CNN's per-rank gradient norm is about 2)",
    )
    p.add_argument(
        "--density-warmup",
        type=NONNEGATIVE_INT,
        default=None,
        help="steps of the density warm-up in the configs that have one (default: digits 46; "
        "lm a sixth of the steps, 800 for the default 4,800)",
    )
    p.add_argument(
        "--bandwidth",
        type=rate_type,
        default=None,
        help="run on emulated nodes with this link rate",
    )
    p.add_argument("--out", type=output_dir, default="runs/bench-training")
    p.add_argument("--timeout", type=POSITIVE_FLOAT, default=900, help="per job, seconds")
    p.add_argument(
        "--reuse",
        action="store_true",
        help="read a run this script made earlier into the same directory under --out, "
        "completed with the same options on the same links and host, instead of running it "
        "again (so a long table can be built over several invocations); the code is not "
        "compared (each run's commit is in its bench-run.json): reuse runs of the same tree",
    )
    args = p.parse_args(argv)
    if args.density_warmup is None:
        from spardl import lm

        steps = args.steps if args.steps is not None else lm.DEFAULTS["steps"]
        args.density_warmup = round(steps / 6) if args.task == "lm" else 46
    # spardl train refuses an option of the other task, but only once the job has started
    for other, names in _TASK_ONLY.items():
        for name in names:
            if other != args.task and getattr(args, name, None) is not None:
                p.error(f"argument --{name.replace('_', '-')}: applies to --task {other} only")
    for label in args.configs:  # spardl train refuses teams that do not divide P, but late
        config = CONFIGS[label]
        teams = int(config[config.index("--teams") + 1]) if "--teams" in config else 1
        if args.world_size % teams:
            p.error(
                f"argument --configs: {label} needs a world size divisible by {teams}, got "
                f"--world-size {args.world_size}"
            )
    if args.bandwidth is not None:
        if args.world_size > MAX_NODES:
            p.error(
                f"argument --world-size/-n: an emulated cluster has at most {MAX_NODES} nodes "
                f"(one rank each), got {args.world_size}"
            )
        problem = check_quick()  # creates nothing
        if problem:
            p.error(f"argument --bandwidth: {problem}")
    return args


def _is_dense(label: str) -> bool:
    """Whether a config is a dense allreduce, which takes no density."""
    return CONFIGS[label][:2] == ["--algorithm", "dense"]


def run_dir(args, label: str, seed: int) -> Path:
    """Where one run writes: ``--out``/``<config>-rho<ρ>-seed<s>``, without the density for the
    dense configs, so invocations at other densities into one ``--out`` keep each other's runs
    and share the dense ones."""
    rho = "" if _is_dense(label) else f"-rho{args.density:g}"
    return args.out / f"{label}{rho}-seed{seed}"


def _train_args(args, label: str, seed: int, out: Path) -> list[str]:
    """The ``spardl train`` arguments of one run: a config at one seed, written to ``out``."""
    config = expand(CONFIGS[label], args.clip_norm, args.density_warmup)
    # The dense runs take no --density (spardl train refuses options that would do nothing).
    density = [] if _is_dense(label) else ["--density", str(args.density)]
    train_args = [
        "--task",
        args.task,
        *config,
        *density,
        "--seed",
        str(seed),
        "--out",
        str(out),
        "--no-progress",
    ]
    if args.epochs is not None:
        train_args += ["--epochs", str(args.epochs)]
    for name in ("model", "width", "batch_size", "lr", "steps", "eval_every", "lr_warmup"):
        if getattr(args, name) is not None:
            train_args += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return train_args


def _tree() -> str | None:
    """This tree's commit (short hash, "+dirty" with uncommitted changes), None outside git."""
    import subprocess

    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def _run_record(raw_metrics: bytes, bandwidth, job_seconds: float, commit: str | None) -> dict:
    """What ``bench-run.json`` says of the run just made: its links, job seconds, host and tree
    (``commit``, :func:`_tree` as the job started), and a digest of the metrics.json it wrote,
    ``raw_metrics`` (which :func:`reusable` checks)."""
    return {
        "bandwidth": bandwidth,
        "job_seconds": job_seconds,
        "host": socket.gethostname(),
        "commit": commit,
        "metrics_sha256": hashlib.sha256(raw_metrics).hexdigest(),
    }


def reusable(out: Path, train_args: list[str], world_size: int, bandwidth) -> dict | None:
    """The metrics of an earlier run in ``out`` that this one would repeat, else None.

    An earlier run counts if its metrics.json says it completed (not a run stopped early, nor one
    resumed from a checkpoint), records every option this run would record with the same value
    (:func:`spardl.train.recorded_options`), and the ``bench-run.json`` this script wrote beside
    it says it ran on the same links and host and vouches for that very metrics.json (its
    SHA-256). The code is not compared: the run's tree is in ``bench-run.json`` (``commit``)
    and in the summary; reuse runs of the same tree.
    """
    from spardl.train import recorded_options

    try:
        raw = (out / "metrics.json").read_bytes()
        m = json.loads(raw)
        ran = json.loads((out / "bench-run.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or not isinstance(ran, dict):
        return None
    if m.get("completed") is not True or "resumed_from" in m:
        return None
    if ran.get("metrics_sha256") != hashlib.sha256(raw).hexdigest():
        return None  # metrics.json was written again since
    if ran.get("bandwidth") != bandwidth or ran.get("host") != socket.gethostname():
        return None
    expected = recorded_options(train_args, world_size)
    if any(k not in m or m[k] != v for k, v in expected.items()):
        return None
    m["job_seconds"] = ran.get("job_seconds")
    m["commit"] = ran.get("commit")
    return m


def _run_all(args, configs: list[str]) -> list[tuple[str, int, dict]]:
    """Run every config at every seed as its own job (or, with ``--reuse``, read a run that
    :func:`reusable` accepts); (label, seed, metrics) per run."""
    rows = []
    for seed in args.seeds:
        for label in configs:
            out = run_dir(args, label, seed)
            train_args = _train_args(args, label, seed, out)
            m = reusable(out, train_args, args.world_size, args.bandwidth) if args.reuse else None
            if m is not None:
                print(
                    f"reusing {out}: a completed run with these options (tree {m['commit']})",
                    flush=True,
                )
            else:
                (out / "bench-run.json").unlink(missing_ok=True)  # vouches for no new run
                commit = _tree()  # the tree the job starts from, whatever changes meanwhile
                job_s = launch_train(args.world_size, train_args, args.timeout, args.bandwidth)
                raw = (out / "metrics.json").read_bytes()
                record = _run_record(raw, args.bandwidth, job_s, commit)
                (out / "bench-run.json").write_text(json.dumps(record) + "\n")
                m = json.loads(raw)
                m["job_seconds"], m["commit"] = job_s, record["commit"]
            rows.append((label, seed, m))
    return rows


def _write_summary(args, argv, rows, table: str) -> None:
    """Write the command, the table and every run's metrics to ``--out``/summary.json."""
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


def main(argv=None) -> int:
    """Run every config and seed, print the table, write the plot and summary.json."""
    args = _args(argv)
    configs = list(dict.fromkeys(["dense", *args.configs]))
    try:
        rows = _run_all(args, configs)
    except RuntimeError as e:  # a job that failed or timed out (ClusterError too): one line
        print(f"training.py: error: {e}", file=sys.stderr, flush=True)
        return 1
    dense_by_seed = {s: m for lab, s, m in rows if lab == "dense"}
    where = (
        f"{args.world_size} emulated nodes, {args.bandwidth} links"
        if args.bandwidth
        else f"P = {args.world_size}, shared memory"
    )
    table_of = _lm_table if args.task == "lm" else _digits_table
    lines = table_of(rows, dense_by_seed, where, args.density)
    table = "\n".join(lines)
    print()
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    _plot(rows, args.out / "time-to-accuracy.png", lines[0])
    _write_summary(args, argv, rows, table)
    print(f"\nwrote {args.out / 'summary.json'} and {args.out / 'time-to-accuracy.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "training.py"))
