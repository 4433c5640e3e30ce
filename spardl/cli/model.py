"""``spardl model`` and ``spardl bench pingpong``: projections with the α-β model, and its fit.

``spardl model`` prints (and plots) the predicted communication time of one step of every
algorithm against P, from the closed forms of :mod:`spardl.cost_model`; for SparDL it picks the
best number of teams d at each P. No MPI is needed. ``spardl bench pingpong`` (under
``mpiexec -n 2``) fits α and β on this machine (:mod:`spardl.pingpong`).

Examples::

    spardl model --model bert-base --density 0.01 --network ethernet-10g --P 2-4096 --plot b.png
    spardl model --n 25000000 --P 8,64,256 --json
    mpiexec -n 2 spardl bench pingpong --json pingpong.json
"""

from __future__ import annotations

import json
import math
import sys

from .common import POSITIVE_INT, option_type, plot_file, run_collective

__all__ = [
    "MODELS",
    "add_model",
    "add_bench",
    "parse_P",
    "teams_candidates",
    "project",
    "model_main",
]

#: Parameter counts of common models (the n of one flat gradient).
MODELS = {
    # VGG-16 for CIFAR-10 (13 conv layers + a 512-wide classifier), the SparDL paper's VGG-16
    # workload: 14.7 M parameters.
    "vgg16": 14_728_266,
    # ResNet-50 for ImageNet (torchvision.models.resnet50): 25 557 032 parameters.
    "resnet50": 25_557_032,
    # BERT-base (12 layers, hidden 768), as usually quoted: 110 M parameters.
    "bert-base": 110_000_000,
}


def parse_P(text: str) -> list[int]:
    """World sizes from ``"256"``, ``"8,64,256"`` or a range ``"2-4096"``.

    A range gives every power of two inside it, plus both ends.

    Raises
    ------
    ValueError
        If a value is not an integer in [1, 2**31 − 1] or a range is empty.
    """
    from .._checks import MAX_WORLD_SIZE  # with numpy: not when spardl.cli is imported

    out: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(v) for v in part.split("-", 1))
                if lo < 1 or hi < lo or hi > MAX_WORLD_SIZE:
                    raise ValueError
                out.update({lo, hi})
                p = 1
                while p <= hi:
                    if p >= lo:
                        out.add(p)
                    p *= 2
            else:
                v = int(part)
                if not 1 <= v <= MAX_WORLD_SIZE:
                    raise ValueError
                out.add(v)
        except ValueError:
            raise ValueError(
                "--P must be integers in [1, 2**31 - 1] (world sizes), a comma list or a range "
                f"like 2-4096; got {text!r}"
            ) from None
    if not out:
        raise ValueError(f"--P is empty: {text!r}")
    return sorted(out)


def teams_candidates(P: int) -> list[int]:
    """SparDL's d to try at P: every divisor for P ≤ 64, else the powers of two dividing P."""
    if P <= 64:
        return [d for d in range(1, P + 1) if P % d == 0]
    return [d for d in (1 << i for i in range(P.bit_length())) if P % d == 0]


def project(
    n: int,
    density: float,
    Ps,
    alpha: float,
    beta: float,
    gamma: float = 0.0,
    algorithms=None,
    network: str = "custom",
    sag_budget: str = "max",
) -> list[dict]:
    """Predicted seconds per step for every algorithm and P (closed forms).

    Parameters
    ----------
    n : int
        Gradient length.
    density : float
        ρ in (0, 1].
    Ps : iterable of int
        World sizes.
    alpha, beta, gamma : float
        s/message, s/byte, s/byte merged.
    algorithms : iterable of str, optional
        Default: every key of :data:`spardl.cost_model.FORMULAS`.
    network : str
        A label copied into the rows.
    sag_budget : {"max", "start"}, default "max"
        SparDL's pre-SAG budget h for d > 1 (:func:`spardl.cost_model.spardl`): "max" never
        credits teams with a volume h's adaptation may not keep.

    Returns
    -------
    list of dict
        One per (algorithm, P): ``algorithm``, ``P``, ``n``, ``density``, ``network``,
        ``alpha``, ``beta``, ``gamma``, ``teams`` (SparDL's best d, else 1), ``seconds``,
        ``messages``, ``rounds``, ``bytes`` (per rank), ``best`` (cheapest at this P).

    Raises
    ------
    ValueError, TypeError
        As :func:`spardl.cost_model.predict`.
    """
    from .. import cost_model as cm

    algorithms = sorted(cm.FORMULAS) if algorithms is None else list(algorithms)
    rates = {"alpha": alpha, "beta": beta, "gamma": gamma}
    rows = []
    for P in Ps:
        here = [_project_one(alg, P, n, density, rates, network, sag_budget) for alg in algorithms]
        _mark_cheapest(here, P)
        rows += here
    return rows


