"""The ``spardl`` command line: ``spardl {train,demo,info}`` (``python -m spardl`` too).

Each subcommand is one ``add_<name>(subparsers)`` function that registers its parser and sets
``func`` (called with the parsed arguments, returns an exit code). To add a subcommand, write such
a function and append it to :data:`COMMANDS`. Keep module-level imports light: ``spardl --help``
must not import torch.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from .mpiexec import mpiexec_path

__all__ = ["COMMANDS", "build_parser", "main", "mpiexec_path", "run_collective"]


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def launcher_rank() -> int | None:
    """This process's rank as the MPI launcher set it in the environment (MPICH/Hydra, Open MPI,
    PMIx, Slurm), without initialising MPI; None when not launched by one."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        v = os.environ.get(var)
        if v is not None and v.strip().isdigit():
            return int(v)
    return None


class _Parser(argparse.ArgumentParser):
    """argparse, but under an MPI launcher a usage error is one line, printed by rank 0 only
    (every rank still exits with status 2 before MPI is used)."""

    def error(self, message):
        rank = launcher_rank()
        if rank is None:
            super().error(message)
        self.exit(2, f"{self.prog}: error: {message}\n" if rank == 0 else None)


def run_collective(fn, *args, prog: str = "spardl") -> int:
    """Run ``fn(*args, world)`` on every rank; an exception on any rank ends the whole job.

    Under ``mpiexec`` a rank that raises would leave the others blocked in their next collective,
    so the failing rank prints its traceback and aborts the MPI job (every rank exits non-zero
    within seconds; :func:`spardl.abort_on_exception`).
    """
    from .comm import abort_on_exception
    from .train import UsageError

    world = _world()
    try:
        with abort_on_exception(world, reraise=UsageError):
            fn(*args, world)
    except UsageError as e:  # raised by every rank before any communication: no abort needed
        if world.Get_rank() == 0:
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


