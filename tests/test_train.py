"""`spardl train` under mpiexec: smoke run, metrics, checkpoint/resume bit for bit, failures."""

from __future__ import annotations

import json
import re

import pytest
from mpirun import ROOT, run_mpi

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.mpi

ENV = {"PYTHONPATH": str(ROOT)}
# Small and fast: P = 2, a narrow model, SparDL at 1%.
COMMON = [
    "-m",
    "spardl",
    "train",
    "--algorithm",
    "spardl",
    "--density",
    "0.01",
    "--width",
    "4",
    "--batch-size",
    "32",
    "--seed",
    "3",
    "--no-progress",
]
# The same job with MPI's dense allreduce (which takes no --density).
DENSE = [*COMMON[:3], "--algorithm", "dense", *COMMON[7:]]
REQUIRED = {
    "algorithm",
    "world_size",
    "density",
    "epochs",
    "final_test_accuracy",
    "wall_seconds",
    "train_seconds",
    "bytes_sent_per_rank",
    "history",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="module")
def one_epoch(runs):
    """One epoch of a 2-epoch run, stopped as if interrupted, with --out and --checkpoint
    (also the first half of the resume test)."""
    proc = run_mpi(
        2,
        [
            *COMMON,
            "--epochs",
            "2",
            "--stop-after",
            "1",
            "--out",
            str(runs / "one"),
            "--checkpoint",
            str(runs / "ck1"),
        ],
        timeout=240,
        env=ENV,
    )
    return proc


def test_smoke_one_epoch_writes_metrics(one_epoch, runs):
    m = json.loads((runs / "one" / "metrics.json").read_text())
    assert REQUIRED <= set(m)
    assert m["task"] == "digits"
    assert m["algorithm"] == "spardl" and m["world_size"] == 2 and m["density"] == 0.01
    assert m["epochs"] == 2 and len(m["history"]) == 1
    assert 0.0 <= m["final_test_accuracy"] <= 1.0
    assert m["final_test_accuracy"] == m["history"][-1]["test_accuracy"]
    assert m["final_test_accuracy"] > 0.1  # better than chance after one epoch
    assert m["bytes_sent_per_rank"] > 0 and m["wall_seconds"] > 0
    # the training steps' seconds, evaluation and start-up excluded
    assert m["train_seconds"] == sum(e["seconds"] for e in m["history"]) > 0
    assert m["train_seconds"] < m["wall_seconds"]
    assert m["completed"] is False  # stopped after epoch 1 of 2
    assert len(m["bytes_sent_by_rank"]) == 2
    assert m["wire"] == "coo" and m["warmup_steps"] == 0  # the reducer's default, resolved
    assert "resumed_from" not in m
    png = runs / "one" / "training.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "epoch   1/2" in one_epoch.stdout
    for r in range(2):
        assert (runs / f"ck1.rank{r}.pt").exists()


def _load(path):
    return torch.load(path, weights_only=False)


def test_resume_equals_uninterrupted_bit_for_bit(one_epoch, runs):
    run_mpi(2, [*COMMON, "--epochs", "2", "--checkpoint", str(runs / "full")], timeout=240, env=ENV)
    run_mpi(
        2,
        [
            *COMMON,
            "--epochs",
            "2",
            "--resume",
            str(runs / "ck1"),
            "--checkpoint",
            str(runs / "resumed"),
        ],
        timeout=240,
        env=ENV,
    )
    for r in range(2):
        full = _load(runs / f"full.rank{r}.pt")
        res = _load(runs / f"resumed.rank{r}.pt")
        assert full["epoch"] == res["epoch"] == 2
        for name, t in full["model"].items():
            assert torch.equal(t, res["model"][name]), f"rank {r}: parameter {name} differs"
        mom_full = full["optimizer"]["state"]
        mom_res = res["optimizer"]["state"]
        assert mom_full.keys() == mom_res.keys() and mom_full
        for key in mom_full:
            assert torch.equal(mom_full[key]["momentum_buffer"], mom_res[key]["momentum_buffer"])
        ar_full, ar_res = full["reducer"]["allreducer"], res["reducer"]["allreducer"]
        assert ar_full["step"] == ar_res["step"] > 0
        assert ar_full["residual"].numpy().tobytes() == ar_res["residual"].numpy().tobytes()
        assert abs(ar_full["residual"]).max() > 0  # residuals are really carried
        assert full["reducer"]["stats"]["bytes_sent"] == res["reducer"]["stats"]["bytes_sent"]
        assert [h["loss"] for h in full["history"]] == [h["loss"] for h in res["history"]]


