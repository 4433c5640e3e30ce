"""`spardl train`: data-parallel training on real data, one MPI rank per worker.

Two tasks. ``--task digits`` (the default) trains a small CNN on scikit-learn's handwritten digits
(1,797 real 8×8 grey images, 10 classes, shipped with scikit-learn: no download), by epochs.
``--task lm`` trains a small character-level transformer language model on CPython's reference
documentation (``pydoc_data.topics``), by steps (:mod:`spardl.lm`). The split into training and
held-out sets is fixed by ``--seed``; each rank trains on its own shard of the training set and
the ranks' gradients are averaged every step by a spardl allreducer (sparse, or the dense
baseline), either in a plain training loop (:class:`spardl.torch.SparseGradientReducer`, the
papers' setup) or as a DDP communication hook.

Run it with ``mpiexec -n P python -m spardl train ...``. Determinism: the model is initialised
from ``--seed`` on every rank (identical replicas), each rank draws its batches from
(seed, rank, epoch) or (seed, rank, step), torch runs one thread per rank with deterministic
algorithms, so a run resumed from a checkpoint continues bit for bit as the uninterrupted run.
A checkpoint also resumes at another world size (another ``-n``): the allreducer's residuals are
folded into the new world and its thresholds re-estimated (:mod:`spardl.elastic`).
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from .cli.common import (
    DENSITY,
    LEARNING_RATE,
    MOMENTUM,
    NONNEGATIVE_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    SEED,
    UsageError,
    path,
)

__all__ = [
    "DEFAULTS",
    "build_model",
    "load_digits_split",
    "add_arguments",
    "recorded_options",
    "run",
]

#: Defaults of the training job (the digits task; :data:`spardl.lm.DEFAULTS` has the lm task's),
#: tuned so that SparDL at 1% density on 4 ranks reaches the dense baseline's accuracy
#: (docs/performance.md, "Training").
DEFAULTS = {
    "task": "digits",
    "algorithm": "spardl",
    "density": 0.01,
    "teams": 1,
    "residual": "global",
    "wire": "coo",
    "epochs": 15,
    "batch_size": 16,
    "lr": 0.1,
    "momentum": 0.9,
    "width": 16,
    "model": "cnn",
    "seed": 0,
    "hook": "reducer",
    "test_fraction": 0.2,
}


#: The range-checked options (argparse dest -> type): the parser's types, and what run() checks
#: again for a Namespace built without the parser. None is allowed for the optional ones.
_RANGED = {
    "density": DENSITY,
    "teams": POSITIVE_INT,
    "epochs": POSITIVE_INT,
    "batch_size": POSITIVE_INT,
    "lr": LEARNING_RATE,
    "momentum": MOMENTUM,
    "width": POSITIVE_INT,
    "warmup_steps": NONNEGATIVE_INT,
    "stop_after": POSITIVE_INT,
    "clip_norm": POSITIVE_FLOAT,
    "density_warmup": NONNEGATIVE_INT,
    "dense_numel": NONNEGATIVE_INT,
    "warmup_density": DENSITY,
    "steps": POSITIVE_INT,
    "eval_every": POSITIVE_INT,
    "layers": POSITIVE_INT,
    "heads": POSITIVE_INT,
    "context": POSITIVE_INT,
    "lr_warmup": NONNEGATIVE_INT,
}
_OPTIONAL = (
    "lr_warmup",  # lm: None until _check_args fills in its default from the checked --steps
    "warmup_steps",
    "stop_after",
    "clip_norm",
    "density_warmup",
    "warmup_density",
    "dense_numel",
)
#: Deep Gradient Compression's techniques (arXiv 1712.01887 §3.2-3.3): their defaults when a
#: Namespace built without the parser lacks them.
_DGC_DEFAULTS = {
    "momentum_correction": False,
    "no_factor_masking": False,
    "clip_norm": None,
    "density_warmup": 0,
    "warmup_density": 0.25,
    "dense_numel": 0,
}
#: Options of one task only (None unless given), and the per-task defaults filled in by run().
_TASK_ONLY = {
    "digits": ("epochs", "model"),
    "lm": ("steps", "eval_every", "layers", "heads", "context", "lr_warmup"),
}
_PER_TASK = ("epochs", "model", "batch_size", "lr", "width", *_TASK_ONLY["lm"])
#: The digits task's models (:func:`build_model`).
MODELS = ("cnn", "mlp")


def add_arguments(p) -> None:
    """Add the training options to an argparse parser (values range-checked at parse time), in
    groups: what is trained and how gradients are reduced, the schedule, the model's shape, the
    warm-up and Deep Gradient Compression's techniques, and the run's files."""
    _add_reduction_options(p)
    _add_schedule_options(p)
    _add_model_options(p)
    _add_dgc_options(p)
    _add_run_options(p)


def _add_reduction_options(p) -> None:
    """--task, --algorithm, --density, --teams, --residual."""
    from . import ALGORITHM_NAMES

    d = DEFAULTS
    p.add_argument(
        "--task",
        choices=("digits", "lm"),
        default=d["task"],
        help="digits: a CNN on scikit-learn's digits, by epochs; lm: a character-level "
        "transformer on pydoc_data.topics, by steps (default: %(default)s)",
    )
    p.add_argument(
        "--algorithm",
        choices=[*sorted(ALGORITHM_NAMES), "auto"],
        default=d["algorithm"],
        help="allreduce algorithm; auto: the one predicted fastest, chosen again as it runs "
        "(docs/design.md §12) (default: %(default)s)",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="with --algorithm auto: print its choice and every candidate's predicted and "
        "measured step at the end (rank 0), also kept in metrics.json",
    )
    p.add_argument(
        "--density",
        type=_RANGED["density"],
        default=None,
        help=f"ρ, fraction of gradient entries sent (the sparse algorithms; default: "
        f"{d['density']})",
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
        default=None,
        help=f"error feedback mode (the sparse algorithms; default: {d['residual']})",
    )
    p.add_argument(
        "--wire",
        choices=("coo", "compact", "fp16"),
        default=d["wire"],
        help="sparse message format: coo (32-bit indices and values) or compact (delta-coded "
        "indices, 16-bit values whose rounding stays in the residual; docs/design.md §2.1); "
        "fp16, --algorithm dense only: the 16-bit dense allreduce, MPI's float16 sum of the "
        "gradients scaled by a power of two (agreed by one MAX allreduce per step, so that no "
        "sum overflows) and rounded to float16, half the bytes, its rounding dropped "
        "(docs/design.md §5; default: %(default)s)",
    )


def _add_schedule_options(p) -> None:
    """Epochs or steps, batch size, learning rate, momentum."""
    from .lm import DEFAULTS as lm

    d = DEFAULTS
    p.add_argument(
        "--epochs",
        type=_RANGED["epochs"],
        default=None,
        help=f"digits only (default: {d['epochs']})",
    )
    p.add_argument(
        "--steps",
        type=_RANGED["steps"],
        default=None,
        help=f"lm only: training steps (default: {lm['steps']})",
    )
    p.add_argument(
        "--eval-every",
        type=_RANGED["eval_every"],
        default=None,
        metavar="STEPS",
        help="lm only: evaluate and checkpoint every STEPS steps and after the last "
        f"(default: {lm['eval_every']})",
    )
    p.add_argument(
        "--batch-size",
        type=_RANGED["batch_size"],
        default=None,
        help=f"per-rank batch size (default: {d['batch_size']}; lm: {lm['batch_size']} windows)",
    )
    p.add_argument(
        "--lr",
        type=_RANGED["lr"],
        default=None,
        help=f"peak learning rate, cosine-annealed to 0 (default: SGD {d['lr']}; lm: AdamW "
        f"{lm['lr']} after a linear warm-up of --lr-warmup steps)",
    )
    p.add_argument(
        "--lr-warmup",
        type=_RANGED["lr_warmup"],
        default=None,
        metavar="STEPS",
        help="lm only: steps of the learning rate's linear warm-up, in [0, --steps] (default: "
        f"{lm['lr_warmup_fraction']:.0%}% of --steps)",
    )
    p.add_argument(
        "--momentum",
        type=_RANGED["momentum"],
        default=d["momentum"],
        help="SGD momentum; lm: AdamW's beta1 (default: %(default)s)",
    )


def _add_model_options(p) -> None:
    """The model's shape (CNN width; transformer width, layers, heads, context) and the seed."""
    from .lm import DEFAULTS as lm

    d = DEFAULTS
    p.add_argument(
        "--model",
        choices=MODELS,
        default=None,
        help="digits only: cnn, a small convolutional network, or mlp, two hidden layers of "
        "--width units: one multiply-add per parameter and sample where the CNN's convolutions "
        "make dozens, so that communication, not compute, sets the step time "
        f"(default: {d['model']})",
    )
    p.add_argument(
        "--width",
        type=_RANGED["width"],
        default=None,
        help=f"channels of the first convolution (default: {d['width']}); mlp: hidden units; "
        f"lm: the model dimension (default: {lm['width']})",
    )
    p.add_argument(
        "--layers",
        type=_RANGED["layers"],
        default=None,
        help=f"lm only: transformer blocks (default: {lm['layers']})",
    )
    p.add_argument(
        "--heads",
        type=_RANGED["heads"],
        default=None,
        help=f"lm only: attention heads, dividing --width (default: {lm['heads']})",
    )
    p.add_argument(
        "--context",
        type=_RANGED["context"],
        default=None,
        help=f"lm only: characters per window (default: {lm['context']})",
    )
    p.add_argument("--seed", type=SEED, default=d["seed"], help="default: %(default)s")


