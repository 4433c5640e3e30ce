"""`spardl train`: data-parallel training of a small CNN on real data, one MPI rank per worker.

The data are scikit-learn's handwritten digits (1,797 real 8×8 grey images, 10 classes, shipped
with scikit-learn: no download). The split into training and test sets is fixed by ``--seed``;
each rank trains on its own shard of the training set and the ranks' gradients are averaged every
step by a spardl allreducer (sparse, or the dense baseline), either in a plain training loop
(:class:`spardl.torch.SparseGradientReducer`, the papers' setup) or as a DDP communication hook.

Run it with ``mpiexec -n P python -m spardl train ...``. Determinism: the model is initialised from
``--seed`` on every rank (identical replicas), each rank shuffles its shard from (seed, rank,
epoch), torch runs one thread per rank with deterministic algorithms, so a run resumed from a
checkpoint continues bit for bit as the uninterrupted run.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

__all__ = [
    "DEFAULTS",
    "UsageError",
    "build_model",
    "load_digits_split",
    "add_arguments",
    "run",
]

#: Defaults of the training job, tuned so that SparDL at 1% density on 4 ranks reaches the
#: dense baseline's accuracy (docs/performance.md, "Training").
DEFAULTS = {
    "algorithm": "spardl",
    "density": 0.01,
    "teams": 1,
    "residual": "global",
    "epochs": 15,
    "batch_size": 16,
    "lr": 0.1,
    "momentum": 0.9,
    "width": 16,
    "seed": 0,
    "hook": "reducer",
    "test_fraction": 0.2,
}


def _checked(kind, ok, what):
    """An argparse ``type=``: ``kind(text)`` that must satisfy ``ok``, else a usage error
    (argparse names the option and exits with status 2 on every rank, before MPI is used)."""
    import argparse

    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return v

    parse.__name__ = kind.__name__  # argparse's "invalid <name> value" wording
    parse.ok, parse.what = ok, what
    return parse


DENSITY = _checked(float, lambda v: 0 < v <= 1, "a density in (0, 1]")
POSITIVE_INT = _checked(int, lambda v: v >= 1, "an integer >= 1")
NONNEGATIVE_INT = _checked(int, lambda v: v >= 0, "an integer >= 0")
POSITIVE_FLOAT = _checked(float, lambda v: v > 0 and math.isfinite(v), "a finite number > 0")
MOMENTUM = _checked(float, lambda v: 0 <= v < 1, "a momentum in [0, 1)")

#: The range-checked options (argparse dest -> type): the parser's types, and what run() checks
#: again for a Namespace built without the parser. None is allowed for the optional ones.
_RANGED = {
    "density": DENSITY,
    "teams": POSITIVE_INT,
    "epochs": POSITIVE_INT,
    "batch_size": POSITIVE_INT,
    "lr": POSITIVE_FLOAT,
    "momentum": MOMENTUM,
    "width": POSITIVE_INT,
    "warmup_steps": NONNEGATIVE_INT,
    "stop_after": POSITIVE_INT,
}
_OPTIONAL = ("warmup_steps", "stop_after")


def add_arguments(p) -> None:
    """Add the training options to an argparse parser (values range-checked at parse time)."""
    from . import ALGORITHMS

    d = DEFAULTS
    p.add_argument(
        "--algorithm",
        choices=sorted(ALGORITHMS),
        default=d["algorithm"],
        help="allreduce algorithm (default: %(default)s)",
    )
    p.add_argument(
        "--density",
        type=_RANGED["density"],
        default=d["density"],
        help="ρ, fraction of gradient entries sent (default: %(default)s)",
    )
    p.add_argument(
        "--teams",
        type=_RANGED["teams"],
        default=d["teams"],
        help="d, SparDL's number of teams (spardl only; default: %(default)s)",
    )
    p.add_argument(
        "--residual",
        choices=("global", "local", "none"),
        default=d["residual"],
        help="error feedback mode (default: %(default)s)",
    )
    p.add_argument(
        "--epochs", type=_RANGED["epochs"], default=d["epochs"], help="default: %(default)s"
    )
    p.add_argument(
        "--batch-size",
        type=_RANGED["batch_size"],
        default=d["batch_size"],
        help="per-rank batch size (default: %(default)s)",
    )
    p.add_argument(
        "--lr",
        type=_RANGED["lr"],
        default=d["lr"],
        help="peak SGD learning rate, cosine-annealed to 0 (default: %(default)s)",
    )
    p.add_argument(
        "--momentum",
        type=_RANGED["momentum"],
        default=d["momentum"],
        help="SGD momentum (default: %(default)s)",
    )
    p.add_argument(
        "--width",
        type=_RANGED["width"],
        default=d["width"],
        help="channels of the first convolution (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=d["seed"], help="default: %(default)s")
    p.add_argument(
        "--warmup-steps",
        type=_RANGED["warmup_steps"],
        default=None,
        help="dense allreduce for the first steps (default: 0 with the reducer, "
        "2 with the DDP hook)",
    )
    p.add_argument(
        "--hook",
        choices=("reducer", "ddp"),
        default=d["hook"],
        help="plain loop with SparseGradientReducer, or DDP with the comm hook "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="write DIR/metrics.json and DIR/training.png"
    )
    p.add_argument(
        "--checkpoint", type=Path, default=None, help="save PATH.rank{r}.pt after every epoch"
    )
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="resume from PATH.rank{r}.pt (written by --checkpoint)",
    )
    p.add_argument(
        "--stop-after",
        type=_RANGED["stop_after"],
        default=None,
        metavar="EPOCHS",
        help="stop after this many epochs as if interrupted (the schedule still "
        "spans --epochs; resume with --resume)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


class UsageError(ValueError):
    """An invalid option, found from the options and P alone: the same on every rank, before
    any communication, so every rank can report it and exit without aborting the job."""


def _check_args(args, P: int) -> None:
    for name, kind in _RANGED.items():
        v = getattr(args, name)
        if not (v is None and name in _OPTIONAL) and not kind.ok(v):
            raise UsageError(f"--{name.replace('_', '-')} must be {kind.what}, got {v}")
    if args.stop_after is not None and args.stop_after > args.epochs:
        raise UsageError(
            f"--stop-after must be in [1, --epochs={args.epochs}], got {args.stop_after}"
        )
    if args.algorithm != "spardl" and args.teams != 1:
        raise UsageError(f"--teams applies to --algorithm spardl only, got {args.teams}")
    if args.algorithm == "spardl" and P % args.teams:
        raise UsageError(f"--teams must divide the number of ranks P={P}, got {args.teams}")


def _check_paths(args, job) -> None:
    """Collective: every file option usable on every rank, else UsageError on every rank.

    Checked before training so that a typo ends the job at once, not at the first checkpoint or
    after the last epoch: ``--resume`` exists for this rank, the directories of ``--out``
    (rank 0 writes it) and ``--checkpoint`` (every rank writes its own file) can be made.
    """
    problem = None
    try:
        resume = None if args.resume is None else _ckpt_path(args.resume, job.rank)
        if resume is not None and not resume.exists():
            problem = f"--resume: no checkpoint {resume}"
        elif args.out is not None and job.rank == 0:
            args.out.mkdir(parents=True, exist_ok=True)
        if problem is None and args.checkpoint is not None:
            args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        problem = f"cannot create a directory for --out or --checkpoint: {e}"
    problems = job.allgather_object(problem)
    bad = [(r, p) for r, p in enumerate(problems) if p is not None]
    if bad:
        r, p = bad[0]
        raise UsageError(f"{p} (rank {r}" + (f" and {len(bad) - 1} more)" if len(bad) > 1 else ")"))


def build_model(width: int = 16):
    """A small CNN for 1×8×8 images, 10 classes.

    conv(1→w, 3×3) · ReLU · conv(w→2w, 3×3) · ReLU · max-pool 2 · linear(2w·16 → 64) · ReLU ·
    linear(64 → 10). With w = 16: 38,122 parameters.
    """
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * 16, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def load_digits_split(seed: int, test_fraction: float = 0.2):
    """The digits data set, split into train and test sets (stratified, fixed by ``seed``).

    Returns
    -------
    x_train, y_train, x_test, y_test : ndarray
        Images as float32 arrays of shape (m, 1, 8, 8) scaled to [0, 1]; labels int64 (m,).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = y.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return x_tr, y_tr, x_te, y_te