def test_resume_at_another_world_size(one_epoch, runs):
    """--resume under another -n (docs/reliability.md §4.1): the checkpoint of 2 ranks resumes at
    3, rank 2 starting from rank 0's model and optimizer with no residual of its own, the
    allreducer's step and the history carried over, and the run finishes its schedule."""
    proc = run_mpi(
        3,
        [
            *COMMON,
            *("--epochs", "2", "--resume", str(runs / "ck1"), "--checkpoint", str(runs / "p3")),
            *("--out", str(runs / "p3out")),
        ],
        timeout=240,
        env=ENV,
    )
    assert "resumed at P=3 from a checkpoint of P=2" in proc.stdout
    m = json.loads((runs / "p3out" / "metrics.json").read_text())
    assert m["world_size"] == 3 and m["resumed_from"] == {"world_size": 2, "epoch": 1}
    assert m["completed"] is True  # the resumed run trained to its schedule's end
    old = [_load(runs / f"ck1.rank{r}.pt") for r in range(2)]
    new = [_load(runs / f"p3.rank{r}.pt") for r in range(3)]
    steps_per_epoch = {ck["options"]["world_size"]: ck["reducer"]["step"] for ck in old}
    for ck in new:
        assert ck["epoch"] == 2 and ck["options"]["world_size"] == 3
        assert ck["history"][0]["loss"] == old[0]["history"][0]["loss"]  # from the checkpoint
        assert ck["reducer"]["allreducer"]["world_size"] == 3
        assert ck["reducer"]["step"] > steps_per_epoch[2]  # counted on from the checkpoint
        for name, t in ck["model"].items():  # one model on every rank
            assert torch.equal(t, new[0]["model"][name])
    assert new[0]["history"][1]["test_accuracy"] > 0.1


def test_ddp_hook_resume_equals_uninterrupted_bit_for_bit(runs):
    """--hook ddp: a fresh DDP after --resume (its first iteration in DDP's initial bucket
    order) continues bit for bit, as the reducer does."""
    ddp = [*COMMON, "--hook", "ddp", "--epochs", "2", "--warmup-steps", "2"]
    run_mpi(2, [*ddp, "--stop-after", "1", "--checkpoint", str(runs / "d1")], timeout=240, env=ENV)
    run_mpi(2, [*ddp, "--checkpoint", str(runs / "dfull")], timeout=240, env=ENV)
    run_mpi(
        2,
        [*ddp, "--resume", str(runs / "d1"), "--checkpoint", str(runs / "dres")],
        timeout=240,
        env=ENV,
    )
    for r in range(2):
        full = _load(runs / f"dfull.rank{r}.pt")
        res = _load(runs / f"dres.rank{r}.pt")
        assert full["epoch"] == res["epoch"] == 2
        for name, t in full["model"].items():
            assert torch.equal(t, res["model"][name]), f"rank {r}: parameter {name} differs"
        ar_full, ar_res = full["reducer"]["allreducer"], res["reducer"]["allreducer"]
        assert ar_full["step"] == ar_res["step"] > 0
        assert torch.equal(ar_full["residual"], ar_res["residual"])
        assert abs(ar_full["residual"]).max() > 0
        assert full["reducer"]["keys"] == [
            k for k in full["model"] if k.endswith(("weight", "bias"))
        ]
        assert [h["loss"] for h in full["history"]] == [h["loss"] for h in res["history"]]


