"""`spardl train --task lm`: the data, the model and bits per character in-process; smoke runs,
metrics and checkpoint/resume bit for bit under mpiexec (P = 2, a small model, 20 steps)."""

from __future__ import annotations

import argparse
import json
import math
import re

import numpy as np
import pytest
from mpirun import ROOT, run_mpi

from spardl import lm
from spardl.cli.common import UsageError
from spardl.train import _check_args, _resolve_task, _saved_options, add_arguments

torch = pytest.importorskip("torch")

ENV = {"PYTHONPATH": str(ROOT)}
# Small and fast: P = 2, a 2-block model of width 32 on 32-character windows, SparDL at 1%.
COMMON = [
    "-m",
    "spardl",
    "train",
    "--task",
    "lm",
    "--algorithm",
    "spardl",
    "--density",
    "0.01",
    "--width",
    "32",
    "--layers",
    "2",
    "--context",
    "32",
    "--batch-size",
    "4",
    "--steps",
    "20",
    "--eval-every",
    "10",
    "--seed",
    "3",
    "--no-progress",
]


# -- data, model, metric (no MPI) ---------------------------------------------------------------
def test_split_is_deterministic_disjoint_and_complete():
    from pydoc_data.topics import topics

    a = lm.load_split(0)
    assert a == lm.load_split(0)
    train_names, val_names = a[2], a[3]
    assert not set(train_names) & set(val_names)
    assert sorted(train_names + val_names) == sorted(topics)
    assert len(val_names) == round(0.1 * len(topics))
    assert lm.load_split(1)[3] != val_names  # the seed fixes the split
    assert all(topics[n] in a[0] for n in train_names)
    assert all(topics[n] in a[1] for n in val_names)


def test_vocabulary_has_an_unknown_entry():
    vocab = lm.build_vocab("hello world")
    assert vocab[0] == lm.UNKNOWN and vocab[1:] == sorted(set("hello world"))
    ids = lm.encode("held\u00e9!", vocab)
    assert ids.dtype == np.int64
    assert [vocab[i] for i in ids[:4]] == list("held")
    assert ids[4] == ids[5] == 0  # unseen characters
    train_text = lm.load_split(0)[0]
    assert len(lm.build_vocab(train_text)) == len(set(train_text)) + 1


def test_bits_per_char():
    V = 104
    y = torch.randint(0, V, (3, 7))
    assert lm.bits_per_char(torch.zeros(3, 7, V), y) == pytest.approx(math.log2(V), rel=1e-6)
    # Certain and right: 0 bits; a known distribution: -log2 p of the true character.
    sure = torch.full((2, V), -1e4)
    sure[0, 5] = sure[1, 9] = 0.0
    assert lm.bits_per_char(sure, torch.tensor([5, 9])) == pytest.approx(0.0, abs=1e-6)
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    assert lm.bits_per_char(logits, torch.tensor([1])) == pytest.approx(2.0, rel=1e-6)


def test_batches_are_seeded_by_seed_rank_and_step():
    ids = np.arange(1000, dtype=np.int64)
    x, y = lm.train_batch(ids, 4, 16, 0, 1, 5)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    assert torch.equal(x, lm.train_batch(ids, 4, 16, 0, 1, 5)[0])
    assert not torch.equal(x, lm.train_batch(ids, 4, 16, 0, 1, 6)[0])
    assert not torch.equal(x, lm.train_batch(ids, 4, 16, 0, 0, 5)[0])
    shards = [lm.shard_of(ids, r, 3) for r in range(3)]
    assert np.array_equal(np.concatenate(shards), ids)
    vx, vy = lm.validation_windows(ids, 16, 8)
    assert vx.shape == (8, 16) and torch.equal(vy, vx + 1)
    assert len(set(vx[:, 0].tolist())) == 8


def test_model_size_and_causality():
    torch.manual_seed(0)
    m = lm.build_model(104)
    n = sum(p.numel() for p in m.parameters())
    assert 1_000_000 <= n <= 3_000_000
    assert m.head.weight is m.embed.weight  # tied
    x = torch.randint(0, 104, (2, 40))
    x2 = x.clone()
    x2[:, 30:] = (x2[:, 30:] + 1) % 104
    with torch.no_grad():
        a, b = m(x), m(x2)
    assert a.shape == (2, 40, 104)
    assert torch.allclose(a[:, :30], b[:, :30], atol=1e-5)  # no peeking at later characters
    assert not torch.allclose(a[:, 30:], b[:, 30:])