def _add_dgc_options(p) -> None:
    """The dense warm-up and Deep Gradient Compression's techniques (arXiv 1712.01887)."""
    p.add_argument(
        "--warmup-steps",
        type=_RANGED["warmup_steps"],
        default=None,
        help="dense allreduce for the first steps (default: 0 with the reducer, "
        "2 with the DDP hook)",
    )
    p.add_argument(
        "--momentum-correction",
        action="store_true",
        help="Deep Gradient Compression's momentum correction (arXiv 1712.01887 §3.2): each rank "
        "accumulates the velocity u = m·u + g with m = --momentum and the allreduce sparsifies "
        "u plus the residual; the optimizer then runs without momentum (lm: AdamW's beta1 = 0)",
    )
    p.add_argument(
        "--no-factor-masking",
        action="store_true",
        help="with --momentum-correction: keep u where this rank's accumulation was sent "
        "(default: momentum factor masking zeroes it there)",
    )
    p.add_argument(
        "--clip-norm",
        type=_RANGED["clip_norm"],
        default=None,
        metavar="C",
        help="local gradient clipping before accumulation: each rank's gradient to the L2 norm "
        "C/sqrt(P) (arXiv 1712.01887 §3.3; default: off)",
    )
    p.add_argument(
        "--density-warmup",
        type=_RANGED["density_warmup"],
        default=None,
        metavar="STEPS",
        help="density warm-up over the first STEPS sparse steps, falling exponentially from "
        "--warmup-density to --density (arXiv 1712.01887 §3.3; default: 0, off)",
    )
    p.add_argument(
        "--warmup-density",
        type=_RANGED["warmup_density"],
        default=None,
        help="the density warm-up's first density, at least --density (default: 0.25)",
    )
    p.add_argument(
        "--dense-numel",
        type=_RANGED["dense_numel"],
        default=None,
        metavar="N",
        help="parameters with at most N elements (biases, normalisation layers) are reduced by a "
        "dense allreduce instead of the sparse one (default: 0, every parameter sparsified)",
    )


