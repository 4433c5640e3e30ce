"""`spardl train --task lm`: a small character-level transformer language model on real text.

The text is CPython's own reference documentation, ``pydoc_data.topics`` (79 topics, about
465,000 characters of English prose and code, shipped with every CPython: no download). The
topics are split into a training and a validation set, fixed by ``--seed``; the training topics
are joined into one text and each rank trains on its contiguous 1/P share of it, drawing
``--batch-size`` random windows of ``--context`` characters per step, seeded by
(seed, rank, step). The model is a decoder-only transformer (pre-norm
:class:`torch.nn.TransformerEncoderLayer` blocks under a causal mask, learned positional
embeddings, output weights tied to the input embedding) trained by AdamW to predict the next
character. Every ``--eval-every`` steps rank 0 measures the validation loss in bits per
character, and the next-character accuracy, on a fixed subset of validation windows.

:func:`train` is the task's training loop; the shared parts (allreducer or DDP hook, optimizer,
checkpoints, metrics) are in :mod:`spardl.train`. Importing this module does not import torch;
``spardl.lm.CharTransformer`` (the model class) does.
"""

from __future__ import annotations

import functools
import math
import time

import numpy as np

__all__ = [
    "DEFAULTS",
    "UNKNOWN",
    "bits_per_char",
    "build_model",
    "build_vocab",
    "default_lr_warmup",
    "encode",
    "EVAL_MAX_SCORES",
    "eval_windows",
    "evaluate",
    "load_split",
    "lr_at",
    "setup",
    "shard_of",
    "train",
    "train_batch",
    "validation_windows",
]

#: Defaults of the lm task (options of ``spardl train`` that the digits task sets otherwise).
DEFAULTS = {
    # 4,800 steps of one 128-character window per rank: the same characters as 600 steps of
    # 8, in steps small enough that error feedback delivers a sparse allreduce's entries in
    # time (docs/performance.md, "What the gap at 1 % depends on" and "4,800 steps").
    "steps": 4800,
    "eval_every": 400,
    "batch_size": 1,
    # The best of 0.0015, 0.003 and 0.006 for dense at 4,800 steps of one window (seed 0;
    # docs/performance.md, "4,800 steps"); 0.006 was the best for 600 steps of 8.
    "lr": 0.003,
    "momentum": 0.9,
    "width": 128,
    "layers": 5,
    "heads": 4,
    "context": 128,
    "val_fraction": 0.1,
    "eval_windows": 64,
    "lr_warmup_fraction": 0.5,
}

#: The vocabulary's entry 0, standing for every character not seen in the training text.
UNKNOWN = "\x00"


def load_split(seed: int, val_fraction: float = DEFAULTS["val_fraction"]):
    """The topics of ``pydoc_data.topics`` split into training and validation sets.

    Parameters
    ----------
    seed : int
        Fixes the split (a permutation of the sorted topic names).
    val_fraction : float
        Fraction of the topics (by count, at least one) held out for validation.

    Returns
    -------
    train_text, val_text : str
        The topics of each set, in the permuted order, joined by blank lines.
    train_names, val_names : list of str
        The topic names of each set (disjoint; together every topic).
    """
    train_text, val_text, train_names, val_names = _split(seed, val_fraction)
    return train_text, val_text, list(train_names), list(val_names)