def _project_one(alg, P, n, density, rates, network, sag_budget) -> dict:
    """The row of :func:`project` for one algorithm at P; SparDL at its cheapest d."""
    from .. import cost_model as cm

    extra = {"sag_budget": sag_budget} if alg == "spardl" else {}
    best = None
    for d in teams_candidates(P) if alg == "spardl" else [1]:
        p = cm.predict(alg, P, n, density, teams=d, **rates, **extra)
        if best is None or p["seconds"] < best[1]["seconds"]:
            best = (d, p)
    d, p = best
    return {
        "algorithm": alg,
        "P": P,
        "n": n,
        "density": density,
        "network": network,
        **rates,
        "teams": d,
        "seconds": p["seconds"],
        "messages": p["messages"],
        "rounds": p["rounds"],
        "bytes": p["bytes"],
        "best": False,
    }


def _mark_cheapest(here: list[dict], P: int) -> None:
    """Set ``best`` on the cheapest row at P; ValueError if a prediction is not finite."""
    if any(not math.isfinite(r["seconds"]) for r in here):
        raise ValueError(f"the prediction at P={P} is not finite (alpha, beta or gamma too large)")
    if any(r["seconds"] > 0 for r in here):  # at P = 1 nothing is sent: no cheapest
        min(here, key=lambda r: r["seconds"])["best"] = True


def _fmt_time(s: float) -> str:
    if s == 0:
        return "0"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.3f} s"