def test_a_diverging_run_ends_with_one_line_and_status_1(tmp_path):
    """A learning rate that makes the gradient overflow: every rank's allreducer raises
    NonFiniteError at the same step, so the job ends with one line from rank 0, status 1, no
    traceback and no MPI_Abort."""
    argv = [*COMMON, "--epochs", "1", "--lr", "1e30", "--model", "mlp"]
    proc = run_mpi(2, [*argv, "--out", str(tmp_path)], timeout=120, env=ENV, check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("spardl train: error: the training diverged: "), proc.stderr
    assert "NaN or Inf" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr  # one line, from rank 0
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--density", "1.5"], "argument --density: must be a density in (0, 1], got 1.5"),
        (["--lr", "nan"], "argument --lr: must be a number in (0, 3.4e38] (float32's range)"),
        # Past float32's range torch's optimizers fail at the first step.
        (["--lr", "1e39"], "argument --lr: must be a number in (0, 3.4e38]"),
        (["--epochs", "x"], "argument --epochs: expected an integer >= 1, got 'x'"),
        (["--teams", "3"], "--teams must divide the number of ranks P=2, got 3"),
        (["--resume", "{tmp}/none"], "--resume: no checkpoint"),
        (["--out", "{tmp}/file/out"], "cannot create or write a directory for --out"),
        (["--out", "/proc"], "cannot create or write a directory for --out"),
        (["--checkpoint", "/proc/ck"], "cannot create or write a directory for --out"),
        (["--model", "rnn"], "argument --model: invalid choice: 'rnn'"),
        (["--dense-numel", "-1"], "argument --dense-numel: must be an integer >= 0, got -1"),
        # 1.8e15 parameters: refused before any rank allocates them.
        (["--width", "10000000"], "parameters: at least"),
        # Sizes PyTorch cannot describe: refused, not its traceback from every rank.
        (["--width", "100000000000000000000"], "is too large: PyTorch cannot build it"),
        (["--model", "mlp", "--width", "4000000000"], "is too large: PyTorch cannot build it"),
        # Path("") is the current folder: never what was meant.
        (["--out", ""], "argument --out: must be a path, got an empty string"),
        (["--checkpoint", ""], "argument --checkpoint: must be a path, got an empty string"),
        (["--resume", ""], "argument --resume: must be a path, got an empty string"),
        # A directory as --checkpoint once wrote DIR.rank0.pt beside it.
        (["--checkpoint", "{tmp}"], "is a directory; the option takes a prefix"),
        (["--resume", "{tmp}"], "is a directory: --resume takes the prefix"),
        (["--wire", "fp16"], "--wire fp16 applies to --algorithm dense only"),
        (
            ["--algorithm", "dense", "--wire", "compact"],
            "--wire compact applies to the sparse algorithms",
        ),
        # Options that would change nothing for dense (COMMON gives --density).
        (["--algorithm", "dense"], "--density applies to the sparse algorithms"),
    ],
)
def test_bad_option_is_a_usage_error_on_every_rank(tmp_path, option, message):
    """Option errors end every rank with status 2 and one line, no traceback, no abort; file
    options are checked before the first epoch."""
    (tmp_path / "file").write_text("a file where --out wants a directory")
    option = [o.replace("{tmp}", str(tmp_path)) for o in option]
    proc = run_mpi(2, [*COMMON, "--epochs", "1", *option], timeout=120, env=ENV, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr  # one line, from rank 0
    assert proc.stderr.startswith("spardl train: error: ")
    assert "epoch" not in proc.stdout  # nothing trained


def test_a_checkpoint_whose_files_are_not_one_set_is_a_usage_error(one_epoch, runs, tmp_path):
    """--resume from files that are not one checkpoint (of two steps, as a job stopped between
    two ranks' writes leaves them; rank 0's file under rank 1's name; a pickle that is no
    checkpoint; a file whose tensor data changed after it was written, or whose digests are
    missing or not strings): one line naming the problem, status 2, on every rank, nothing
    trained."""
    ck0, ck1 = _load(runs / "ck1.rank0.pt"), _load(runs / "ck1.rank1.pt")
    torch.save(ck0, tmp_path / "mix.rank0.pt")
    torch.save({**ck1, "epoch": ck1["epoch"] + 1}, tmp_path / "mix.rank1.pt")
    torch.save(ck0, tmp_path / "swap.rank0.pt")
    torch.save(ck0, tmp_path / "swap.rank1.pt")
    torch.save({"a": 1}, tmp_path / "none.rank0.pt")
    # Damaged inside a tensor's data (the pickle still loads): once resumed with the ranks'
    # models differing, silently.
    torch.save(ck0, tmp_path / "bad.rank0.pt")
    name = next(iter(ck1["model"]))
    ck1["model"][name].view(-1)[0] += 1.0
    torch.save(ck1, tmp_path / "bad.rank1.pt")
    # Damaged in the digests themselves: a missing digest skipped the check of its state, a
    # digest field of another type raised a raw TypeError.
    torch.save(ck0, tmp_path / "nodigest.rank0.pt")
    torch.save(
        {**ck1, "sha256": {"optimizer": "0", "reducer": "0"}}, tmp_path / "nodigest.rank1.pt"
    )
    torch.save({**ck0, "sha256": 5}, tmp_path / "digest5.rank0.pt")
    torch.save(ck1, tmp_path / "digest5.rank1.pt")
    digests = "is damaged: its SHA-256 digests are not the three strings"
    for name, message in [
        ("nodigest", f"nodigest.rank1.pt {digests}"),
        ("digest5", f"digest5.rank0.pt {digests}"),
        ("bad", "bad.rank1.pt is damaged: its model state does not match the SHA-256 digest"),
        ("mix", "is of P=2, epoch 2, rank 0's of P=2, epoch 1: not one checkpoint"),
        ("swap", "swap.rank1.pt holds rank 0's state, not rank 1's"),
        ("none", "none.rank0.pt is not a spardl train checkpoint (no model, optimizer, reducer)"),
    ]:
        argv = [*COMMON, "--epochs", "2", "--resume", str(tmp_path / name)]
        proc = run_mpi(2, argv, timeout=120, env=ENV, check=False)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr, proc.stderr
        assert proc.stderr.strip().count("\n") == 0, proc.stderr
        assert "epoch" not in proc.stdout


def test_a_checkpoint_path_reused_at_a_smaller_then_larger_world_size(tmp_path):
    """Saving at P = 1 over a checkpoint of P = 2 removes the old rank 1 file, so a resume at
    P = 2 starts from the P = 1 checkpoint instead of mixing the two; every file is written
    whole (no .tmp left); a resume with nothing left to train says so."""
    ck, out = tmp_path / "ck", str(tmp_path / "out")
    base = [*COMMON, "--epochs", "3", "--out", out]
    run_mpi(2, [*base, "--stop-after", "1", "--checkpoint", str(ck)], timeout=240, env=ENV)
    assert (tmp_path / "ck.rank1.pt").exists()
    run_mpi(
        1,
        [*base, "--stop-after", "2", "--resume", str(ck), "--checkpoint", str(ck)],
        timeout=240,
        env=ENV,
    )
    assert sorted(p.name for p in tmp_path.glob("ck*")) == ["ck.rank0.pt"]
    proc = run_mpi(2, [*base, "--resume", str(ck), "--checkpoint", str(ck)], timeout=240, env=ENV)
    assert "resumed at P=2 from a checkpoint of P=1" in proc.stdout
    assert sorted(p.name for p in tmp_path.glob("ck*")) == ["ck.rank0.pt", "ck.rank1.pt"]
    assert [_load(tmp_path / f"ck.rank{r}.pt")["epoch"] for r in range(2)] == [3, 3]
    proc = run_mpi(2, [*base, "--resume", str(ck)], timeout=240, env=ENV)
    assert "nothing to train: the checkpoint is at epoch 3 of 3" in proc.stdout


def test_an_option_given_at_its_default_resumes(one_epoch, runs, tmp_path):
    """--warmup-steps 0 is the reducer's default: a resume that gives it must take a checkpoint
    saved without it, also one whose options hold it as given (None, as spardl once saved
    them), where the resume was refused as "saved with --warmup-steps None"."""
    for r in range(2):
        ck = _load(runs / f"ck1.rank{r}.pt")
        assert ck["options"]["warmup_steps"] == 0  # saved resolved now
        ck["options"]["warmup_steps"] = None
        torch.save(ck, tmp_path / f"old.rank{r}.pt")
    argv = [*COMMON, "--epochs", "2", "--resume", str(tmp_path / "old"), "--warmup-steps", "0"]
    proc = run_mpi(2, argv, timeout=240, env=ENV)
    assert "epoch   2/2" in proc.stdout


def test_an_lm_too_deep_for_memory_is_refused_at_once(tmp_path):
    """10^8 blocks: the count once built every block on the meta device (hours). 20,000: the
    check counted parameters only (4 GB at 16 bytes each), not the activations (168 GB), so
    deep models passed it and were killed for memory (2,000 blocks, on a 24 GiB machine)."""
    for layers in ("100000000", "20000"):
        argv = ["-m", "spardl", "train", "--task", "lm", "--steps", "1", "--eval-every", "1"]
        proc = run_mpi(1, [*argv, "--layers", layers], timeout=120, env=ENV, check=False)
        assert proc.returncode == 2, proc.stderr
        assert "GiB of activations each), more than the" in proc.stderr, proc.stderr


def test_the_memory_bound_is_below_what_a_run_holds_and_refuses_the_run_once_killed(tmp_path):
    """The check is a lower bound: a small lm run holds more than the check counts for it (it
    never refuses a run that fits), and not over twice as much. 2,000 blocks of the default
    shape on one rank passed the check (21.5 GiB counted) and were killed for memory on a 24 GiB
    machine: it counted no rank's own memory and too few activation bytes."""
    import re
    from types import SimpleNamespace

    from spardl import train

    shape = dict(task="lm", width=128, layers=10, heads=4, context=128, batch_size=8, seed=0)
    argv = ["--task", "lm", "--steps", "2", "--eval-every", "2", "--layers", "10"]
    argv += ["--out", str(tmp_path / "out"), "--no-progress"]
    proc = run_mpi(1, ["tests/scripts/peak_rss.py", *argv], timeout=240, env=ENV)
    peak = int(re.findall(r"PEAK_BYTES (\d+)", proc.stderr)[-1])

    def need(**change):
        args = SimpleNamespace(**{**shape, "model": "cnn", **change})
        return train._memory_need(train._model_numel(args), *train._activation_bytes(args), 1, True)

    assert peak / 2 < need() <= peak, (need(), peak)
    assert need(layers=2000) > 23 * 2**30  # the machine had 22.4 GiB available


def test_ctrl_c_ends_every_rank_in_one_line_with_status_130(tmp_path):
    """mpiexec passes SIGINT to every rank: each once printed a KeyboardInterrupt traceback and
    "rank 0 failed; aborting every rank", as for a crash. The epoch lines logged before it
    reach a redirected stdout (it was block-buffered, and a killed job lost them)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from mpirun import mpiexec

    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    cmd = [mpiexec(), "-n", "2", sys.executable, *COMMON, "--epochs", "100000"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_"))}
    env.update(ENV, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    env.pop("PYTHONUNBUFFERED", None)  # as a user's shell has it
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fo, stderr=fe)
        try:
            deadline = time.monotonic() + 180
            while "epoch   2/" not in out.read_text() and time.monotonic() < deadline:
                assert proc.poll() is None, err.read_text()
                time.sleep(0.5)
            assert "epoch   2/" in out.read_text(), "no epoch line reached the file"
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = err.read_text()
    assert code == 130, text
    assert "spardl train: interrupted on rank" in text
    assert "Traceback" not in text and "failed; aborting" not in text


def test_no_progress_bar_reaches_a_redirected_log(tmp_path):
    """Without --no-progress the bar was drawn whatever stderr was, and a log redirected to a
    file filled with carriage-return redraws; now it is drawn where mpiexec's stderr is a
    terminal (a pseudo-terminal here), and a log gets the epoch lines alone."""
    import os
    import subprocess
    import sys

    from mpirun import mpiexec

    argv = [a for a in COMMON if a != "--no-progress"]
    proc = run_mpi(2, [*argv, "--epochs", "1"], timeout=240, env=ENV)
    assert "\r" not in proc.stdout + proc.stderr and "epoch   1/1" in proc.stdout
    probe = "from spardl.train import _stderr_reaches_a_terminal as f; print(f())"
    main, sub = os.openpty()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_"))}
        for stderr in (subprocess.PIPE, sub):
            tty = subprocess.run(
                [mpiexec(), "-n", "2", sys.executable, "-c", probe],
                cwd=ROOT,
                env={**env, **ENV},
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                timeout=120,
            )
            want = "True" if stderr == sub else "False"
            # mpiexec forwards each rank's bytes as they come: two lines may interleave
            # ("FalseFalse\n\n"), so count the answers rather than split lines
            assert re.findall("True|False", tty.stdout) == [want, want], tty.stdout
    finally:
        os.close(main)
        os.close(sub)


def test_a_batch_larger_than_a_shard_is_said(tmp_path):
    """--batch-size beyond a rank's samples trains one step per epoch on all of them, and says
    so (1,437 training images: 718 per rank at P = 2)."""
    argv = [*COMMON, "--epochs", "1", "--batch-size", "100000", "--out", str(tmp_path)]
    proc = run_mpi(2, argv, timeout=240, env=ENV)
    assert "1 steps/epoch (--batch-size 100000 is more than a rank's 718 samples" in proc.stdout


def test_exception_on_one_rank_aborts_the_job():
    proc = run_mpi(2, ["tests/scripts/fail_one_rank.py"], timeout=60, env=ENV, check=False)
    assert proc.returncode != 0
    assert "injected failure on rank 1" in proc.stderr
    assert "rank 0 passed the collective" not in proc.stdout


def test_info_lists_versions_and_mpi():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "spardl", "info"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    labels = {line.split("  ")[0].strip() for line in proc.stdout.splitlines()}
    assert {
        "spardl",
        "numpy",
        "numba",
        "mpi4py",
        "MPI library",
        "torch",
        "CPU threads",
        "CUDA-aware MPI",
    } <= labels


def test_dgc_techniques_are_recorded_and_checkpointed(runs):
    """--momentum-correction (the optimizer then has momentum 0), --clip-norm and the density
    warm-up: recorded in metrics.json; the velocities are in the checkpoint, keyed by parameter."""
    dgc = ["--momentum-correction", "--clip-norm", "5", "--density-warmup", "30"]
    dgc += ["--dense-numel", "64"]  # the CNN's biases (and its 64-element layers) reduced dense
    out, ck = runs / "dgc", runs / "dgc_ck"
    run_mpi(
        2,
        [*COMMON, "--epochs", "1", *dgc, "--out", str(out), "--checkpoint", str(ck)],
        timeout=240,
        env=ENV,
    )
    m = json.loads((out / "metrics.json").read_text())
    assert m["momentum_correction"] and m["factor_masking"]
    assert (m["momentum"], m["optimizer_momentum"]) == (0.9, 0.0)
    assert (m["clip_norm"], m["density_warmup"], m["warmup_density"]) == (5.0, 30, 0.25)
    saved = _load(ck.parent / f"{ck.name}.rank0.pt")
    assert saved["reducer"]["techniques"]["momentum_correction"] == 0.9
    assert m["dense_numel"] == saved["reducer"]["techniques"]["dense_numel"] == 64
    vel = saved["reducer"]["velocity"]
    assert sorted(vel) == sorted(k for k in saved["model"] if k.endswith(("weight", "bias")))
    assert any(bool(v.abs().max() > 0) for v in vel.values())
    # Mid warm-up (23 sparse steps of 30): the allreducer's density is above the target.
    assert 0.01 < saved["reducer"]["allreducer"]["density"] < 0.25
    assert all("momentum_buffer" not in s for s in saved["optimizer"]["state"].values())


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--no-factor-masking"], "--no-factor-masking applies with --momentum-correction only"),
        (["--warmup-density", "0.3"], "--warmup-density applies with --density-warmup only"),
        (
            ["--density-warmup", "5", "--warmup-density", "0.001"],
            "--warmup-density must be >= --density=0.01",
        ),
        (
            ["--momentum-correction", "--residual", "none"],
            "--momentum-correction needs error feedback",
        ),
    ],
)
def test_bad_dgc_options_are_usage_errors(option, message):
    """Checked before any communication (in this process: the parser and the argument check)."""
    from spardl.cli import build_parser
    from spardl.cli.common import UsageError
    from spardl.train import _check_args, _resolve_task

    args = build_parser().parse_args(["train", *COMMON[3:], *option])
    _resolve_task(args)
    with pytest.raises(UsageError, match=message):
        _check_args(args, 2)


@pytest.mark.parametrize(
    "option",
    [
        ["--density", "0.5"],
        ["--residual", "none"],
        ["--density-warmup", "3"],
        ["--warmup-density", "0.5"],
        ["--dense-numel", "5"],
    ],
)
def test_sparse_only_options_with_dense_are_usage_errors(option):
    """With --algorithm dense, which reduces every entry and keeps no residual, the options
    that shape only the sparse reduction would change nothing: each is refused by name. Dense
    alone takes the defaults and reports density 1."""
    from spardl.cli import build_parser
    from spardl.cli.common import UsageError
    from spardl.train import _check_args, _resolve_task, reported_density

    args = build_parser().parse_args(["train", *DENSE[3:], *option])
    _resolve_task(args)
    with pytest.raises(UsageError, match=f"^{option[0]} applies to the sparse algorithms"):
        _check_args(args, 2)
    args = build_parser().parse_args(["train", *DENSE[3:], "--momentum-correction"])
    _resolve_task(args)
    _check_args(args, 2)  # momentum correction moves the momentum: it applies to dense too
    assert (args.density, args.residual, reported_density(args)) == (0.01, "global", 1.0)


def test_explain_applies_to_auto_only():
    """--algorithm auto is a choice; --explain with another algorithm is a usage error."""
    from spardl.cli import build_parser
    from spardl.cli.common import UsageError
    from spardl.train import _check_args, _resolve_task

    args = build_parser().parse_args(["train", *COMMON[3:], "--explain"])
    _resolve_task(args)
    with pytest.raises(UsageError, match="--explain applies to --algorithm auto only"):
        _check_args(args, 2)
    args = build_parser().parse_args(["train", *COMMON[3:], "--algorithm", "auto", "--explain"])
    _resolve_task(args)
    _check_args(args, 2)
    assert args.algorithm == "auto" and args.explain


@pytest.mark.parametrize(
    ("option", "numel"),
    [
        (["--task", "digits"], 38_282),
        (["--task", "digits", "--model", "mlp", "--width", "1024"], 1_126_410),
        (["--task", "lm"], 1_021_312),
    ],
)
def test_model_size_counts_the_model_built(option, numel):
    """The memory check's count (on the meta device) is the built model's, without building it."""
    from spardl import lm
    from spardl.cli import build_parser
    from spardl.train import _model_numel, _resolve_task, build_model

    args = build_parser().parse_args(["train", *option])
    _resolve_task(args)
    assert _model_numel(args) == numel
    if args.task == "lm":
        model = lm.setup(args, 0, 2)[1]
    else:
        model = build_model(args.width, args.model)
    assert sum(p.numel() for p in model.parameters()) == numel


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--context", "100000"], "--context must be at most"),
        (["--batch-size", "100000"], "--batch-size × --context must be at most 1048576"),
        # 8 windows of 8,192: 2**29 scores (the job's default batch is one window)
        (
            ["--batch-size", "8", "--context", "8192"],
            "--batch-size × --context² must be at most 268435456",
        ),
    ],
)
def test_lm_sizes_are_bounded_usage_errors(option, message):
    """--task lm: a window must fit in the shortest text, and a step in a sane memory bound."""
    from spardl.cli import build_parser
    from spardl.cli.common import UsageError
    from spardl.train import _check_args, _resolve_task

    args = build_parser().parse_args(["train", "--task", "lm", *option])
    _resolve_task(args)
    with pytest.raises(UsageError, match=message.replace("×", ".").replace("²", ".")):
        _check_args(args, 2)


@pytest.mark.parametrize(
    ("P", "option", "message"),
    [
        (2, ["--density", "0.5"], "saved with --density 0.01; this run has --density 0.5"),
        # The hook's default warm-up differs too (the steps run, as saved and compared).
        (
            2,
            ["--hook", "ddp"],
            "saved with --hook reducer, --warmup-steps 0; "
            "this run has --hook ddp, --warmup-steps 2",
        ),
        (2, ["--algorithm", "topka"], "saved with --algorithm spardl"),
        (2, ["--wire", "compact"], "saved with --wire coo; this run has --wire compact"),
        # At another world size (an elastic resume) the other options must match all the same:
        # another algorithm, another n (the model's width).
        (
            1,
            ["--algorithm", "topka", "--width", "5"],
            "saved with --algorithm spardl, --width 4; this run has --algorithm topka, --width 5",
        ),
    ],
)
def test_resume_with_other_run_options_is_a_usage_error(one_epoch, runs, P, option, message):
    """Every option that changes the run must be the checkpoint's: else one line, status 2,
    before training (nothing silently taken from the checkpoint, nothing misrecorded)."""
    args = [*COMMON, "--epochs", "2", "--resume", str(runs / "ck1"), "--out", str(runs / "x")]
    proc = run_mpi(P, [*args, *option], timeout=120, env=ENV, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "epoch" not in proc.stdout
    assert not (runs / "x" / "metrics.json").exists()


def test_mlp_model_trains_and_is_recorded(tmp_path):
    """``--model mlp``: two hidden layers of --width units (64·w + w + w·w + w + 10·w + 10
    parameters), trained and recorded in metrics.json; the CNN stays the default."""
    from spardl.train import build_model

    w = 24
    mlp = build_model(w, "mlp")
    assert sum(p.numel() for p in mlp.parameters()) == 64 * w + w + w * w + w + 10 * w + 10
    with pytest.raises(ValueError, match="^model must be one of cnn, mlp, got 'rnn'"):
        build_model(w, "rnn")
    from spardl.cli import build_parser
    from spardl.cli.common import UsageError
    from spardl.train import _check_args, _resolve_task

    args = build_parser().parse_args(["train", "--task", "lm", "--model", "mlp"])
    with pytest.raises(UsageError, match="--model applies to --task digits only"):
        _resolve_task(args)
    args = build_parser().parse_args(["train", *COMMON[3:]])
    _resolve_task(args)
    assert args.model == "cnn"
    args.model = "rnn"  # a Namespace built without the parser
    with pytest.raises(UsageError, match="--model must be one of cnn, mlp, got 'rnn'"):
        _check_args(args, 2)
    w = 64
    argv = [*COMMON, "--model", "mlp", "--width", str(w), "--density", "0.25", "--epochs", "2"]
    argv += ["--out", str(tmp_path)]
    run_mpi(2, argv, timeout=240, env=ENV)
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["model"] == "mlp" and m["width"] == w
    assert m["n_params"] == 64 * w + w + w * w + w + 10 * w + 10
    assert m["final_test_accuracy"] > 0.5  # far above chance (0.1) after two epochs (0.68)


def test_fp16_wire_is_the_16_bit_dense_allreduce(tmp_path):
    """``--algorithm dense --wire fp16``: the same training at exactly half of dense's bytes
    (float16 values and bound on the wire), recorded as such; other algorithms refuse it."""
    from spardl.cli import build_parser
    from spardl.cli.common import UsageError
    from spardl.train import _allreducer_options, _check_args, _resolve_task

    args = build_parser().parse_args(["train", *COMMON[3:], "--wire", "fp16"])
    _resolve_task(args)
    with pytest.raises(UsageError, match="--wire fp16 applies to --algorithm dense only"):
        _check_args(args, 2)
    dense = [*DENSE, "--wire", "fp16"]
    args = build_parser().parse_args(["train", *dense[3:]])
    _resolve_task(args)
    _check_args(args, 2)
    options = _allreducer_options(args)
    assert options["wire_dtype"] == "float16" and "wire" not in options
    metrics = {}
    for wire in ("coo", "fp16"):
        out = tmp_path / wire
        argv = [*DENSE, "--wire", wire, "--epochs", "1"]
        run_mpi(2, [*argv, "--out", str(out)], timeout=240, env=ENV)
        metrics[wire] = json.loads((out / "metrics.json").read_text())
    assert metrics["fp16"]["wire"] == "fp16"
    assert metrics["coo"]["density"] == metrics["fp16"]["density"] == 1.0  # dense sends all
    assert [metrics[w]["residual"] for w in ("coo", "fp16")] == [None, None]  # keeps no residual
    # Per step at P = 2: 2n + 8 bytes (n halves, then one float64 for the scale) against
    # 4(n + 1) (n floats and the bound).
    n = metrics["coo"]["n_params"]
    b16, b32 = (metrics[w]["bytes_sent_per_rank"] for w in ("fp16", "coo"))
    assert b16 * 4 * (n + 1) == b32 * (2 * n + 8) and b32 > 0
    a16, a32 = (metrics[w]["final_test_accuracy"] for w in ("fp16", "coo"))
    assert abs(a16 - a32) < 0.05, (a16, a32)  # float16 rounding, not another training
