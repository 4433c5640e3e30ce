"""The bench scripts' arguments: a bad one is one line from rank 0 and status 2 on every rank,
before any allreducer is built or any benchmark runs (not a traceback from inside the library,
nor a failure to write an output after the whole run)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys

import numba
import pytest
from mpirun import ROOT, run_mpi

import spardl.cluster

pytestmark = pytest.mark.mpi

NUMBA_NUM_THREADS = numba.config.NUMBA_NUM_THREADS  # the scripts' children inherit it


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--n", "0"], "argument --n: must be an integer in [1, 2**31 - 1] (elements), got 0"),
        (["--density", "2"], "argument --density: must be a density in (0, 1], got 2"),
        (["--repeat", "0"], "argument --repeat: must be an integer >= 1, got 0"),
        (["--teams", "3", "--n", "100"], "--teams must divide the number of ranks P=2, got 3"),
        # Past 2**31 - 1 elements NumPy fails on every rank ("Maximum allowed dimension
        # exceeded", a MemoryError).
        (
            ["--n", "1000000000000"],
            "argument --n: must be an integer in [1, 2**31 - 1] (elements), got 1000000000000",
        ),
        # A --scale whose gradients (or their sums over P = 2) overflow the dtype: every rank
        # raised NonFiniteError mid-run; the bound depends on P, so it is checked under mpiexec.
        (
            ["--n", "1000", "--scale", "1e300"],
            "argument --scale: must be at most 1.04e+35 for float32 gradients of n = 1000 on "
            "P = 2 rank(s) (Student-t values up to 1640 times the scale would overflow float32), "
            "got 1e+300",
        ),
        (["--algorithms", ""], "argument --algorithms: expected at least one comma-separated name"),
    ],
)
def test_bad_allreduce_bench_argument_is_one_line(args, message):
    proc = run_mpi(2, ["bench/allreduce.py", *args], timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith(f"allreduce.py: error: {message}"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# Every other bench script: a bad value fails in the parser (status 2, the option named, no
# traceback), before any benchmark work. Single-process runs (the parser is the same at any P);
# "{out}" stands for a writable path in the test's temporary directory.
TOO_LONG = str(2**31)  # one past the longest gradient a bench script builds
HUGE = "99999999999999999999"  # past any C integer

BAD = [
    ("kernels.py", ["--sizes", "0"], "--sizes"),
    ("kernels.py", ["--sizes", TOO_LONG], "--sizes"),
    ("kernels.py", ["--sizes", "1000000000000"], "--sizes"),
    ("kernels.py", ["--sizes", HUGE], "--sizes"),
    # torch.set_num_threads(100000) segfaulted; a 20-digit count overflowed a C int.
    ("kernels.py", ["--torch-threads", "1025"], "--torch-threads"),
    ("kernels.py", ["--torch-threads", "100000"], "--torch-threads"),
    ("kernels.py", ["--torch-threads", HUGE], "--torch-threads"),
    # More than Numba's pool holds: spardl_kernels would use NUMBA_NUM_THREADS, not this.
    ("kernels.py", ["--threads", str(NUMBA_NUM_THREADS + 1)], "NUMBA_NUM_THREADS"),
    ("kernels.py", ["--repeat", "0"], "--repeat"),
    ("kernels.py", ["--density", "-1"], "--density"),
    ("kernels.py", ["--density", "0"], "--density"),
    ("kernels.py", ["--threads", "0"], "--threads"),
    ("kernels.py", ["--torch-threads", "0"], "--torch-threads"),
    ("kernels.py", ["--merge-parallel-min", "-1"], "--merge-parallel-min"),
    ("step_local.py", ["--n", "0"], "--n"),
    ("step_local.py", ["--n", TOO_LONG], "--n"),
    ("step_local.py", ["--density", "5"], "--density"),
    ("step_local.py", ["--repeat", "0"], "--repeat"),
    ("step_local.py", ["--algorithms", "nope"], "--algorithms"),
    ("wire.py", ["--n", "0"], "--n"),
    ("wire.py", ["--n", TOO_LONG], "--n"),
    ("wire.py", ["--n", HUGE], "--n"),
    ("wire.py", ["--algorithms", ""], "--algorithms"),
    ("wire.py", ["--algorithms", ","], "--algorithms"),
    ("wire.py", ["--density", "0"], "--density"),
    ("wire.py", ["--repeat", "0"], "--repeat"),
    ("wire.py", ["--warmup", "-1"], "--warmup"),
    ("wire.py", ["--seed", "-1"], "--seed"),
    ("wire.py", ["--teams", "2"], "--teams"),
    ("wire.py", ["--json", "/nonexistent/x.json"], "--json"),
    # An empty path was the current folder: --out "" wrote there.
    ("wire.py", ["--json", ""], "--json: must be a path, got an empty string"),
    ("cluster.py", ["--out", ""], "--out: must be a path, got an empty string"),
    ("after_idle.py", ["--n", "0"], "--n"),
    ("after_idle.py", ["--n", TOO_LONG], "--n"),
    ("after_idle.py", ["--repeat", "0"], "--repeat"),
    ("after_idle.py", ["--density", "1.5"], "--density"),
    ("after_idle.py", ["--pause", "-1"], "--pause"),
    ("auto_step.py", ["--n", "0"], "--n"),
    ("auto_step.py", ["--n", TOO_LONG], "--n"),
    ("auto_step.py", ["--steps", "0"], "--steps"),
    ("auto_step.py", ["--rounds", "0"], "--rounds"),
    ("auto_step.py", ["--trials", "-1"], "--trials"),
    ("auto_step.py", ["--interval", "0"], "--interval"),
    ("agreement.py", ["--calls", "0"], "--calls"),
    ("agreement.py", ["--rounds", "0"], "--rounds"),
    ("overlap.py", ["{out}", "--steps", "0"], "--steps"),
    ("overlap.py", ["{out}", "--warmup", "2"], "--warmup"),
    ("overlap.py", ["{out}", "--delay-ms", "-1"], "--delay-ms"),
    ("overlap.py", ["{out}", "--algorithm", "nope"], "--algorithm"),
    ("overlap.py", ["/nonexistent/x.json"], "json_path"),
    ("gpu.py", ["{out}", "--budget-s", "0"], "--budget-s"),
    ("gpu.py", ["{out}", "--sizes", "0"], "--sizes"),
    ("gpu.py", ["{out}", "--sizes", f"1000,{TOO_LONG}"], "--sizes"),
    ("gpu.py", ["/nonexistent/x.json"], "json_path"),
    ("allreduce.py", ["--json", "/nonexistent/x.json"], "--json"),
    ("allreduce.py", ["--plot", "/nonexistent/x.png"], "--plot"),
    ("allreduce.py", ["--plot", "{out}.nope"], "--plot"),
    ("allreduce.py", ["--scale", "0"], "--scale"),
    ("allreduce.py", ["--n", HUGE], "--n"),
    ("allreduce.py", ["--n", "1000000000000"], "--n"),
    ("allreduce.py", ["--n", "1000", "--scale", "1e300"], "--scale"),
    ("allreduce.py", ["--n", "1000", "--scale", "1e39"], "--scale"),
    ("allreduce.py", ["--n", "1000", "--dtype", "float16", "--scale", "1e5"], "--scale"),
    ("allreduce.py", ["--n", "1000", "--dtype", "float64", "--scale", "1e306"], "--scale"),
    ("allreduce.py", ["--algorithms", ""], "--algorithms"),
    ("allreduce.py", ["--algorithms", ","], "--algorithms"),
    ("cluster.py", ["--n", "0"], "--n"),
    ("cluster.py", ["--n", HUGE], "--n"),
    ("cluster.py", ["--n", TOO_LONG], "--n"),
    ("cluster.py", ["--layout", "4x1000"], "--layout"),
    ("cluster.py", ["--density", "0"], "--density"),
    ("cluster.py", ["--repeat", "0"], "--repeat"),
    ("cluster.py", ["--bandwidth", "fast"], "--bandwidth"),
    ("cluster.py", ["--algorithms", "nope"], "algorithm"),
    ("cluster.py", ["--layout", "251x1"], "--layout"),
    ("cluster.py", ["--layout", "4x0"], "--layout"),
    ("cluster.py", ["--out", "/proc/x"], "--out"),
    ("training.py", ["--world-size", "0"], "--world-size"),
    # P = 1 trained, then failed on its table (no allreduce sends a byte); a huge P ran P = 1.
    ("training.py", ["-n", "1"], "no allreduce sends a byte"),
    ("training.py", ["-n", HUGE], "--world-size"),
    ("training.py", ["-n", "1025"], "--world-size"),
    ("training.py", ["-n", "251", "--bandwidth", "1gbit"], "at most 250 nodes"),
    ("training.py", ["-n", "2", "--configs", "spardl-d4"], "--configs"),
    ("training.py", ["--density", "0"], "--density"),
    ("training.py", ["--seeds", "-1"], "--seeds"),
    ("training.py", ["--steps", "0"], "--steps"),
    ("training.py", ["--lr", "0"], "--lr"),
    ("training.py", ["--out", "/proc/x"], "--out"),
    ("validate_model.py", ["--n", "0"], "--n"),
    ("validate_model.py", ["--n", TOO_LONG], "--n"),
    ("validate_model.py", ["--repeat", "0"], "--repeat"),
    ("validate_model.py", ["--warmup", "-1"], "--warmup"),
    ("validate_model.py", ["--algorithms", "nope"], "--algorithms"),
    ("validate_model.py", ["--out", "/proc/x/y.json"], "--out"),
    ("validate_model.py", ["--bandwidth", "fast"], "--bandwidth"),
    ("validate_model.py", ["--bandwidth", "0.5mbit"], "--bandwidth"),
]


@pytest.mark.parametrize(
    ("script", "args", "option"), BAD, ids=[f"{s} {' '.join(a)}" for s, a, _ in BAD]
)
def test_bad_bench_argument_is_a_usage_error(script, args, option, tmp_path):
    args = [a.replace("{out}", str(tmp_path / "x.json")) for a in args]
    proc = _bench(f"bench/{script}", *args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script}: error: ") and option in last, proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("overlap.py", ["x.json", "--steps", "0"], "argument --steps: must be an integer >= 1"),
        ("wire.py", ["--n", "0"], "argument --n: must be an integer in [1, 2**31 - 1]"),
        ("wire.py", ["--teams", "3"], "--teams must divide the number of ranks P=2"),
        ("wire.py", ["--algorithms", ""], "argument --algorithms: expected at least one"),
        (
            "allreduce.py",
            ["--n", "1000", "--dtype", "float16", "--scale", "1e5"],
            "argument --scale: must be at most 39.9 for float16 gradients",
        ),
    ],
)
def test_bench_usage_error_is_printed_once_under_mpiexec(script, args, message):
    proc = run_mpi(2, [f"bench/{script}", *args], timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith(f"{script}: error: {message}"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _bench(*argv) -> subprocess.CompletedProcess:
    """``python *argv`` from the checkout, outside any MPI launcher's environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_"))}
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