def _ckpt_path(base: Path, rank: int) -> Path:
    return Path(f"{base}.rank{rank}.pt")


def lr_at(lr: float, t: int, total: int) -> float:
    """Cosine-annealed learning rate at step t of ``total``: lr·½(1 + cos(π·t/total)).

    A function of the step alone (no scheduler state), so a resumed run follows the same
    schedule. The decay also settles the final accuracy, which matters when comparing a sparse
    run with the dense one at the last epoch.
    """
    return lr * 0.5 * (1.0 + math.cos(math.pi * t / max(total, 1)))


def _set_lr(opt, lr: float, t: int, total: int) -> None:
    for group in opt.param_groups:
        group["lr"] = lr_at(lr, t, total)


def _accuracy(model, x, y) -> float:
    import torch

    with torch.no_grad():
        pred = model(x).argmax(dim=1)
    return float((pred == y).float().mean())


def run(args, world) -> dict | None:
    """Train under MPI; collective over ``world`` (an mpi4py intracommunicator).

    Parameters
    ----------
    args : argparse.Namespace
        The options of :func:`add_arguments`.
    world : mpi4py.MPI.Intracomm
        The ranks of the job (P = its size).

    Returns
    -------
    dict or None
        The metrics on rank 0 (also written to ``args.out/metrics.json``), None elsewhere.

    Raises
    ------
    UsageError
        A subclass of ValueError, on every rank before training: an option out of range,
        ``--teams`` not dividing P, or (checked collectively) a ``--resume`` checkpoint missing
        on some rank or an ``--out`` / ``--checkpoint`` directory that cannot be made.
    ValueError, TypeError
        The allreducer's own checks, on every rank.
    """
    import torch
    import torch.nn.functional as F

    from .comm import Comm
    from .torch import SparseGradientReducer, SparseHookState, sparse_allreduce_hook

    _check_args(args, world.Get_size())
    t_start = time.perf_counter()
    torch.set_num_threads(1)  # P ranks share the machine's cores
    torch.use_deterministic_algorithms(True)
    job = Comm(world)  # the job's own small collectives, kept out of the allreducer's counters
    rank, P = job.rank, job.size
    _check_paths(args, job)

    x_tr, y_tr, x_te, y_te = load_digits_split(args.seed, DEFAULTS["test_fraction"])
    shard = np.arange(rank, len(x_tr), P)  # rank r trains on samples r, r+P, ...
    x_sh = torch.from_numpy(x_tr[shard])
    y_sh = torch.from_numpy(y_tr[shard])
    x_te_t, y_te_t = torch.from_numpy(x_te), torch.from_numpy(y_te)
    # Every rank takes the same number of steps (a collective per step): the smallest shard.
    steps_per_epoch = math.ceil((len(x_tr) // P) / args.batch_size)

    torch.manual_seed(args.seed)  # identical initial replicas on every rank
    model = build_model(args.width)
    n_params = sum(p.numel() for p in model.parameters())
    options = {"density": args.density, "residual": args.residual}
    if args.algorithm == "spardl":
        options["teams"] = args.teams

    if args.hook == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        from .torch import init_process_group_from_mpi

        init_process_group_from_mpi(world)
        warm = 2 if args.warmup_steps is None else args.warmup_steps
        hook_state = SparseHookState(
            world, args.algorithm, warmup_steps=warm, model=model, **options
        )
        net = DDP(model)
        net.register_comm_hook(hook_state, sparse_allreduce_hook)
        reducer = None
        stats = hook_state.stats
    else:
        warm = 0 if args.warmup_steps is None else args.warmup_steps
        reducer = SparseGradientReducer(
            model.named_parameters(), world, args.algorithm, warmup_steps=warm, **options
        )
        net = model
        stats = reducer.stats
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    history: list[dict] = []
    start_epoch = 0
    if args.resume is not None:
        ck = torch.load(_ckpt_path(args.resume, rank), weights_only=False)  # exists: _check_paths
        if (ck["world_size"], ck["algorithm"]) != (P, args.algorithm):
            raise ValueError(
                f"--resume: checkpoint is for P={ck['world_size']}, {ck['algorithm']}; "
                f"this run has P={P}, {args.algorithm}"
            )
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        (reducer if reducer is not None else hook_state).load_state_dict(ck["reducer"])
        history = ck["history"]
        start_epoch = ck["epoch"]
        t_start -= ck.get("elapsed", 0.0)

    last_epoch = args.epochs if args.stop_after is None else args.stop_after
    progress = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(
            total=max(0, last_epoch - start_epoch) * steps_per_epoch,
            unit="step",
            leave=False,
            dynamic_ncols=True,
        )
    log = progress.write if progress is not None else print
    if rank == 0:
        log(
            f"spardl train: {args.algorithm} P={P} density={args.density} n={n_params} "
            f"params, {len(x_tr)} train / {len(x_te)} test images, {steps_per_epoch} steps/epoch"
        )

    for epoch in range(start_epoch, last_epoch):
        t_epoch = time.perf_counter()
        order = np.random.default_rng([args.seed, rank, epoch]).permutation(len(x_sh))
        order = torch.from_numpy(order)
        model.train()
        loss_sum = 0.0
        for s in range(steps_per_epoch):
            idx = order[s * args.batch_size : (s + 1) * args.batch_size]
            _set_lr(opt, args.lr, epoch * steps_per_epoch + s, args.epochs * steps_per_epoch)
            opt.zero_grad(set_to_none=False)
            loss = F.cross_entropy(net(x_sh[idx]), y_sh[idx])
            loss.backward()
            if reducer is not None:
                reducer.reduce()
            opt.step()
            loss_sum += loss.detach().item()
            if progress is not None:
                progress.update()
        mean_loss = float(job.allreduce(np.array([loss_sum / steps_per_epoch]))[0] / P)
        sent = job.allgather_array(np.array([stats["bytes_sent"]], dtype=np.int64))[:, 0]
        entry = {
            "epoch": epoch + 1,
            "loss": mean_loss,
            "test_accuracy": None,
            "bytes_sent_per_rank": float(sent.mean()),
            "seconds": time.perf_counter() - t_epoch,
        }
        if rank == 0:
            model.eval()
            entry["test_accuracy"] = _accuracy(model, x_te_t, y_te_t)
            log(
                f"epoch {epoch + 1:3d}/{args.epochs}  loss {mean_loss:.4f}  "
                f"test acc {entry['test_accuracy']:.2%}  "
                f"sent/rank {entry['bytes_sent_per_rank'] / 1e6:.3f} MB  "
                f"time {entry['seconds']:.1f}s"
            )
        history.append(entry)
        if args.checkpoint is not None:
            args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
            ck = {
                "epoch": epoch + 1,
                "world_size": P,
                "rank": rank,
                "algorithm": args.algorithm,
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "reducer": (reducer if reducer is not None else hook_state).state_dict(),
                "history": history,
                "elapsed": time.perf_counter() - t_start,
            }
            torch.save(ck, _ckpt_path(args.checkpoint, rank))
    if progress is not None:
        progress.close()
    wall = time.perf_counter() - t_start
    sent = job.allgather_array(np.array([stats["bytes_sent"]], dtype=np.int64))[:, 0]
    if reducer is None:
        import torch.distributed as dist

        dist.destroy_process_group()
    job.free()
    if rank != 0:
        return None

    metrics = {
        "algorithm": args.algorithm,
        "world_size": P,
        "density": args.density,
        "teams": args.teams,
        "residual": args.residual,
        "hook": args.hook,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "momentum": args.momentum,
        "width": args.width,
        "seed": args.seed,
        "n_params": n_params,
        "steps_per_epoch": steps_per_epoch,
        "final_test_accuracy": history[-1]["test_accuracy"] if history else None,
        "wall_seconds": wall,
        "bytes_sent_per_rank": float(sent.mean()),
        "bytes_sent_by_rank": [int(b) for b in sent],
        "history": history,
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        _plot(metrics, args.out / "training.png")
        log(f"wrote {args.out / 'metrics.json'} and {args.out / 'training.png'}")
    return metrics


def _plot(metrics: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = metrics["history"]
    ep = [e["epoch"] for e in h]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
    a1.plot(ep, [100 * e["test_accuracy"] for e in h], marker="o")
    a1.set_xlabel("epoch")
    a1.set_ylabel("test accuracy (%)")
    a1.grid(alpha=0.3)
    a2.plot(ep, [e["bytes_sent_per_rank"] / 1e6 for e in h], marker="o")
    a2.set_xlabel("epoch")
    a2.set_ylabel("bytes sent per rank (MB, cumulative)")
    a2.grid(alpha=0.3)
    fig.suptitle(f"{metrics['algorithm']}, P={metrics['world_size']}, density={metrics['density']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