def test_lr_warms_up_then_anneals():
    assert lm.lr_at(1.0, 0, 100, 10) == pytest.approx(0.1)
    assert lm.lr_at(1.0, 9, 100, 10) == pytest.approx(1.0)
    assert lm.lr_at(1.0, 10, 100, 10) == pytest.approx(1.0)
    assert lm.lr_at(1.0, 55, 100, 10) == pytest.approx(0.5)


def test_lr_without_warmup_starts_at_the_peak():
    assert lm.lr_at(1.0, 0, 100, 0) == pytest.approx(1.0)
    assert lm.lr_at(1.0, 50, 100, 0) == pytest.approx(0.5)


def test_a_checkpoint_from_before_lr_warmup_resumes_with_its_five_percent():
    """Checkpoints saved before ``--lr-warmup`` existed ran 5 % of their steps of warm-up: a
    resume compares that value with this run's, so the default's change cannot slip in."""
    old = {"options": {"task": "lm", "steps": 600, "algorithm": "spardl"}}
    assert _saved_options(old)["lr_warmup"] == 30
    new = {"options": {"task": "lm", "steps": 600, "lr_warmup": 150}}
    assert _saved_options(new)["lr_warmup"] == 150
    digits = {"options": {"task": "digits", "epochs": 2}}
    assert "lr_warmup" not in _saved_options(digits)
    assert _saved_options({"algorithm": "topka"}) == {"algorithm": "topka", "task": "digits"}