# Runs a bench script as if this machine could not build an emulated cluster (no root nor
# CAP_NET_ADMIN), whoever runs the tests: spardl.cluster.check_quick() then finds it.
NO_CAP = (
    "import runpy, sys\n"
    "import spardl.cluster\n"
    "spardl.cluster._has_privileges = lambda: False\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


@pytest.mark.parametrize(
    ("script", "args"),
    [
        ("training.py", ["-n", "2", "--bandwidth", "1gbit"]),
        ("cluster.py", ["--layout", "2x1", "--bandwidth", "1gbit"]),
    ],
)
def test_a_cluster_that_cannot_be_built_is_a_usage_error(script, args, tmp_path):
    """Found by check_quick() right after parsing, before any job: one line, status 2, nothing
    written (it was a ClusterError traceback)."""
    out = tmp_path / "out"
    proc = _bench("-c", NO_CAP, f"bench/{script}", *args, "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script}: error: ") and "CAP_NET_ADMIN" in last, proc.stderr
    assert not out.exists()


def test_a_training_job_that_times_out_is_one_line_status_1(tmp_path):
    """The job is killed after --timeout: one line on stderr and status 1, no traceback."""
    proc = _bench(
        "bench/training.py",
        *("-n", "2", "--epochs", "1", "--configs", "dense", "--timeout", "0.5"),
        *("--out", str(tmp_path)),
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == "training.py: error: training job timed out after 0.5 s", proc.stderr


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cluster_bench_keeps_earlier_results_when_a_configuration_fails(
    tmp_path, monkeypatch, capsys
):
    """A configuration that times out (or fails) ends the run with one line and status 1, and
    --out/cluster.json holds the configurations measured before it (they were lost)."""
    cluster = _load_script("cluster")
    row = {"algorithm": "spardl", "density": 0.01, "time_s": 0.5, "bytes_sent": 1e6}
    report = {"rows": [{**row, "messages": 2.0}], "latency_s": None}
    calls = []

    def run_one(bandwidth, nodes, per_node, a, tmp):
        calls.append(bandwidth)
        if len(calls) == 2:
            raise RuntimeError(
                f"bench/allreduce.py on {nodes}x{per_node}, {bandwidth} timed out after "
                f"{a.timeout:g} s (--timeout)"
            )
        return {**report, "bandwidth": bandwidth, "nodes": nodes, "ranks_per_node": per_node}

    monkeypatch.setattr(spardl.cluster, "check_quick", lambda: None)  # as if root
    monkeypatch.setattr(cluster, "run_one", run_one)
    out = tmp_path / "out"
    argv = ["--bandwidth", "1gbit", "10gbit", "--layout", "2x1", "--timeout", "0.001"]
    assert cluster.main([*argv, "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cluster.py: error: "), err
    assert "10gbit timed out after 0.001 s" in err[0] and "cluster.json" in err[0]
    doc = json.loads((out / "cluster.json").read_text())
    assert [r["bandwidth"] for r in doc["reports"]] == ["1gbit"]
    assert "timed out" in doc["error"]
    assert (out / "cluster.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--steps", "20"], "argument --steps: applies to --task lm only"),
        (["--eval-every", "5"], "argument --eval-every: applies to --task lm only"),
        (["--lr-warmup", "3"], "argument --lr-warmup: applies to --task lm only"),
        (["--task", "lm", "--epochs", "1"], "argument --epochs: applies to --task digits only"),
        (["--task", "lm", "--model", "mlp"], "argument --model: applies to --task digits only"),
    ],
)
def test_an_option_of_the_other_task_is_a_usage_error(args, says, tmp_path):
    """bench/training.py took these and the job refused them once started (after building the
    emulated cluster, with --bandwidth), exit status 1."""
    out = tmp_path / "out"
    proc = _bench("bench/training.py", "-n", "2", "--configs", "dense", *args, "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(says), proc.stderr
    assert not out.exists()


def test_the_training_bench_passes_its_learning_rate_to_every_run(tmp_path):
    """--lr reaches each run's spardl train command, and without it the job's default holds."""
    bench = _load_script("training")
    given = bench._args(["--task", "lm", "--lr", "0.003", "--configs", "dense"])
    argv = bench._train_args(given, "dense", 0, tmp_path)
    assert argv[argv.index("--lr") + 1] == "0.003"
    default = bench._args(["--task", "lm", "--configs", "dense"])
    assert "--lr" not in bench._train_args(default, "dense", 0, tmp_path)


def test_the_density_warmup_defaults_to_a_sixth_of_the_lm_steps():
    """The language model's runs warm the density up over a sixth of their steps (800 of the
    job's 4,800), the digits runs over 46 steps; a given value is kept."""
    bench = _load_script("training")
    assert bench._args(["--task", "lm", "--configs", "dense"]).density_warmup == 800
    assert (
        bench._args(["--task", "lm", "--steps", "600", "--configs", "dense"]).density_warmup == 100
    )
    assert bench._args(["--configs", "dense"]).density_warmup == 46
    given = bench._args(["--task", "lm", "--density-warmup", "5", "--configs", "dense"])
    assert given.density_warmup == 5


def test_runs_at_other_densities_write_to_their_own_directories_and_share_the_dense_ones(
    tmp_path,
):
    """Each sparse config's run directory names its density, so an invocation at another
    --density into the same --out keeps the first one's runs; the dense configs, which take no
    density, have one directory for every density. No two runs of one --out share a directory."""
    bench = _load_script("training")
    seen = {}
    for density in ("0.01", "0.001", "0.0001"):
        args = bench._args(["--density", density, "--out", str(tmp_path), "--configs", "dense"])
        for label in bench.CONFIGS:
            for seed in (0, 1):
                out = bench.run_dir(args, label, seed)
                assert out.parent == tmp_path
                dense = label in ("dense", "dense-fp16")
                assert out.name == (
                    f"{label}-seed{seed}" if dense else f"{label}-rho{density}-seed{seed}"
                )
                key = (label, seed, None if dense else density)
                assert seen.setdefault(out, key) == key, (out, key)
    assert len(seen) == 2 * (2 + 3 * (len(bench.CONFIGS) - 2))


def test_reuse_reads_a_completed_run_with_the_same_options_and_reruns_any_other(
    tmp_path, monkeypatch, capsys
):
    """--reuse: a second invocation reads the runs the first made (no job starts); a run with
    any other option, stopped early, resumed, or made on other links is run again."""
    bench = _load_script("training")
    argv = ["-n", "2", "--configs", "dense", "--epochs", "1", "--out", str(tmp_path), "--reuse"]
    assert bench.main(argv) == 0  # nothing to reuse yet: runs the dense job
    out = tmp_path / "dense-seed0"
    first = json.loads((out / "metrics.json").read_text())

    def no_job(*a, **k):
        raise AssertionError("a job started although its run could be reused")

    monkeypatch.setattr(bench, "launch_train", no_job)
    capsys.readouterr()
    assert bench.main(argv) == 0
    assert f"reusing {out}" in capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["runs"][0]["final_test_accuracy"] == first["final_test_accuracy"]

    args = bench._args(argv)
    train_args = bench._train_args(args, "dense", 0, out)
    assert bench.reusable(out, train_args, 2, None) is not None
    other = bench._train_args(bench._args([*argv, "--lr", "0.01"]), "dense", 0, out)
    assert bench.reusable(out, other, 2, None) is None  # another learning rate
    assert bench.reusable(out, train_args, 3, None) is None  # another world size
    assert bench.reusable(out, train_args, 2, "1gbit") is None  # other links
    record = json.loads((out / "bench-run.json").read_text())
    assert record["metrics_sha256"] and record["job_seconds"] > 0

    def vouched(metrics: str, **change) -> dict | None:
        """``reusable`` of this metrics.json text, with a bench-run.json that vouches for it
        (then changed by ``change``)."""
        (out / "metrics.json").write_text(metrics)
        digest = hashlib.sha256(metrics.encode()).hexdigest()
        ran = {**record, "metrics_sha256": digest, **change}
        (out / "bench-run.json").write_text(json.dumps(ran))
        return bench.reusable(out, train_args, 2, None)

    assert vouched(json.dumps(first)) is not None
    for change in ({"completed": False}, {"resumed_from": {"epoch": 1}}, {"lr": None}):
        assert vouched(json.dumps({**first, **change})) is None, change
    assert vouched("{not json") is None
    assert vouched(json.dumps(first), host="another-machine") is None
    assert vouched(json.dumps(first), metrics_sha256="0" * 64) is None  # rewritten since
    (out / "bench-run.json").write_text("[]")
    assert bench.reusable(out, train_args, 2, None) is None
    (out / "bench-run.json").unlink()  # a run this script did not make: never reused
    assert bench.reusable(out, train_args, 2, None) is None
