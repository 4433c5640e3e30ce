"""``spardl train`` (the training job of :mod:`spardl.train`, under mpiexec) and ``spardl demo``
(that job twice, SparDL beside the dense baseline)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from ..mpiexec import mpiexec_path
from .cluster import rate_type
from .common import (
    DENSITY,
    MAX_RANKS,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    SEED,
    option_type,
    output_dir,
    run_collective,
)

__all__ = ["add_train", "add_demo", "launch_train"]


# -- train -------------------------------------------------------------------------------------
def add_train(sub) -> None:
    """``spardl train``: data-parallel CNN training on the digits data (under mpiexec)."""
    from .. import train

    p = sub.add_parser(
        "train",
        help="data-parallel training on real data (run under mpiexec -n P)",
        description="Data-parallel training of a small CNN on scikit-learn's digits (8x8 "
        "images), or with --task lm of a character-level transformer on CPython's "
        "pydoc_data.topics, each MPI rank on its shard, gradients averaged by a spardl "
        "allreducer. Run as: mpiexec -n 4 python -m spardl train --out runs/x",
    )
    train.add_arguments(p)
    p.set_defaults(func=_cmd_train)


def _cmd_train(args) -> int:
    from .. import train

    return run_collective(train.run, args, prog="spardl train")


# -- demo --------------------------------------------------------------------------------------
def launch_train(
    world_size: int, train_args: list[str], timeout: float, bandwidth: str | None = None
) -> float:
    """Run ``mpiexec -n P python -m spardl train ARGS``; returns its wall time in seconds.

    Parameters
    ----------
    world_size : int
        P.
    train_args : list of str
        Arguments of ``spardl train``.
    timeout : float
        Seconds.
    bandwidth : str, optional
        Run on P emulated nodes (one rank each) whose links have this rate, in ``tc`` syntax
        (:class:`spardl.cluster.Cluster`; needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN).
        Shared memory if None.

    Raises
    ------
    RuntimeError
        If the job exits non-zero or runs past ``timeout`` seconds.
    """
    command = [sys.executable, "-m", "spardl", "train", *train_args]
    shown = " ".join(["python", *command[1:]])
    if bandwidth is not None:
        from ..cluster import Cluster

        print(f"$ spardl cluster run --nodes {world_size} --bandwidth {bandwidth} -- {shown}")
        with Cluster(world_size, bandwidth=bandwidth) as cl:
            t0 = time.perf_counter()
            proc = cl.run(command, timeout=timeout)
            wall = time.perf_counter() - t0
        if proc.returncode == 124:
            raise RuntimeError(f"training job timed out after {timeout:g} s")
    else:
        cmd = [mpiexec_path(), "-n", str(world_size), *command]
        env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        print(f"$ mpiexec -n {world_size} {shown}", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"training job timed out after {timeout:g} s") from e
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"training job exited with code {proc.returncode}")
    return wall


def add_demo(sub) -> None:
    """``spardl demo``: SparDL at 1% beside the dense baseline (what ``make train`` runs)."""
    p = sub.add_parser(
        "demo",
        help="train with SparDL at 1%% density and with the dense baseline, compare",
        description="Spawns mpiexec -n P python -m spardl train twice (SparDL at the given "
        "density, then the dense allreduce), same seed and epochs, and prints "
        "accuracy, bytes per rank and wall time side by side.",
    )
    p.add_argument(
        "--world-size",
        "-n",
        type=option_type(int, lambda v: 1 <= v <= MAX_RANKS, f"an integer in [1, {MAX_RANKS}]"),
        default=4,
        help=f"P, 1 to {MAX_RANKS}; with --bandwidth, one node each: at most 250 "
        "(default: %(default)s)",
    )
    p.add_argument("--density", type=DENSITY, default=0.01, help="default: %(default)s")
    p.add_argument("--epochs", type=POSITIVE_INT, default=None, help="default: the train default")
    p.add_argument("--seed", type=SEED, default=0, help="default: %(default)s")
    p.add_argument("--out", type=output_dir, default=Path("runs"), help="default: %(default)s")
    p.add_argument("--timeout", type=POSITIVE_FLOAT, default=900, help="per run, seconds")
    p.add_argument(
        "--bandwidth",
        type=rate_type,
        default=None,
        help="run across P emulated nodes (one rank each) whose links have this rate, tc syntax "
        "(1gbit, 100mbit); needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN (spardl cluster check)",
    )
    p.set_defaults(func=_cmd_demo)


def bytes_sentence(sparse: int, dense: int) -> str:
    """The demo's summary of bytes: SparDL's bytes per rank as a share of the dense allreduce's.

    Parameters
    ----------
    sparse, dense : int
        Bytes sent per rank by the SparDL run and by the dense run (metrics.json's
        ``bytes_sent_per_rank``), ≥ 0.

    Returns
    -------
    str
        One sentence; at P = 1, where neither sends anything, it says so instead of a ratio.
    """
    if dense == 0:
        return "At P = 1 no allreduce sends a byte: run with --world-size ≥ 2 to compare bytes."
    if not sparse:
        how = "nothing sent"
    elif sparse < dense:
        how = f"{dense / sparse:.1f}x less"
    elif sparse > dense:  # a density near 1: indices beside every value
        how = f"{sparse / dense:.1f}x more"
    else:
        how = "as many"
    return f"SparDL sends {sparse / dense:.2%} of the dense allreduce's bytes per rank ({how})."


def _cmd_demo(args) -> int:
    import json

    common = ["--seed", str(args.seed)]
    if args.epochs is not None:
        common += ["--epochs", str(args.epochs)]
    runs = [
        ("spardl", ["--algorithm", "spardl", "--density", str(args.density)]),
        ("dense", ["--algorithm", "dense"]),
    ]
    bandwidth = getattr(args, "bandwidth", None)
    if bandwidth is not None:
        from ..cluster import MAX_NODES, check_quick

        problem = check_quick()
        if args.world_size > MAX_NODES:  # one node per rank
            problem = f"at most {MAX_NODES} emulated nodes, and --world-size is {args.world_size}"
        if problem:
            print(f"spardl demo: error: --bandwidth: {problem}", file=sys.stderr)
            return 2
    rows = []
    for name, extra in runs:
        out = args.out / f"{name}-P{args.world_size}"
        train_args = [*extra, *common, "--out", str(out)]
        try:
            wall = launch_train(args.world_size, train_args, args.timeout, bandwidth)
        except (RuntimeError, FileNotFoundError) as e:
            print(f"spardl demo: {name}: {e}", file=sys.stderr)
            return 1
        m = json.loads((out / "metrics.json").read_text())
        rows.append((name, m, wall, out))
    print()
    print(
        f"P = {args.world_size}, seed {args.seed}, {rows[0][1]['epochs']} epochs, "
        f"{rows[0][1]['n_params']} parameters, "
        + (
            f"{args.world_size} emulated nodes with {bandwidth} links"
            if bandwidth
            else "shared memory"
        )
    )
    head = (
        f"{'algorithm':<10} {'density':>8} {'test acc':>9} {'MB sent/rank':>13} "
        f"{'train s':>8} {'job s':>7}"
    )
    print(head)
    print("-" * len(head))
    for name, m, wall, _ in rows:
        dens = f"{m['density']:.3g}" if name != "dense" else "1"
        print(
            f"{name:<10} {dens:>8} {m['final_test_accuracy']:>9.2%} "
            f"{m['bytes_sent_per_rank'] / 1e6:>13.3f} {m['train_seconds']:>8.1f} {wall:>7.1f}"
        )
    print(
        "train s: the training steps on rank 0 (evaluation excluded); job s: the whole mpiexec "
        "job, start-up included."
    )
    print("\n" + bytes_sentence(*(r[1]["bytes_sent_per_rank"] for r in rows[:2])))
    print("Metrics and plots: " + ", ".join(str(r[3]) for r in rows))
    return 0