# -- train -------------------------------------------------------------------------------------
def add_train(sub) -> None:
    """``spardl train``: data-parallel CNN training on the digits data (under mpiexec)."""
    from . import train

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
    from . import train

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
        (:class:`spardl.cluster.Cluster`; needs root or CAP_NET_ADMIN). Shared memory if None.

    Raises
    ------
    RuntimeError
        If the job exits non-zero or runs past ``timeout`` seconds.
    """
    command = [sys.executable, "-m", "spardl", "train", *train_args]
    shown = " ".join(["python", *command[1:]])
    if bandwidth is not None:
        from .cluster import Cluster

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
    from .train import DENSITY, POSITIVE_FLOAT, POSITIVE_INT

    p.add_argument(
        "--world-size", "-n", type=POSITIVE_INT, default=4, help="P (default: %(default)s)"
    )
    p.add_argument("--density", type=DENSITY, default=0.01, help="default: %(default)s")
    p.add_argument("--epochs", type=POSITIVE_INT, default=None, help="default: the train default")
    p.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    p.add_argument("--out", type=Path, default=Path("runs"), help="default: %(default)s")
    p.add_argument("--timeout", type=POSITIVE_FLOAT, default=900, help="per run, seconds")
    from .cluster_cli import rate_type

    p.add_argument(
        "--bandwidth",
        type=rate_type,
        default=None,
        help="run across P emulated nodes (one rank each) whose links have this rate, tc syntax "
        "(1gbit, 100mbit); needs root or CAP_NET_ADMIN (spardl cluster check)",
    )
    p.set_defaults(func=_cmd_demo)


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
        from .cluster import check_quick

        problem = check_quick()
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
            f"{m['bytes_sent_per_rank'] / 1e6:>13.3f} {m['wall_seconds']:>8.1f} {wall:>7.1f}"
        )
    ratio = rows[0][1]["bytes_sent_per_rank"] / max(rows[1][1]["bytes_sent_per_rank"], 1)
    print(
        f"\nSparDL sends {ratio:.2%} of the dense allreduce's bytes per rank "
        f"({1 / max(ratio, 1e-12):.1f}x less)."
    )
    print("Metrics and plots: " + ", ".join(str(r[3]) for r in rows))
    return 0


# -- info --------------------------------------------------------------------------------------
def _version(module: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return None


def add_info(sub) -> None:
    """``spardl info``: versions, MPI library, CPU threads and GPUs."""
    p = sub.add_parser("info", help="versions, MPI library, CPUs and GPUs")
    p.set_defaults(func=_cmd_info)


def info_lines() -> list[tuple[str, str]]:
    """(label, value) pairs printed by ``spardl info``."""
    import numba
    import numpy

    import spardl

    rows = [
        ("spardl", spardl.__version__),
        ("python", platform.python_version()),
        ("platform", platform.platform()),
        ("numpy", numpy.__version__),
        ("numba", numba.__version__),
        ("numba-cuda", _version("numba-cuda") or "not installed"),
    ]
    try:
        import mpi4py
        from mpi4py import MPI

        lib = MPI.Get_library_version().strip().splitlines()[0]
        rows += [
            ("mpi4py", mpi4py.__version__),
            ("MPI library", lib),
            (
                "MPI vendor",
                "{} {}".format(MPI.get_vendor()[0], ".".join(map(str, MPI.get_vendor()[1]))),
            ),
            ("MPI standard", "{}.{}".format(*MPI.Get_version())),
        ]
    except ImportError as e:
        rows.append(("mpi4py", f"not available ({e})"))
    rows.append(("mpiexec", _which_mpiexec()))
    try:
        import torch

        rows.append(("torch", torch.__version__))
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        rows.append(("GPUs (torch.cuda)", ", ".join(gpus) if gpus else "none"))
    except ImportError:
        rows.append(("torch", "not installed"))
    rows.append(("GPUs (numba)", _numba_gpus()))
    rows.append(
        (
            "CPU threads",
            f"{os.cpu_count()} (usable: {len(os.sched_getaffinity(0))})"
            if hasattr(os, "sched_getaffinity")
            else str(os.cpu_count()),
        )
    )
    from .comm import cuda_aware, cuda_aware_reason

    rows.append(("CUDA-aware MPI", f"{'yes' if cuda_aware() else 'no'} ({cuda_aware_reason()})"))
    return rows


def _which_mpiexec() -> str:
    try:
        return mpiexec_path()
    except FileNotFoundError:
        return "not found"


def _numba_gpus() -> str:
    try:
        from numba import cuda

        if not cuda.is_available():
            return "none"
        return ", ".join(
            f"{d.name.decode() if isinstance(d.name, bytes) else d.name}" for d in cuda.gpus
        )
    except Exception as e:  # noqa: BLE001 - a broken driver must not break `info`
        return f"none ({type(e).__name__})"


def _cmd_info(args) -> int:
    rows = info_lines()
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


#: Subcommand registrars, in help order. Append ``add_<name>`` to add a subcommand.
def add_model(sub) -> None:
    """``spardl model``: α-β projections to thousands of ranks (``spardl.model_cli``)."""
    from .model_cli import add_model as _add

    _add(sub)


def add_bench(sub) -> None:
    """``spardl bench pingpong``: fit α and β on this machine (``spardl.model_cli``)."""
    from .model_cli import add_bench as _add

    _add(sub)


def add_cluster(sub) -> None:
    """``spardl cluster {run,check,sweep}``: emulated nodes with shaped links
    (``spardl.cluster_cli``)."""
    from .cluster_cli import add_cluster as _add

    _add(sub)


COMMANDS = [add_train, add_demo, add_info, add_model, add_bench, add_cluster]


def build_parser() -> argparse.ArgumentParser:
    """The ``spardl`` parser with every subcommand of :data:`COMMANDS`."""
    import spardl

    parser = _Parser(
        prog="spardl",
        description="Sparse gradient allreduce (SparDL, Ok-Topk and peers) over MPI.",
    )
    parser.add_argument("--version", action="version", version=f"spardl {spardl.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``spardl`` and ``python -m spardl``; returns the exit code."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