def _parse(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_task_defaults_and_usage_errors():
    args = _parse("--task", "lm")
    _resolve_task(args)
    _check_args(args, 2)
    assert (args.steps, args.batch_size, args.width, args.lr) == (
        lm.DEFAULTS["steps"],
        lm.DEFAULTS["batch_size"],
        lm.DEFAULTS["width"],
        lm.DEFAULTS["lr"],
    )
    assert args.epochs is None
    assert args.lr_warmup == round(lm.DEFAULTS["lr_warmup_fraction"] * lm.DEFAULTS["steps"])
    longer = _parse("--task", "lm", "--steps", "1200")
    _resolve_task(longer)
    _check_args(longer, 2)
    assert longer.lr_warmup == lm.default_lr_warmup(1200) == 600
    given = _parse("--task", "lm", "--steps", "100", "--lr-warmup", "0")
    _resolve_task(given)
    _check_args(given, 2)
    assert given.lr_warmup == 0
    digits = _parse()
    _resolve_task(digits)
    assert digits.task == "digits" and digits.epochs == 15 and digits.steps is None
    for argv, message in [
        (["--steps", "5"], "--steps applies to --task lm only"),
        (["--task", "lm", "--epochs", "2"], "--epochs applies to --task digits only"),
        (["--task", "lm", "--heads", "3"], "--heads must divide --width=128, got 3"),
        (["--lr-warmup", "5"], "--lr-warmup applies to --task lm only"),
        (
            ["--task", "lm", "--steps", "100", "--lr-warmup", "101"],
            "--lr-warmup must be in [0, --steps=100], got 101",
        ),
        (
            ["--task", "lm", "--steps", "100", "--eval-every", "20", "--stop-after", "30"],
            "--stop-after must be a multiple of --eval-every=20",
        ),
    ]:
        args = _parse(*argv)
        with pytest.raises(UsageError, match=re.escape(message)):
            _resolve_task(args)
            _check_args(args, 2)


# -- under mpiexec ------------------------------------------------------------------------------
def _load(path):
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("lm")


@pytest.fixture(scope="module")
def full(runs):
    """20 steps with --out and --checkpoint: the smoke run and the resume reference."""
    return run_mpi(
        2,
        [*COMMON, "--out", str(runs / "out"), "--checkpoint", str(runs / "full")],
        timeout=240,
        env=ENV,
    )


@pytest.mark.mpi
def test_smoke_writes_metrics(full, runs):
    m = json.loads((runs / "out" / "metrics.json").read_text())
    assert m["task"] == "lm" and m["algorithm"] == "spardl" and m["world_size"] == 2
    assert m["steps"] == 20 and m["hook"] == "reducer" and m["optimizer"] == "adamw"
    assert [e["step"] for e in m["history"]] == [10, 20]
    first, last = m["history"]
    for e in m["history"]:
        assert {"step", "seconds", "val_bits_per_char", "val_accuracy"} <= set(e)
        assert 0.0 <= e["val_accuracy"] <= 1.0
    assert 0 < first["seconds"] < last["seconds"] <= m["wall_seconds"]
    assert m["final_val_bits_per_char"] == last["val_bits_per_char"]
    # Learning: below the uniform guess (log2 V bits per character), and going down.
    assert last["val_bits_per_char"] < min(first["val_bits_per_char"], math.log2(m["vocab_size"]))
    assert m["bytes_sent_per_rank"] > 0 and len(m["bytes_sent_by_rank"]) == 2
    assert (runs / "out" / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "step    20/20" in full.stdout


@pytest.mark.mpi
def test_resume_equals_uninterrupted_bit_for_bit(full, runs):
    run_mpi(
        2, [*COMMON, "--stop-after", "10", "--checkpoint", str(runs / "half")], timeout=240, env=ENV
    )
    run_mpi(
        2,
        [*COMMON, "--resume", str(runs / "half"), "--checkpoint", str(runs / "resumed")],
        timeout=240,
        env=ENV,
    )
    for r in range(2):
        a, b = _load(runs / f"full.rank{r}.pt"), _load(runs / f"resumed.rank{r}.pt")
        assert a["step"] == b["step"] == 20 and a["task"] == "lm"
        for name, t in a["model"].items():
            assert torch.equal(t, b["model"][name]), f"rank {r}: parameter {name} differs"
        sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
        assert sa.keys() == sb.keys() and sa
        for key in sa:
            assert torch.equal(sa[key]["exp_avg"], sb[key]["exp_avg"])
            assert torch.equal(sa[key]["exp_avg_sq"], sb[key]["exp_avg_sq"])
        ra, rb = a["reducer"]["allreducer"], b["reducer"]["allreducer"]
        assert ra["step"] == rb["step"] == 20
        assert ra["residual"].numpy().tobytes() == rb["residual"].numpy().tobytes()
        assert abs(ra["residual"]).max() > 0
        strip = [{k: v for k, v in e.items() if k != "seconds"} for e in a["history"]]
        assert strip == [{k: v for k, v in e.items() if k != "seconds"} for e in b["history"]]


@pytest.mark.mpi
def test_ddp_hook_smoke(runs):
    run_mpi(
        2,
        [*COMMON, "--hook", "ddp", "--out", str(runs / "ddp"), "--checkpoint", str(runs / "d")],
        timeout=240,
        env=ENV,
    )
    m = json.loads((runs / "ddp" / "metrics.json").read_text())
    assert m["hook"] == "ddp" and [e["step"] for e in m["history"]] == [10, 20]
    assert m["final_val_bits_per_char"] < math.log2(m["vocab_size"])
    ck = _load(runs / "d.rank0.pt")
    assert ck["reducer"]["allreducer"]["step"] > 0
    assert abs(ck["reducer"]["allreducer"]["residual"]).max() > 0


def test_evaluate_refuses_an_empty_validation_set():
    import torch

    from spardl import lm

    model = lm.build_model(5, 8, 1, 2, 4)
    empty = torch.zeros((0, 4), dtype=torch.int64)
    with pytest.raises(ValueError, match="y holds no prediction"):
        lm.evaluate(model, empty, empty)


def test_evaluation_passes_keep_their_attention_scores_bounded():
    """Evaluation ran 16 windows per pass at any context: 13 windows of 4,096 characters took
    4 GB on one rank; the default context still runs 16 (the documented figures' passes)."""
    assert lm.eval_windows(4, 128) == 16
    assert lm.eval_windows(2, 4096) == 8  # 8 × 2 × 4096² = 2^28 scores
    assert lm.eval_windows(4, 4096) == 4
    assert lm.eval_windows(4, 16384) == 1  # at least one window
    for heads, context in [(1, 1), (3, 1000), (8, 3000)]:
        w = lm.eval_windows(heads, context)
        assert 1 <= w <= 16 and (w == 1 or w * heads * context**2 <= lm.EVAL_MAX_SCORES)


def test_a_resumed_optimizer_keeps_this_runs_adamw_implementation():
    """A checkpoint's param groups carry their optimizer's implementation flags: one written
    before the job used torch's fused AdamW would turn it off at a resume (the step 5× slower),
    one written with it would fail under a torch without a fused CPU AdamW. The run's own
    flags are kept; the optimizer's state comes from the checkpoint."""
    from types import SimpleNamespace

    from spardl.train import _load_checkpoint

    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(3, 2)
    old = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)
    model(torch.ones(1, 3)).sum().backward()
    old.step()
    ck = {"model": model.state_dict(), "optimizer": old.state_dict(), "reducer": {}}
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
    _load_checkpoint(ck, model, opt, SimpleNamespace(load_state_dict=lambda s: None), None)
    group = opt.param_groups[0]
    assert group["fused"] is True and group["foreach"] is None
    assert group["lr"] == 0.01 and opt.state[model.weight]["step"] == 1