@functools.cache
def _split(seed: int, val_fraction: float) -> tuple[str, str, tuple, tuple]:
    """:func:`load_split`'s work, done once per process and arguments (a run's start-up checks,
    its model count and its data all read the split)."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    order = np.random.default_rng([seed, 0x1A7]).permutation(len(names))
    n_val = max(1, round(val_fraction * len(names)))
    val_names = tuple(names[i] for i in order[:n_val])
    train_names = tuple(names[i] for i in order[n_val:])
    train_text = "\n\n".join(topics[n] for n in train_names)
    val_text = "\n\n".join(topics[n] for n in val_names)
    return train_text, val_text, train_names, val_names


def build_vocab(text: str) -> list[str]:
    """The characters of ``text``, sorted, after :data:`UNKNOWN` at index 0.

    Parameters
    ----------
    text : str
        The training text.

    Returns
    -------
    list of str
        One-character strings: :data:`UNKNOWN`, then every distinct character of ``text``
        other than it, in code-point order; V = ``len`` of it.
    """
    return [UNKNOWN, *sorted(set(text) - {UNKNOWN})]


def encode(text: str, vocab: list[str]) -> np.ndarray:
    """Indices of the characters of ``text`` in ``vocab`` (int64); unseen characters map to 0.

    Parameters
    ----------
    text : str
        The text, m characters.
    vocab : list of str
        The vocabulary (:func:`build_vocab`).

    Returns
    -------
    ndarray of int64, shape (m,)
        Each character's index in ``vocab``; 0 (:data:`UNKNOWN`) for one not in it.
    """
    index = {c: i for i, c in enumerate(vocab)}
    return np.fromiter((index.get(c, 0) for c in text), dtype=np.int64, count=len(text))


def shard_of(ids: np.ndarray, rank: int, P: int) -> np.ndarray:
    """Rank ``rank``'s contiguous 1/P share of the encoded training text.

    Parameters
    ----------
    ids : ndarray of shape (m,)
        The encoded training text (:func:`encode`).
    rank, P : int
        This rank and the number of ranks.

    Returns
    -------
    ndarray
        The view ``ids[rank·m // P : (rank + 1)·m // P]`` (the shares tile ``ids``).
    """
    n = len(ids)
    return ids[rank * n // P : (rank + 1) * n // P]


def train_batch(shard: np.ndarray, batch_size: int, context: int, seed: int, rank: int, step: int):
    """The training windows of one step: inputs and next-character targets.

    The window starts are drawn uniformly from the shard by a generator seeded with
    (seed, rank, step), so the batch of a step does not depend on what ran before it.

    Parameters
    ----------
    shard : ndarray
        This rank's encoded training text (:func:`shard_of`), longer than ``context``.
    batch_size, context : int
        B windows of T characters.
    seed, rank, step : int
        Seed the draw.

    Returns
    -------
    x, y : torch.Tensor
        (B, T) int64; ``y`` is ``x`` shifted by one character.

    Raises
    ------
    ValueError
        If the shard is not longer than ``context`` (no window start to draw;
        :meth:`numpy.random.Generator.integers`).
    """
    import torch

    rng = np.random.default_rng([seed, rank, step])
    starts = rng.integers(0, len(shard) - context, size=batch_size)
    w = shard[starts[:, None] + np.arange(context + 1)]
    return torch.from_numpy(w[:, :-1].copy()), torch.from_numpy(w[:, 1:].copy())


def validation_windows(ids: np.ndarray, context: int, n: int):
    """``n`` fixed, non-overlapping validation windows spread evenly over ``ids`` (fewer if the
    text is short): inputs and targets as (n, T) int64 tensors.

    Parameters
    ----------
    ids : ndarray of int64, shape (m,)
        The encoded validation text (:func:`encode`).
    context : int
        T, the window length in characters.
    n : int
        The number of windows wanted.

    Returns
    -------
    x, y : torch.Tensor
        (n', T) int64 with n' = min(n, (m − 1) // T); window i starts at
        ``(i·((m − 1) // T) // n') · T``, and ``y`` is ``x`` shifted by one character.
    """
    import torch

    fits = (len(ids) - 1) // context
    n = min(n, fits)
    starts = (np.arange(n) * fits // n) * context
    w = ids[starts[:, None] + np.arange(context + 1)]
    return torch.from_numpy(w[:, :-1].copy()), torch.from_numpy(w[:, 1:].copy())


def bits_per_char(logits, targets) -> float:
    """Mean cross-entropy of the next-character predictions, in bits per character.

    Parameters
    ----------
    logits : torch.Tensor
        (..., V) unnormalised log-probabilities.
    targets : torch.Tensor
        (...) int64 indices of the true next characters.

    Returns
    -------
    float
        The mean cross-entropy in nats divided by ln 2 (bits per character).
    """
    import torch.nn.functional as F

    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return float(ce) / math.log(2)


#: Attention scores one evaluation pass may hold in each layer (windows × heads × T², float32:
#: 1 GiB). Evaluation runs without gradients through PyTorch's fused encoder path, which
#: materialises the scores that training's memory-efficient attention does not.
EVAL_MAX_SCORES = 2**28


def eval_windows(heads: int, context: int, most: int = 16) -> int:
    """Windows per evaluation pass: ``most``, fewer where their attention scores would pass
    :data:`EVAL_MAX_SCORES` (long contexts), at least 1.

    Parameters
    ----------
    heads, context : int
        The model's attention heads and T.
    most : int, default 16
        The most windows per pass.

    Returns
    -------
    int
        In [1, ``most``].
    """
    return max(1, min(most, EVAL_MAX_SCORES // (heads * context * context)))


def evaluate(model, x, y, batch: int = 16) -> tuple[float, float]:
    """Validation bits per character and next-character accuracy of ``model`` on (x, y).

    Parameters
    ----------
    model : torch.nn.Module
        Maps (B, T) character indices to (B, T, V) logits; left in training mode.
    x, y : torch.Tensor
        (n, T) int64 inputs and targets (:func:`validation_windows`).
    batch : int
        Windows per forward pass.

    Returns
    -------
    bits_per_char, accuracy : float
        Over all n·T predictions.

    Raises
    ------
    ValueError
        If ``y`` holds no prediction (no window: a text shorter than the context + 1).
    """
    import torch
    import torch.nn.functional as F

    if y.numel() == 0:
        raise ValueError("y holds no prediction: no validation window (text shorter than T + 1)")
    model.eval()
    nats, hits = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            logits = model(x[i : i + batch])
            t = y[i : i + batch]
            nats += float(F.cross_entropy(logits.flatten(0, 1), t.flatten(), reduction="sum"))
            hits += int((logits.argmax(-1) == t).sum())
    model.train()
    return nats / y.numel() / math.log(2), hits / y.numel()


def _torch_module():
    from torch import nn

    class CharTransformer(nn.Module):
        """A decoder-only transformer over characters.

        Token and learned positional embeddings, ``layers`` pre-norm
        :class:`torch.nn.TransformerEncoderLayer` blocks (``heads`` heads, feed-forward
        4·width, GELU, no dropout) under a causal mask, a final layer norm, and an output layer
        tied to the token embedding.

        Parameters
        ----------
        vocab_size : int
            V, the number of characters (with the unknown entry).
        width : int
            The model dimension; ``heads`` divides it.
        layers, heads : int
            Number of blocks and attention heads.
        context : int
            The longest input, T.
        """

        def __init__(self, vocab_size: int, width: int, layers: int, heads: int, context: int):
            super().__init__()
            self.context = context
            self.embed = nn.Embedding(vocab_size, width)
            self.pos = nn.Embedding(context, width)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(
                    width,
                    heads,
                    4 * width,
                    dropout=0.0,
                    activation="gelu",
                    batch_first=True,
                    norm_first=True,
                )
                for _ in range(layers)
            )
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab_size, bias=False)
            nn.init.normal_(self.embed.weight, std=0.02)
            nn.init.normal_(self.pos.weight, std=0.02)
            self.head.weight = self.embed.weight  # tied
            # Not a buffer: DDP would broadcast it every step.
            self._mask = nn.Transformer.generate_square_subsequent_mask(context)

        def forward(self, idx):
            """Next-character logits, (B, T, V), for inputs ``idx`` of shape (B, T ≤ context).

            Parameters
            ----------
            idx : torch.Tensor
                (B, T) int64 character indices, T ≤ ``context``.

            Returns
            -------
            torch.Tensor
                (B, T, V) float logits; position t sees positions ≤ t only (causal mask).
            """
            T = idx.shape[1]
            h = self.embed(idx) + self.pos.weight[:T]
            mask = self._mask[:T, :T]
            for block in self.blocks:
                h = block(h, src_mask=mask, is_causal=True)
            return self.head(self.norm(h))

    return CharTransformer


def __getattr__(name):  # CharTransformer without importing torch at ``import spardl.lm``
    if name == "CharTransformer":
        cls = _torch_module()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def build_model(
    vocab_size: int,
    width: int = DEFAULTS["width"],
    layers: int = DEFAULTS["layers"],
    heads: int = DEFAULTS["heads"],
    context: int = DEFAULTS["context"],
):
    """A :class:`CharTransformer`; with the defaults and seed 0 (V = 104), 1,021,312 parameters.

    Imports torch. Initialised from ``torch``'s global RNG state.

    Parameters
    ----------
    vocab_size : int
        V, the number of characters (with :data:`UNKNOWN`).
    width : int, default 128
        The model dimension (divisible by ``heads``).
    layers, heads : int, default 5 and 4
        Number of transformer blocks and attention heads.
    context : int, default 128
        T, the longest input in characters.

    Returns
    -------
    CharTransformer
        A :class:`torch.nn.Module` mapping (B, T) int64 indices to (B, T, V) logits.
    """
    return __getattr__("CharTransformer")(vocab_size, width, layers, heads, context)


def default_lr_warmup(steps: int) -> int:
    """The learning rate's warm-up when ``--lr-warmup`` is not given: half the steps
    (:data:`DEFAULTS` ``lr_warmup_fraction``), rounded. docs/performance.md ("The learning
    rate's warm-up") has the measurements behind the fraction.

    Parameters
    ----------
    steps : int
        The run's total number of steps.

    Returns
    -------
    int
        ``round(DEFAULTS["lr_warmup_fraction"] · steps)`` (the fraction is 0.5): Python's
        rounding, half to even (3 steps give 2, and so do 5).
    """
    return round(DEFAULTS["lr_warmup_fraction"] * steps)


def lr_at(lr: float, t: int, total: int, warmup: int) -> float:
    """Learning rate at step t of ``total``: linear warm-up over ``warmup`` steps to ``lr``,
    then cosine-annealed to 0 (a function of the step alone, so resumes follow it).

    Parameters
    ----------
    lr : float
        The peak learning rate.
    t : int
        The step, counted from 0.
    total : int
        The run's number of steps.
    warmup : int
        Steps of warm-up (0 for none).

    Returns
    -------
    float
        ``lr · (t + 1) / warmup`` for t < ``warmup``; otherwise
        ``lr · ½ · (1 + cos(π · (t − warmup) / max(total − warmup, 1)))``, which is ``lr`` at
        t = ``warmup`` and, when ``total`` > ``warmup``, 0 at t = ``total``.
    """
    if t < warmup:
        return lr * (t + 1) / warmup
    span = max(total - warmup, 1)
    return lr * 0.5 * (1.0 + math.cos(math.pi * (t - warmup) / span))


def setup(args, rank: int, P: int):
    """The task's data and model for this rank (model initialised from ``torch``'s RNG state).

    Parameters
    ----------
    args : argparse.Namespace
        ``spardl train``'s options (``seed``, ``context``, ``width``, ``layers``, ``heads``).
    rank, P : int
        This rank and the number of ranks.

    Returns
    -------
    data : dict
        ``shard`` (this rank's encoded training text), ``val_x``, ``val_y`` (validation
        windows), ``vocab``, ``train_chars``, ``val_chars``.
    model : CharTransformer
    """
    train_text, val_text, _, _ = load_split(args.seed, DEFAULTS["val_fraction"])
    vocab = build_vocab(train_text)
    ids = encode(train_text, vocab)
    val_x, val_y = validation_windows(
        encode(val_text, vocab), args.context, DEFAULTS["eval_windows"]
    )
    data = {
        "shard": shard_of(ids, rank, P),
        "val_x": val_x,
        "val_y": val_y,
        "vocab": vocab,
        "train_chars": len(train_text),
        "val_chars": len(val_text),
    }
    model = build_model(len(vocab), args.width, args.layers, args.heads, args.context)
    return data, model


def train(tr, data: dict, resumed: dict | None) -> tuple[list[dict], dict]:
    """The lm training loop; collective over the job's ranks.

    Evaluates (on rank 0) and checkpoints after every ``--eval-every`` steps and after the
    last. The learning rate, the batches and hence the whole run are functions of the step, so
    a run resumed from a checkpoint continues bit for bit.

    Parameters
    ----------
    tr : spardl.train._Trainer
        The state the tasks share: options, model, optimizer, allreducer, checkpoints.
    data : dict
        This rank's data, from :func:`setup`.
    resumed : dict or None
        The checkpoint resumed from (its ``step`` and ``history``), if any.

    Returns
    -------
    history : list of dict
        One entry per evaluation: ``step``, ``seconds`` (training seconds so far, evaluation
        excluded), ``train_bits_per_char`` (mean over the ranks since the last evaluation),
        ``val_bits_per_char`` and ``val_accuracy`` (None off rank 0), ``bytes_sent_per_rank``.
    metrics : dict
        The task's entries of metrics.json, ``final_val_bits_per_char`` among them.
    """
    args, job, rank, P = tr.args, tr.job, tr.rank, tr.P
    history = resumed["history"] if resumed else []
    step = resumed["step"] if resumed else 0
    last = args.steps if args.stop_after is None else args.stop_after
    warmup = args.lr_warmup
    trained_s = history[-1]["seconds"] if history else 0.0
    tr.start_progress(last - step)
    tr.log(
        f"spardl train --task lm: {args.algorithm} P={P} density={tr.density} "
        f"n={tr.n_params} params, vocabulary {len(data['vocab'])}, "
        f"{data['train_chars']} train / {data['val_chars']} validation characters, "
        f"{len(data['shard'])} on this rank"
    )
    if step >= last:
        tr.log(f"nothing to train: the checkpoint is at step {step} of {last}")
    while step < last:
        t0 = time.perf_counter()
        end = min(last, (step // args.eval_every + 1) * args.eval_every)
        loss_sum = 0.0
        for t in range(step, end):
            x, y = train_batch(data["shard"], args.batch_size, args.context, args.seed, rank, t)
            for group in tr.opt.param_groups:
                group["lr"] = lr_at(args.lr, t, args.steps, warmup)
            loss_sum += tr.step(lambda net, x=x, y=y: _loss(net(x), y))
        mean_loss = float(job.allreduce(np.array([loss_sum / (end - step)]))[0] / P)
        trained_s += time.perf_counter() - t0
        step = end
        entry = {
            "step": step,
            "seconds": trained_s,
            "train_bits_per_char": mean_loss / math.log(2),
            "val_bits_per_char": None,
            "val_accuracy": None,
            "bytes_sent_per_rank": tr.bytes_sent_per_rank(),
        }
        if rank == 0:
            entry["val_bits_per_char"], entry["val_accuracy"] = evaluate(
                tr.model, data["val_x"], data["val_y"], eval_windows(args.heads, args.context)
            )
            tr.log(
                f"step {step:5d}/{args.steps}  train {entry['train_bits_per_char']:.3f} bpc  "
                f"val {entry['val_bits_per_char']:.3f} bpc  acc {entry['val_accuracy']:.2%}  "
                f"sent/rank {entry['bytes_sent_per_rank'] / 1e6:.3f} MB  "
                f"time {trained_s:.1f}s"
            )
        history.append(entry)
        tr.save({"step": step, "history": history})
    final = history[-1]["val_bits_per_char"] if history else None
    return history, {
        "steps": args.steps,
        "eval_every": args.eval_every,
        "layers": args.layers,
        "heads": args.heads,
        "context": args.context,
        "lr_warmup": args.lr_warmup,
        "optimizer": "adamw",
        "vocab_size": len(data["vocab"]),
        "train_chars": data["train_chars"],
        "val_chars": data["val_chars"],
        "eval_windows": len(data["val_x"]),
        "final_val_bits_per_char": final,
        "final_val_accuracy": history[-1]["val_accuracy"] if history else None,
    }


def _loss(logits, y):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), y.flatten())