def _add_run_options(p) -> None:
    """The communication hook, outputs, checkpoints and resuming."""
    d = DEFAULTS
    p.add_argument(
        "--hook",
        choices=("reducer", "ddp"),
        default=d["hook"],
        help="plain loop with SparseGradientReducer, or DDP with the comm hook "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--out", type=path, default=None, help="write DIR/metrics.json and DIR/training.png"
    )
    p.add_argument(
        "--checkpoint",
        type=path,
        default=None,
        help="save PATH.rank{r}.pt after every epoch (lm: every evaluation)",
    )
    p.add_argument(
        "--resume",
        type=path,
        default=None,
        help="resume from PATH.rank{r}.pt (written by --checkpoint), at any number of ranks; "
        "the files are pickles: resume only from files you trust",
    )
    p.add_argument(
        "--stop-after",
        type=_RANGED["stop_after"],
        default=None,
        metavar="N",
        help="stop after N epochs (lm: N steps, a multiple of --eval-every) as if "
        "interrupted (the schedule still spans --epochs or --steps; resume with --resume)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _resolve_task(args) -> None:
    """Fill in the task's defaults (``args.task`` is "digits" if absent); UsageError for an
    option of the other task."""
    from . import lm

    task = getattr(args, "task", None) or "digits"
    if task not in _TASK_ONLY:
        raise UsageError(f"--task must be digits or lm, got {task!r}")
    args.task = task
    for other, names in _TASK_ONLY.items():
        for name in names:
            if other != task and getattr(args, name, None) is not None:
                raise UsageError(f"{_option(name)} applies to --task {other} only")
    defaults = DEFAULTS if task == "digits" else lm.DEFAULTS
    for name in _PER_TASK:
        if getattr(args, name, None) is None:
            setattr(args, name, defaults.get(name))


def _task_options(args) -> set:
    other = "lm" if args.task == "digits" else "digits"
    return set(_PER_TASK) - set(_TASK_ONLY[other])


#: Options that shape only the sparse reduction: with --algorithm dense they would change
#: nothing, so naming them there is a usage error (like --wire compact).
_SPARSE_ONLY = ("density", "residual", "density_warmup", "warmup_density", "dense_numel")


def _fill_sparse_options(args) -> list[str]:
    """The options of :data:`_SPARSE_ONLY` given; then --density and --residual take their
    defaults where not given."""
    given = [name for name in _SPARSE_ONLY if getattr(args, name, None) is not None]
    for name in ("density", "residual"):
        if getattr(args, name, None) is None:
            setattr(args, name, DEFAULTS[name])
    return given


def reported_density(args) -> float:
    """The density a run's header, plot and metrics.json give: 1 for ``--algorithm dense``,
    which sends every entry, else ``--density``."""
    return 1.0 if args.algorithm == "dense" else args.density


def _check_args(args, P: int) -> None:
    sparse_only = _fill_sparse_options(args)
    for name, kind in _RANGED.items():
        v = getattr(args, name, None)
        unused = name in _OPTIONAL or (name in _PER_TASK and name not in _task_options(args))
        if not (v is None and unused) and not kind.ok(v):
            raise UsageError(f"{_option(name)} must be {kind.what}, got {v}")
    if args.task == "digits" and args.model not in MODELS:
        raise UsageError(f"--model must be one of {', '.join(MODELS)}, got {args.model!r}")
    if args.task == "digits" and args.stop_after is not None and args.stop_after > args.epochs:
        raise UsageError(
            f"--stop-after must be in [1, --epochs={args.epochs}], got {args.stop_after}"
        )
    if args.task == "lm":
        from . import lm

        if args.width % args.heads:
            raise UsageError(f"--heads must divide --width={args.width}, got {args.heads}")
        if args.lr_warmup is None:
            args.lr_warmup = lm.default_lr_warmup(args.steps)
        if args.lr_warmup > args.steps:
            raise UsageError(
                f"--lr-warmup must be in [0, --steps={args.steps}], got {args.lr_warmup}"
            )
        _check_lm_sizes(args, P)
        stop = args.stop_after
        if stop is not None and (
            stop > args.steps or (stop % args.eval_every and stop != args.steps)
        ):
            raise UsageError(
                f"--stop-after must be a multiple of --eval-every={args.eval_every} (or "
                f"--steps) in [1, --steps={args.steps}], got {stop}"
            )
    if getattr(args, "wire", "coo") == "fp16" and args.algorithm != "dense":
        raise UsageError(
            f"--wire fp16 applies to --algorithm dense only (the sparse ones' 16-bit values: "
            f"--wire compact), got --algorithm {args.algorithm}"
        )
    if getattr(args, "wire", "coo") == "compact" and args.algorithm == "dense":
        raise UsageError(
            "--wire compact applies to the sparse algorithms (dense sends no sparse messages; "
            "its 16-bit form is --wire fp16)"
        )
    if args.algorithm == "dense" and sparse_only:
        raise UsageError(
            f"{_option(sparse_only[0])} applies to the sparse algorithms (--algorithm dense "
            f"reduces every entry, with no residual)"
        )
    if getattr(args, "warmup_density", None) is not None and not getattr(
        args, "density_warmup", None
    ):
        raise UsageError("--warmup-density applies with --density-warmup only")
    for name, default in _DGC_DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    if args.no_factor_masking and not args.momentum_correction:
        raise UsageError("--no-factor-masking applies with --momentum-correction only")
    if args.density_warmup and args.warmup_density < args.density:
        raise UsageError(
            f"--warmup-density must be >= --density={args.density}, got {args.warmup_density}"
        )
    if args.momentum_correction and args.residual == "none":
        raise UsageError("--momentum-correction needs error feedback: not with --residual none")
    if args.algorithm != "spardl" and args.teams != 1:
        raise UsageError(f"--teams applies to --algorithm spardl only, got {args.teams}")
    if getattr(args, "explain", False) and args.algorithm != "auto":
        raise UsageError("--explain applies to --algorithm auto only")
    if args.algorithm == "spardl" and P % args.teams:
        raise UsageError(f"--teams must divide the number of ranks P={P}, got {args.teams}")


#: ``--task lm``'s memory bounds: characters per step and rank (--batch-size × --context: the
#: activations, about 4·width bytes per character and layer) and attention scores per step, head
#: and layer (--batch-size × --context², 4 bytes each: at most 1 GiB).
LM_MAX_CHARS = 2**20
LM_MAX_SCORES = 2**28


def _check_lm_sizes(args, P: int) -> None:
    """--context and --batch-size of ``--task lm`` within the text and a sane memory bound."""
    from . import lm

    train_text, val_text, _, _ = lm.load_split(args.seed, lm.DEFAULTS["val_fraction"])
    shortest = min(len(train_text) // P, len(val_text))
    if args.context > shortest - 1:
        raise UsageError(
            f"--context must be at most {shortest - 1} (the shortest text a window is drawn "
            f"from, this rank's training shard or the validation text, minus 1), "
            f"got {args.context}"
        )
    if args.batch_size * args.context > LM_MAX_CHARS:
        raise UsageError(
            f"--batch-size × --context must be at most {LM_MAX_CHARS} characters per step, "
            f"got {args.batch_size} × {args.context}"
        )
    if args.batch_size * args.context**2 > LM_MAX_SCORES:
        raise UsageError(
            f"--batch-size × --context² must be at most {LM_MAX_SCORES} attention scores "
            f"(1 GiB per head and layer), got {args.batch_size} × {args.context}²"
        )


#: Bytes every rank holds per model parameter at the least, float32: the weights, their
#: gradients, the optimizer's state (AdamW's two moments; SGD's momentum is one) and the
#: allreducer's residual or result buffer. The real figure is higher (momentum correction's
#: two vectors, the flat gradient, pooled buffers), so a run this bound refuses cannot fit.
MIN_BYTES_PER_PARAMETER = 16


#: Bytes a ``--task lm`` rank holds for its activations at the least, per character of its
#: batch (--batch-size × --context), unit of --width and layer: the float32 tensors each
#: block's forward pass keeps for its backward pass (its input, both layer norms' outputs, q,
#: k and v, the attention's output, the feed-forward's 4·width hidden layer before and after
#: GELU, ...). Measured in the forward pass alone: 18.2 to 20.8 floats at widths 64 to 256,
#: contexts 128 to 512 and 4 or 16 heads (PyTorch's attention keeps no per-head scores on
#: the CPU); a whole ``spardl train`` step peaks at about 25 (102 bytes).
LM_MIN_ACTIVATION_BYTES = 18 * 4

#: Bytes every rank holds before its model, at the least: the interpreter with PyTorch, NumPy,
#: Numba and mpi4py imported (312 MiB measured, ``ru_maxrss`` on Linux x86-64).
MIN_RANK_BYTES = 300 * 2**20


def _model_numel(args) -> int:
    """Parameters of the model ``args`` describes, counted on PyTorch's meta device (nothing is
    allocated): the model of ``--task``, ``--model``, ``--width`` and, for lm, ``--layers``,
    ``--heads``, ``--context`` and the training split's vocabulary (``--seed``). For lm, one
    and two blocks are built and the count extended to ``--layers`` (the blocks are alike):
    the time does not grow with the layers. OverflowError where PyTorch cannot describe the
    model (a width whose tensors pass its size limits)."""
    import torch

    from . import lm

    try:
        with torch.device("meta"):
            if args.task != "lm":
                return sum(p.numel() for p in build_model(args.width, args.model).parameters())
            train_text, _, _, _ = lm.load_split(args.seed, lm.DEFAULTS["val_fraction"])
            vocab = lm.build_vocab(train_text)
            one, two = (
                sum(
                    p.numel()
                    for p in lm.build_model(
                        len(vocab), args.width, blocks, args.heads, args.context
                    ).parameters()
                )
                for blocks in (1, 2)
            )
    except (RuntimeError, TypeError, OverflowError) as e:  # PyTorch's size arithmetic
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OverflowError(f"PyTorch cannot build it ({first})") from e
    return one + (two - one) * (args.layers - 1)


def _activation_bytes(args) -> tuple[int, int]:
    """Bytes of activations a rank holds at the least besides the model, and those rank 0
    holds besides while it evaluates (lm: the blocks' saved tensors,
    :data:`LM_MIN_ACTIVATION_BYTES`, and the causal mask, T² float32; then one evaluation
    pass's attention scores; digits: not counted, small beside its model)."""
    if args.task != "lm":
        return 0, 0
    from . import lm

    chars = args.batch_size * args.context
    mask = 4 * args.context**2
    scores = 4 * lm.eval_windows(args.heads, args.context) * args.heads * args.context**2
    return chars * args.width * args.layers * LM_MIN_ACTIVATION_BYTES + mask, scores


def _available_memory() -> int | None:
    """This node's ``MemAvailable`` in bytes (Linux ``/proc/meminfo``), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _memory_need(n: int, activations: int, evaluation: int, local_ranks: int, evaluates: bool):
    """Bytes a node needs at the least: each of its ``local_ranks`` ranks holds
    :data:`MIN_RANK_BYTES`, :data:`MIN_BYTES_PER_PARAMETER` per parameter of the model's
    ``n`` and ``activations``; the node of rank 0 (``evaluates``) also its ``evaluation``."""
    per_rank = MIN_RANK_BYTES + n * MIN_BYTES_PER_PARAMETER + activations
    return per_rank * local_ranks + (evaluation if evaluates else 0)


def _check_memory(args, job) -> None:
    """Collective: UsageError on every rank if the model cannot fit in memory on some node, its
    ranks holding at least what :func:`_memory_need` counts, before a rank allocates it (an
    oversized ``--width`` or ``--layers`` would otherwise end in the kernel's out-of-memory kill
    of some rank, or in PyTorch's allocation error on some ranks while the others wait)."""
    import socket

    host = socket.gethostname()
    hosts = job.allgather_object(host)
    local_ranks = hosts.count(host)  # the ranks on this node
    shape = f"--width {args.width}" + (
        f", --layers {args.layers}, --context {args.context}, --batch-size {args.batch_size}"
        if args.task == "lm"
        else ""
    )
    problem = None
    try:
        n = _model_numel(args)
    except OverflowError as e:
        n, problem = 0, f"the model ({shape}) is too large: {e}"
    activations, evaluation = _activation_bytes(args)
    need = _memory_need(n, activations, evaluation, local_ranks, hosts[0] == host)
    have = _available_memory()
    if problem is None and have is not None and need > have:
        activations = (
            f" and {activations / 2**30:.1f} GiB of activations" if args.task == "lm" else ""
        )
        problem = (
            f"the model ({shape}) has {n:,} parameters: at least {need / 2**30:.1f} GiB for "
            f"the {local_ranks} rank(s) on this node ({MIN_RANK_BYTES / 2**30:.2f} GiB, "
            f"{MIN_BYTES_PER_PARAMETER} bytes per parameter{activations} each), more than the "
            f"{have / 2**30:.1f} GiB available"
        )
    _agreed(job, problem)


#: The options that define a run: a --resume must repeat the checkpoint's. The world size may
#: differ: the allreducer's state is then folded into the new world (:mod:`spardl.elastic`).
RUN_OPTIONS = (
    "task",
    "algorithm",
    "density",
    "teams",
    "residual",
    "hook",
    "epochs",
    "steps",
    "eval_every",
    "batch_size",
    "lr",
    "momentum",
    "width",
    "model",
    "layers",
    "heads",
    "context",
    "lr_warmup",
    "seed",
    "warmup_steps",
    "momentum_correction",
    "no_factor_masking",
    "clip_norm",
    "density_warmup",
    "warmup_density",
    "dense_numel",
    "wire",  # "compact" and "fp16" round the values sent to 16 bits: another run
)


def _run_options(args, P: int) -> dict:
    """The options of :data:`RUN_OPTIONS` (after the defaults are filled in) and the world size."""
    opts = {"world_size": P, **{k: getattr(args, k, None) for k in RUN_OPTIONS}}
    if not opts["density_warmup"]:
        opts["warmup_density"] = None
    opts["warmup_steps"] = _warmup_steps(args)  # the steps run, however they were asked for
    return opts


def _describe(key: str, value) -> str:
    return f"P={value}" if key == "world_size" else f"{_option(key)} {value}"


def _saved_world_size(ck: dict):
    return (ck.get("options") or {}).get("world_size", ck.get("world_size"))


def _agreed(job, problem, error: type[Exception] = UsageError) -> None:
    """Collective: ``error`` on every rank, naming the first rank's problem, if any rank has
    one."""
    problems = job.allgather_object(problem)
    bad = [(r, p) for r, p in enumerate(problems) if p is not None]
    if bad:
        r, p = bad[0]
        raise error(f"{p} (rank {r}" + (f" and {len(bad) - 1} more)" if len(bad) > 1 else ")"))


#: ``--task lm``'s learning-rate warm-up before ``--lr-warmup`` existed: 5 % of the steps.
_OLD_LR_WARMUP_FRACTION = 0.05


def _saved_options(ck: dict) -> dict:
    """The run options a checkpoint was saved with, as :func:`_run_options` gives them now: a
    checkpoint of an older spardl without them gives its algorithm and task; one saved before
    ``--lr-warmup`` existed, the warm-up it ran with (5 % of its steps)."""
    theirs = ck.get("options") or {
        "algorithm": ck.get("algorithm"),
        "task": ck.get("task", "digits"),
    }
    if theirs.get("task") == "lm" and "lr_warmup" not in theirs and "steps" in theirs:
        theirs = {**theirs, "lr_warmup": round(_OLD_LR_WARMUP_FRACTION * theirs["steps"])}
    if "warmup_steps" in theirs and theirs["warmup_steps"] is None:  # saved as given: the default
        theirs = {**theirs, "warmup_steps": _warmup_steps_of(None, theirs.get("hook"))}
    return theirs


#: What every ``spardl train`` checkpoint file holds (besides its position and world size).
_CHECKPOINT_KEYS = ("model", "optimizer", "reducer")


def _digest(obj) -> str:
    """SHA-256 of a state as saved: tensors and arrays by dtype, shape and bytes, dicts, lists
    and tuples in order, anything else by its repr. A file damaged inside a tensor's data
    still loads (the pickle does not check it), so a checkpoint carries the digests of its
    states (``sha256``) and a resume compares them."""
    import hashlib

    import torch

    h = hashlib.sha256()

    def walk(x) -> None:
        if isinstance(x, torch.Tensor):
            x = (
                x.detach().cpu().contiguous().numpy()
                if x.dtype != torch.bfloat16
                else (x.detach().cpu().contiguous().view(torch.int16).numpy())
            )
        if isinstance(x, np.ndarray):
            h.update(f"array {x.dtype.str} {x.shape};".encode())
            h.update(np.ascontiguousarray(x).tobytes())
        elif isinstance(x, dict):
            h.update(f"dict {len(x)};".encode())
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, (list, tuple)):
            h.update(f"{type(x).__name__} {len(x)};".encode())
            for v in x:
                walk(v)
        else:
            h.update(f"{type(x).__name__} {x!r};".encode())

    walk(obj)
    return h.hexdigest()


def _check_resume(args, job):
    """Collective: the ``--resume`` checkpoint this rank starts from, loaded; UsageError on every
    rank if any rank's checkpoint cannot be read, is not a ``spardl train`` checkpoint, belongs
    to another rank or another step than rank 0's, or was saved with other run options
    (:data:`RUN_OPTIONS`; a checkpoint of an older spardl without them: algorithm and task).
    Returns None without ``--resume``.

    Rank 0's file says the checkpoint's world size P and its position (epoch or step). Ranks
    r < P read their own file, which must be of the same P and position. At the checkpoint's
    world size that is all. At another world size P' (elastic resume): a new rank r ≥ P starts
    from rank 0's model, optimizer and loop position (any file of its own is an older run's and
    is ignored), and ``ck["resize"] = (P, {old rank: its reducer state})`` holds the states,
    of the same P and position, that :func:`spardl.elastic.load_rank_states` folds into rank r
    (old ranks ≡ r mod P').
    """
    if args.resume is None:
        return None
    import torch

    def load(rank, first=None):
        """Rank ``rank``'s file, checked; with ``first``, of rank 0's world size and position."""
        path = _ckpt_path(args.resume, rank)
        ck = torch.load(path, weights_only=False)
        missing = [k for k in _CHECKPOINT_KEYS if not isinstance(ck, dict) or k not in ck]
        if missing or _saved_world_size(ck) is None:
            raise ValueError(
                f"{path} is not a spardl train checkpoint (no {', '.join(missing) or 'world size'})"
            )
        if ck.get("rank", rank) != rank:
            raise ValueError(f"{path} holds rank {ck['rank']}'s state, not rank {rank}'s")
        if "sha256" in ck:  # absent from the checkpoints of an older spardl only
            saved = ck["sha256"]
            if not isinstance(saved, dict) or any(
                not isinstance(saved.get(k), str) for k in _CHECKPOINT_KEYS
            ):
                raise ValueError(
                    f"{path} is damaged: its SHA-256 digests are not the three strings "
                    f"({', '.join(_CHECKPOINT_KEYS)}) written with it"
                )
            damaged = [k for k in _CHECKPOINT_KEYS if saved[k] != _digest(ck[k])]
        else:
            damaged = []
        if damaged:
            raise ValueError(
                f"{path} is damaged: its {', '.join(damaged)} state does not match the SHA-256 "
                "digest written with it"
            )
        if first is not None and where(ck) != first:
            raise ValueError(
                f"{path} is of {where(ck)}, rank 0's of {first}: not one checkpoint (a job "
                "stopped while writing it, or files of two runs under one path?)"
            )
        return ck

    def where(ck):
        return f"P={_saved_world_size(ck)}, " + ", ".join(
            f"{k} {ck[k]}" for k in ("epoch", "step") if k in ck
        )

    # Rank 0's file: the world size and position every other file must share.
    problem, ck, first = None, None, None
    if job.rank == 0:
        try:
            ck = load(0)
            first = (_saved_world_size(ck), where(ck))
        except Exception as e:  # noqa: BLE001 - an unreadable checkpoint is reported on every rank
            problem = f"--resume: cannot read {_ckpt_path(args.resume, 0)} ({e})"
    _agreed(job, problem)
    P, first = job.bcast_object(first, 0)

    problem, reading = None, _ckpt_path(args.resume, job.rank)
    try:
        if job.rank >= P:
            reading = _ckpt_path(args.resume, 0)
            ck = load(0)  # a new rank starts from rank 0's model, optimizer and position
        elif job.rank > 0:
            if not reading.exists():
                raise FileNotFoundError(f"no checkpoint {reading}")
            ck = load(job.rank, first)
        mine = _run_options(args, job.size)
        theirs = _saved_options(ck)
        diff = [k for k in mine if k != "world_size" and k in theirs and theirs[k] != mine[k]]
        if diff:
            problem = (
                "--resume: the checkpoint was saved with "
                + ", ".join(_describe(k, theirs[k]) for k in diff)
                + "; this run has "
                + ", ".join(_describe(k, mine[k]) for k in diff)
            )
    except Exception as e:  # noqa: BLE001 - as above
        problem = f"--resume: cannot read {reading} ({e})"
    _agreed(job, problem)
    if P == job.size:
        return ck
    from .elastic import folded_ranks

    problem, need = None, folded_ranks(P, job.size, job.rank)
    try:
        states = {r: (ck if r == job.rank else load(r, first))["reducer"] for r in need}
        ck["resize"] = (P, states or {0: ck["reducer"]})
    except Exception as e:  # noqa: BLE001 - as above
        problem = f"--resume: cannot read the checkpoints of ranks {need} ({e})"
    _agreed(job, problem)
    return ck


def _check_paths(args, job) -> None:
    """Collective: every file option usable on every rank, else UsageError on every rank.

    Checked before training so that a typo ends the job at once, not at the first checkpoint or
    after the last epoch: ``--resume``'s file of rank 0 exists (every rank reads it when the
    world size changed; :func:`_check_resume` checks the others), the directories of ``--out``
    (rank 0 writes it) and ``--checkpoint`` (every rank writes its own file) can be made.
    """
    problem = None
    try:
        resume = None if args.resume is None else _ckpt_path(args.resume, 0)
        if resume is not None and not resume.exists():
            problem = f"--resume: no checkpoint {resume}" + (
                f" ({args.resume} is a directory: --resume takes the prefix --checkpoint was "
                f"given, such as {args.resume / 'ckpt'})"
                if args.resume.is_dir()
                else ""
            )
        elif args.checkpoint is not None and args.checkpoint.is_dir():
            problem = (
                f"--checkpoint: {args.checkpoint} is a directory; the option takes a prefix "
                f"(each rank writes PREFIX.rank{{r}}.pt), such as {args.checkpoint / 'ckpt'}"
            )
        elif args.out is not None and job.rank == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            _probe_writable(args.out)
        if problem is None and args.checkpoint is not None:
            args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
            _probe_writable(args.checkpoint.parent)
    except OSError as e:
        problem = f"cannot create or write a directory for --out or --checkpoint: {e}"
    _agreed(job, problem)


def _probe_writable(directory: Path) -> None:
    """Create and remove a file in ``directory`` (OSError if that fails: a directory that
    exists but takes no files, such as /proc, or a read-only one)."""
    import tempfile

    with tempfile.NamedTemporaryFile(dir=directory, prefix=".spardl-probe-"):
        pass


def build_model(width: int = 16, model: str = "cnn"):
    """A small network for 1×8×8 images, 10 classes.

    ``"cnn"``: conv(1→w, 3×3) · ReLU · conv(w→2w, 3×3) · ReLU · max-pool 2 · linear(2w·16 → 64)
    · ReLU · linear(64 → 10). With w = 16: 38,282 parameters; w = 96: 364,362.

    ``"mlp"``: flatten · linear(64 → w) · ReLU · linear(w → w) · ReLU · linear(w → 10). With
    w = 1024: 1,126,410 parameters. A fully connected layer does 2 multiply-adds per parameter
    and sample in forward and backward together about 6 operations; a convolution on 8×8
    images reuses each weight at 64 (or 16) positions. So at equal size the MLP's step is a
    small fraction of the CNN's compute and its gradient is as large: the kind of model (as
    the fully connected layers of VGG, or embedding tables) where the allreduce sets the pace.
    """
    from torch import nn

    if model == "mlp":
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(64, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, 10),
        )
    if model != "cnn":
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
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


def _write_checkpoint(job, base: Path, rank: int, P: int, ck: dict) -> None:
    """Collective: every rank's file of one checkpoint, replaced only once all are written.

    Each rank writes ``PATH.rank{r}.pt.tmp``; only when every rank has written its own does
    each rename it over its last file, so a job stopped while writing keeps its last whole
    checkpoint (one stopped between the renames leaves files of two steps, which
    :func:`_check_resume` names). Rank 0 then removes the files of ranks ≥ P that an earlier
    run at a larger world size left under the same PATH, which would otherwise shadow this one.
    A write that fails on any rank raises OSError on every rank, the last checkpoint kept.
    """
    import torch

    path = _ckpt_path(base, rank)
    tmp = path.with_name(path.name + ".tmp")
    problem = None
    try:
        torch.save(ck, tmp)
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        problem = f"--checkpoint: cannot write {tmp} ({e})"
    try:
        _agreed(job, problem, OSError)
    except OSError:
        with contextlib.suppress(OSError):  # a partial file; not what the error names
            tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    if rank == 0:
        prefix = f"{base.name}.rank"
        for old in base.parent.glob(f"{glob.escape(base.name)}.rank*.pt"):
            r = old.name[len(prefix) : -len(".pt")]
            if r.isdigit() and int(r) >= P:
                old.unlink(missing_ok=True)


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


#: Names of the launchers whose standard error a rank's own (a pipe) is forwarded to.
_LAUNCHERS = ("mpiexec", "mpirun", "orterun", "prterun", "srun")


def _stderr_reaches_a_terminal() -> bool:
    """Whether what this process writes to stderr ends on a terminal: its stderr is one, or,
    under a launcher (whose ranks write into pipes that it forwards), the stderr of the
    launcher that started it on this node is (Linux: its ancestors in ``/proc``, up to 8
    levels). False where that cannot be told: rank 0 started on another node, no ``/proc``."""
    if sys.stderr is not None and sys.stderr.isatty():
        return True
    pid = os.getppid()
    for _ in range(8):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            if name.startswith(_LAUNCHERS):
                return os.readlink(f"/proc/{pid}/fd/2").startswith(("/dev/pts/", "/dev/tty"))
            pid = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid <= 1:
            return False
    return False


class _Trainer:
    """What the tasks' training loops share: the options, the job's own communicator, the
    model and its optimizer, the allreducer (a reducer, or DDP with the hook), progress and
    checkpoints."""

    def __init__(self, args, job, model, net, opt, reducer, hook_state, t_start):
        self.args, self.job, self.rank, self.P = args, job, job.rank, job.size
        self.model, self.net, self.opt = model, net, opt
        self.reducer, self.hook_state, self.t_start = reducer, hook_state, t_start
        self.n_params = sum(p.numel() for p in model.parameters())
        self.stats = (reducer if reducer is not None else hook_state).stats
        self.progress = None
        self.density = reported_density(args)  # what the header says (1 for dense)

    def start_progress(self, total: int) -> None:
        """A progress bar of ``total`` steps on rank 0, where it reaches a terminal
        (:func:`_stderr_reaches_a_terminal`; never with ``--no-progress``): redrawn with
        carriage returns, it would fill a log file with partial lines."""
        if self.rank == 0 and not self.args.no_progress and _stderr_reaches_a_terminal():
            from tqdm import tqdm

            self.progress = tqdm(total=max(0, total), unit="step", leave=False, dynamic_ncols=True)

    def log(self, line: str) -> None:
        """Print a line on rank 0 (above the progress bar)."""
        if self.rank == 0:
            (self.progress.write if self.progress is not None else print)(line)

    def step(self, loss_of) -> float:
        """One training step: ``loss_of(net)``, backward, gradient allreduce, optimizer step;
        returns the local loss."""
        self.opt.zero_grad(set_to_none=False)
        loss = loss_of(self.net)
        loss.backward()
        if self.reducer is not None:
            self.reducer.reduce()
        self.opt.step()
        if self.progress is not None:
            self.progress.update()
        return loss.detach().item()

    def bytes_sent_by_rank(self) -> np.ndarray:
        """Bytes sent so far by each rank's allreducer (collective)."""
        return self.job.allgather_array(np.array([self.stats["bytes_sent"]], dtype=np.int64))[:, 0]

    def bytes_sent_per_rank(self) -> float:
        """Mean of :meth:`bytes_sent_by_rank` (collective)."""
        return float(self.bytes_sent_by_rank().mean())

    def save(self, position: dict) -> None:
        """Write this rank's checkpoint (if ``--checkpoint``): ``position`` (the loop's place
        and history) with the model, optimizer and allreducer states."""
        args = self.args
        if args.checkpoint is None:
            return

        args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        ck = {
            **position,
            "task": args.task,
            "world_size": self.P,
            "rank": self.rank,
            "algorithm": args.algorithm,
            "options": _run_options(args, self.P),
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "reducer": (self.reducer if self.reducer is not None else self.hook_state).state_dict(),
            "elapsed": time.perf_counter() - self.t_start,
        }
        ck["sha256"] = {key: _digest(ck[key]) for key in _CHECKPOINT_KEYS}
        _write_checkpoint(self.job, args.checkpoint, self.rank, self.P, ck)


def _digits_setup(args, rank: int, P: int):
    import torch

    x_tr, y_tr, x_te, y_te = load_digits_split(args.seed, DEFAULTS["test_fraction"])
    shard = np.arange(rank, len(x_tr), P)  # rank r trains on samples r, r+P, ...
    data = {
        "x": torch.from_numpy(x_tr[shard]),
        "y": torch.from_numpy(y_tr[shard]),
        "x_test": torch.from_numpy(x_te),
        "y_test": torch.from_numpy(y_te),
        "n_train": len(x_tr),
        # Every rank takes the same number of steps (a collective per step): the smallest shard.
        "steps_per_epoch": math.ceil((len(x_tr) // P) / args.batch_size),
    }
    torch.manual_seed(args.seed)  # identical initial replicas on every rank
    return data, build_model(args.width, args.model)


def _train_digits(tr: _Trainer, data: dict, resumed: dict | None) -> tuple[list[dict], dict]:
    """The digits training loop (epochs); evaluation on rank 0 after every epoch."""
    import torch
    import torch.nn.functional as F

    args, job, rank, P = tr.args, tr.job, tr.rank, tr.P
    x_sh, y_sh, steps_per_epoch = data["x"], data["y"], data["steps_per_epoch"]
    history = resumed["history"] if resumed else []
    start_epoch = resumed["epoch"] if resumed else 0
    last_epoch = args.epochs if args.stop_after is None else args.stop_after
    tr.start_progress((last_epoch - start_epoch) * steps_per_epoch)
    tr.log(
        f"spardl train: {args.algorithm} P={P} density={tr.density} n={tr.n_params} "
        f"params, {data['n_train']} train / {len(data['x_test'])} test images, "
        f"{steps_per_epoch} steps/epoch"
        + (
            f" (--batch-size {args.batch_size} is more than a rank's "
            f"{data['n_train'] // P} samples: each step takes them all)"
            if args.batch_size > data["n_train"] // P
            else ""
        )
    )
    if start_epoch >= last_epoch:
        tr.log(f"nothing to train: the checkpoint is at epoch {start_epoch} of {last_epoch}")
    for epoch in range(start_epoch, last_epoch):
        t_epoch = time.perf_counter()
        order = np.random.default_rng([args.seed, rank, epoch]).permutation(len(x_sh))
        order = torch.from_numpy(order)
        tr.model.train()
        loss_sum = 0.0
        for s in range(steps_per_epoch):
            idx = order[s * args.batch_size : (s + 1) * args.batch_size]
            _set_lr(tr.opt, args.lr, epoch * steps_per_epoch + s, args.epochs * steps_per_epoch)
            loss_sum += tr.step(lambda net, idx=idx: F.cross_entropy(net(x_sh[idx]), y_sh[idx]))
        mean_loss = float(job.allreduce(np.array([loss_sum / steps_per_epoch]))[0] / P)
        entry = {
            "epoch": epoch + 1,
            "loss": mean_loss,
            "test_accuracy": None,
            "bytes_sent_per_rank": tr.bytes_sent_per_rank(),
            "seconds": time.perf_counter() - t_epoch,
        }
        if rank == 0:
            tr.model.eval()
            entry["test_accuracy"] = _accuracy(tr.model, data["x_test"], data["y_test"])
            tr.log(
                f"epoch {epoch + 1:3d}/{args.epochs}  loss {mean_loss:.4f}  "
                f"test acc {entry['test_accuracy']:.2%}  "
                f"sent/rank {entry['bytes_sent_per_rank'] / 1e6:.3f} MB  "
                f"time {entry['seconds']:.1f}s"
            )
        history.append(entry)
        tr.save({"epoch": epoch + 1, "history": history})
    return history, {
        "epochs": args.epochs,
        "steps_per_epoch": steps_per_epoch,
        "final_test_accuracy": history[-1]["test_accuracy"] if history else None,
    }


def run(args, world) -> dict | None:
    """Train under MPI; collective over ``world`` (an mpi4py intracommunicator).

    Parameters
    ----------
    args : argparse.Namespace
        The options of :func:`add_arguments` (``task`` and the options that default by task may
        be absent or None: the task's defaults are filled in).
    world : mpi4py.MPI.Intracomm
        The ranks of the job (P = its size).

    Returns
    -------
    dict or None
        The metrics on rank 0 (also written to ``args.out/metrics.json``), None elsewhere.

    Raises
    ------
    UsageError
        A subclass of ValueError, on every rank before training: an option out of range or of
        the other task, ``--teams`` not dividing P, ``--heads`` not dividing ``--width``, or
        (checked collectively) a ``--resume`` checkpoint missing or unreadable on some rank or
        saved with other run options (:data:`RUN_OPTIONS`; another world size is an elastic
        resume, :func:`spardl.elastic.load_rank_states`, not an error), an ``--out`` /
        ``--checkpoint`` directory that cannot be made, a model too large for some node's
        available memory (:data:`MIN_RANK_BYTES` and :data:`MIN_BYTES_PER_PARAMETER` bytes
        per parameter each, and with ``--task lm`` the activations); with ``--task lm``, a
        ``--context`` longer than the shortest text a window is drawn from minus 1, or over the
        memory bounds :data:`LM_MAX_CHARS` (--batch-size × --context) and :data:`LM_MAX_SCORES`
        (--batch-size × --context²).
    ValueError, TypeError
        The allreducer's own checks, on every rank.
    """
    from .comm import Comm

    _resolve_task(args)
    _check_args(args, world.Get_size())
    t_start = time.perf_counter()
    # A line as it is printed: under mpiexec stdout is a pipe, block-buffered by default, so a
    # job killed mid-run would lose the epochs it had logged (and checkpointed).
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    job = Comm(world)  # the job's own small collectives, kept out of the allreducer's counters
    rank, P = job.rank, job.size
    _check_paths(args, job)
    # torch is imported after the checks that do not need it: a usage error ends the job at
    # once, not after every rank has loaded torch (seconds each on a shared machine).
    import torch

    torch.set_num_threads(1)  # P ranks share the machine's cores
    torch.use_deterministic_algorithms(True)
    _check_memory(args, job)
    resumed_ck = _check_resume(args, job)

    data, model, loop = _task_setup(args, rank, P)
    net, reducer, hook_state = _gradient_allreduce(args, world, model)
    opt = _optimizer(args, model)
    resumed = None
    if args.resume is not None:
        resumed = resumed_ck  # loaded and checked against this run's options by _check_resume
        _load_checkpoint(resumed, model, opt, reducer if reducer is not None else hook_state, job)
        t_start -= resumed.get("elapsed", 0.0)

    tr = _Trainer(args, job, model, net, opt, reducer, hook_state, t_start)
    history, task_metrics = loop(tr, data, resumed)
    if tr.progress is not None:
        tr.progress.close()
        tr.progress = None
    wall = time.perf_counter() - t_start
    sent = tr.bytes_sent_by_rank()
    if reducer is None:
        import torch.distributed as dist

        dist.destroy_process_group()
    job.free()
    auto = tr.stats.get("auto")
    if rank != 0:
        return None
    if auto is not None and getattr(args, "explain", False):
        from .algorithms.auto import explain

        print(explain(auto), flush=True)
    metrics = {
        **_run_metrics(args, P, tr.n_params),
        **task_metrics,
        "wall_seconds": wall,
        "train_seconds": _train_seconds(args.task, history),
        # False for a run stopped by --stop-after (resume it with --resume): its final
        # metrics are those of where it stopped, not of the schedule's end.
        "completed": _completed(args, history),
        "bytes_sent_per_rank": float(sent.mean()),
        "bytes_sent_by_rank": [int(b) for b in sent],
        "history": history,
    }
    if auto is not None:
        metrics["auto"] = auto
    if resumed is not None:
        # Where this run took over; at another world size the per-rank byte counts of the
        # history restart there (a new rank's counters start at zero, a removed rank's go).
        at = {k: resumed[k] for k in ("epoch", "step") if k in resumed}
        metrics["resumed_from"] = {"world_size": _saved_world_size(resumed), **at}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        (_plot_lm if args.task == "lm" else _plot)(metrics, args.out / "training.png")
        tr.log(f"wrote {args.out / 'metrics.json'} and {args.out / 'training.png'}")
    return metrics


def _train_seconds(task: str, history: list[dict]) -> float:
    """Seconds in the training steps, evaluation excluded, over the whole run (a resumed run's
    history included): the sum of the digits task's per-epoch seconds, the lm task's running
    total at its last evaluation."""
    if not history:
        return 0.0
    if task == "lm":
        return float(history[-1]["seconds"])
    return float(sum(e["seconds"] for e in history))


def _completed(args, history: list[dict]) -> bool:
    """Whether the run trained to the end of its schedule (--epochs or --steps)."""
    key, last = ("step", args.steps) if args.task == "lm" else ("epoch", args.epochs)
    return bool(history) and history[-1][key] == last


def _task_setup(args, rank: int, P: int):
    """(data, model, training loop) of ``args.task``; the model identical on every rank."""
    if args.task == "lm":
        import torch

        from . import lm

        torch.manual_seed(args.seed)  # identical initial replicas on every rank
        data, model = lm.setup(args, rank, P)
        return data, model, lm.train
    data, model = _digits_setup(args, rank, P)
    return data, model, _train_digits


def _optimizer_momentum(args) -> float:
    """Momentum correction moves the momentum into the velocity the allreduce sparsifies: the
    optimizer then runs without it (arXiv 1712.01887 §3.2)."""
    return 0.0 if args.momentum_correction else args.momentum


def _allreducer_options(args) -> dict:
    """The options of the sparse allreducer and of Deep Gradient Compression's techniques."""
    options = {"density": args.density, "residual": args.residual}
    wire = getattr(args, "wire", "coo")
    if wire == "fp16":  # the dense allreducer's float16 sum (spardl.algorithms.dense)
        options["wire_dtype"] = "float16"
    elif wire != "coo":
        options["wire"] = wire
    if args.algorithm == "spardl":
        options["teams"] = args.teams
    options.update(
        momentum_correction=args.momentum if args.momentum_correction else None,
        factor_masking=not args.no_factor_masking,
        clip_norm=args.clip_norm,
        density_warmup=args.density_warmup,
        warmup_density=args.warmup_density if args.density_warmup else None,
        dense_numel=args.dense_numel,
    )
    return options


def _gradient_allreduce(args, world, model):
    """(net, reducer, hook_state): the model itself with a :class:`SparseGradientReducer` for
    the plain loop, or the model in DDP with the communication hook's state (``--hook ddp``);
    the other one None."""
    from .torch import SparseGradientReducer, SparseHookState, sparse_allreduce_hook

    options = _allreducer_options(args)
    if args.hook == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        from .torch import init_process_group_from_mpi

        init_process_group_from_mpi(world)
        warm = _warmup_steps(args)
        hook_state = SparseHookState(
            world, args.algorithm, warmup_steps=warm, model=model, **options
        )
        net = DDP(model)
        net.register_comm_hook(hook_state, sparse_allreduce_hook)
        return net, None, hook_state
    warm = _warmup_steps(args)
    reducer = SparseGradientReducer(
        model.named_parameters(), world, args.algorithm, warmup_steps=warm, **options
    )
    return model, reducer, None


def _optimizer(args, model):
    """SGD for digits, AdamW for lm (its beta1 is the momentum; torch's fused implementation
    where it has one)."""
    import torch

    momentum = _optimizer_momentum(args)
    if args.task == "lm":
        params = list(model.parameters())  # twice if the first try fails
        kwargs = {"lr": args.lr, "betas": (momentum, 0.99), "weight_decay": 0.0}
        try:
            # One fused pass over every parameter: 2.5 ms a step for the default model on one
            # core, where the per-tensor loop takes 12 ms, as long as a sparse allreduce here.
            return torch.optim.AdamW(params, fused=True, **kwargs)
        except RuntimeError:  # torch before 2.4 fuses on CUDA only
            return torch.optim.AdamW(params, foreach=True, **kwargs)
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=momentum)


def _load_checkpoint(ck: dict, model, opt, target, job) -> None:
    """Restore the model, the optimizer and the allreducer's state (``target``: the reducer or
    the hook state) from this rank's checkpoint; a checkpoint of another world size is folded
    into this one (:func:`spardl.elastic.load_rank_states`)."""
    model.load_state_dict(ck["model"])
    # A param group's implementation flags come back from the checkpoint: keep this run's (a
    # checkpoint written before the fused AdamW would turn it off; one written with it would
    # fail at the first step under a torch that has no fused CPU AdamW).
    impl = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in opt.param_groups]
    opt.load_state_dict(ck["optimizer"])
    for group, flags in zip(opt.param_groups, impl, strict=True):
        group.update(flags)
    if "resize" in ck:
        from .elastic import load_rank_states

        P_saved, states = ck["resize"]
        load_rank_states(target, states, P_saved)
        if job.rank == 0:
            print(
                f"spardl train: resumed at P={job.size} from a checkpoint of P={P_saved}: "
                "residuals folded, thresholds re-estimated (docs/reliability.md §4.1)",
                flush=True,
            )
    else:
        target.load_state_dict(ck["reducer"])


def _warmup_steps(args) -> int:
    """The dense warm-up steps of ``args`` (:func:`_warmup_steps_of`)."""
    return _warmup_steps_of(args.warmup_steps, args.hook)


def _warmup_steps_of(given, hook) -> int:
    """The dense warm-up steps: --warmup-steps as ``given``, else 2 for the DDP hook (its
    default) and 0 for the reducer."""
    if given is not None:
        return given
    return 2 if hook == "ddp" else 0


def _run_metrics(args, P: int, n_params: int) -> dict:
    """The run's options as metrics.json records them (before the task's own metrics)."""
    return {
        "task": args.task,
        "algorithm": args.algorithm,
        "world_size": P,
        "density": reported_density(args),
        "teams": args.teams,
        "residual": None if args.algorithm == "dense" else args.residual,
        "hook": args.hook,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "momentum": args.momentum,
        "momentum_correction": args.momentum_correction,
        "factor_masking": args.momentum_correction and not args.no_factor_masking,
        "clip_norm": args.clip_norm,
        "density_warmup": args.density_warmup,
        "warmup_density": args.warmup_density if args.density_warmup else None,
        "dense_numel": args.dense_numel,
        "warmup_steps": _warmup_steps(args),
        "wire": args.wire,
        "optimizer_momentum": _optimizer_momentum(args),
        "width": args.width,
        "model": args.model,
        "seed": args.seed,
        "n_params": n_params,
    }


def recorded_options(train_args: list[str], P: int) -> dict:
    """The options a run of ``spardl train TRAIN_ARGS`` at world size P records in its
    metrics.json, with the defaults filled in as the run fills them.

    Parameters
    ----------
    train_args : list of str
        Arguments of ``spardl train`` (as ``launch_train`` takes them).
    P : int
        The world size.

    Returns
    -------
    dict
        The keys of :func:`_run_metrics` but ``n_params``, and the task's own options
        (``epochs`` and ``model`` for digits; ``steps``, ``eval_every``, ``layers``,
        ``heads``, ``context`` and ``lr_warmup`` for lm): a completed run whose
        metrics.json holds these values ran with these options.

    Raises
    ------
    UsageError
        For arguments the job itself would refuse before training (:func:`run`'s checks that
        need no MPI); SystemExit for ones its parser refuses.
    """
    import argparse

    p = argparse.ArgumentParser(prog="spardl train")
    add_arguments(p)
    args = p.parse_args(train_args)
    _resolve_task(args)
    _check_args(args, P)
    opts = _run_metrics(args, P, 0)
    del opts["n_params"]
    return {**opts, **{k: getattr(args, k) for k in _TASK_ONLY[args.task]}}


def _plot_lm(metrics: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = metrics["history"]
    bpc = [e["val_bits_per_char"] for e in h]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, x, label in (
        (axes[0], [e["step"] for e in h], "step"),
        (axes[1], [e["seconds"] for e in h], "training seconds (evaluation excluded)"),
    ):
        ax.plot(x, bpc, marker="o", ms=3)
        ax.set_xlabel(label)
        ax.set_ylabel("validation bits per character")
        ax.grid(alpha=0.3)
    axes[2].plot([e["step"] for e in h], [e["bytes_sent_per_rank"] / 1e6 for e in h], marker="o")
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("bytes sent per rank (MB, cumulative)")
    axes[2].grid(alpha=0.3)
    fig.suptitle(
        f"lm: {metrics['algorithm']}, P={metrics['world_size']}, density={metrics['density']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