def _table(rows) -> str:
    algs = list(dict.fromkeys(r["algorithm"] for r in rows))
    Ps = sorted({r["P"] for r in rows})
    by = {(r["algorithm"], r["P"]): r for r in rows}
    head = ["P"] + algs + ["spardl d"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for P in Ps:
        cells = [str(P)]
        for a in algs:
            r = by[(a, P)]
            cells.append(
                ("**" + _fmt_time(r["seconds"]) + "**") if r["best"] else _fmt_time(r["seconds"])
            )
        cells.append(str(by[("spardl", P)]["teams"]) if ("spardl", P) in by else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for alg in dict.fromkeys(r["algorithm"] for r in rows):
        rs = sorted((r for r in rows if r["algorithm"] == alg), key=lambda r: r["P"])
        label = alg + (" (best d)" if alg == "spardl" else "")
        ax.plot([r["P"] for r in rs], [r["seconds"] for r in rs], marker="o", ms=3, label=label)
    best = [r for r in rows if r["best"]]
    ax.scatter(
        [r["P"] for r in best],
        [r["seconds"] for r in best],
        s=80,
        facecolors="none",
        edgecolors="k",
        label="cheapest at P",
        zorder=5,
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("P (ranks)")
    ax.set_ylabel("predicted communication time per step (s)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_model(sub) -> None:
    """Register ``spardl model``."""
    from ..cost_model import FORMULAS, NETWORKS

    p = sub.add_parser(
        "model",
        help="predicted communication time per step vs P (alpha-beta model, no MPI)",
        description="Closed-form alpha-beta(-gamma) projections of every algorithm's "
        "communication time per step against P, with the cheapest algorithm per "
        "P and SparDL's best number of teams d.",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="resnet50",
        help="n from a model's parameter count (default: %(default)s)",
    )
    g.add_argument("--n", type=int, help="gradient length (instead of --model)")
    p.add_argument("--density", type=float, default=0.01, help="rho (default: %(default)s)")
    p.add_argument(
        "--network",
        choices=sorted(NETWORKS),
        default="ethernet-10g",
        help="alpha/beta preset (default: %(default)s)",
    )
    p.add_argument("--alpha", type=float, help="seconds per message (overrides the preset)")
    p.add_argument("--beta", type=float, help="seconds per byte (overrides the preset)")
    p.add_argument(
        "--gamma", type=float, default=0.0, help="seconds per byte merged (default: %(default)s)"
    )
    p.add_argument(
        "--P",
        default="2-4096",
        help="one value, a comma list or a range LO-HI (LO, HI and the powers of two between) "
        "(default: 2-4096)",
    )
    p.add_argument(
        "--algorithms", default=",".join(sorted(FORMULAS)), help="comma-separated (default: all)"
    )
    p.add_argument(
        "--sag-budget",
        choices=["max", "start"],
        default="max",
        help="SparDL's pre-SAG budget h for d > 1: 'max' = k_b (the upper bound, "
        "default), 'start' = its first value (disjoint selections)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument("--plot", metavar="PATH.png", type=plot_file, help="write a PNG of time vs P")
    p.set_defaults(func=model_main)


def model_main(args) -> int:
    """Run ``spardl model`` with parsed arguments; returns the exit code."""
    from ..cost_model import FORMULAS, NETWORKS

    try:
        Ps = parse_P(args.P)
        n = args.n if args.n is not None else MODELS[args.model]
        if n < 1:
            raise ValueError(f"--n must be >= 1, got {n}")
        algs = list(dict.fromkeys(a for a in args.algorithms.split(",") if a))
        unknown = [a for a in algs if a not in FORMULAS]
        if unknown or not algs:
            raise ValueError(f"--algorithms: unknown {unknown}; known: {sorted(FORMULAS)}")
        net = dict(NETWORKS[args.network])
        label = args.network
        for key in ("alpha", "beta"):
            v = getattr(args, key)
            if v is not None:
                net[key] = v
                label = (
                    f"{args.network} ({key} overridden)"
                    if label == args.network
                    else f"{args.network} (alpha, beta overridden)"
                )
        rows = project(
            n, args.density, Ps, net["alpha"], net["beta"], args.gamma, algs, label, args.sag_budget
        )
    except (ValueError, TypeError) as e:
        print(f"spardl model: error: {e}", file=sys.stderr)
        return 2
    what = f"n={n:,}" + (f" ({args.model})" if args.n is None else "")
    title = (
        f"{what}, density {args.density:g}, {label}: alpha={net['alpha']:.3g} s, "
        f"beta={net['beta']:.3g} s/B"
    )
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"# predicted communication time per step; {title}")
        print("# bold: the cheapest at that P; spardl at its best d (last column)")
        print(_table(rows))
    if args.plot:
        try:
            _plot(rows, args.plot, title)
        except OSError as e:  # the path was writable a moment ago
            print(f"spardl model: error: --plot: cannot write {args.plot}: {e}", file=sys.stderr)
            return 2
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


def _byte_sizes(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


# At least two distinct sizes: the fit of t = alpha + beta*s needs two points
# (spardl.pingpong.fit_alpha_beta), and finding that after the measurement would abort the job.
# At most 2**31 - 1 bytes each: MPI's counts are C ints.
BYTE_SIZES = option_type(
    _byte_sizes,
    lambda v: len(set(v)) >= 2 and min(v) >= 1 and max(v) <= 2**31 - 1,
    "comma-separated byte counts in [1, 2**31 - 1], at least two distinct",
)


def add_bench(sub) -> None:
    """Register ``spardl bench`` with its ``pingpong`` subcommand."""
    p = sub.add_parser("bench", help="micro-benchmarks (bench pingpong: fit alpha and beta)")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    q = bsub.add_parser(
        "pingpong",
        help="fit alpha, beta (and gamma) on this machine; run under mpiexec -n 2",
        description="Ping-pong between ranks 0 and 1 for sizes 8 B ... 4 MiB, least-squares "
        "fit of t = alpha + beta*s, and gamma from the merge kernel.",
    )
    q.add_argument(
        "--sizes",
        type=BYTE_SIZES,
        help="comma-separated byte sizes, at least two distinct (default: 8, 16, ..., 4194304)",
    )
    q.add_argument("--repeat", type=POSITIVE_INT, default=None, help="round trips per size")
    # Rank 0 alone writes it, so rank 0 alone checks it (spardl.pingpong.run).
    q.add_argument("--json", metavar="PATH", help="write alpha, beta, gamma and the rows")
    q.add_argument("--no-gamma", action="store_true", help="skip the merge-kernel timing")
    q.set_defaults(func=_cmd_pingpong)


def _cmd_pingpong(args) -> int:
    from .. import pingpong

    return run_collective(pingpong.run, args)
