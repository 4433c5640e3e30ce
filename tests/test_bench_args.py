"""The bench scripts' arguments: a bad one is one line from rank 0 and status 2 on every rank,
before any allreducer is built or any benchmark runs (not a traceback from inside the library,
nor a failure to write an output after the whole run)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from mpirun import ROOT, run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--n", "0"], "argument --n: must be an integer >= 1, got 0"),
        (["--density", "2"], "argument --density: must be a density in (0, 1], got 2"),
        (["--repeat", "0"], "argument --repeat: must be an integer >= 1, got 0"),
        (["--teams", "3", "--n", "100"], "--teams must divide the number of ranks P=2, got 3"),
    ],
)
def test_bad_allreduce_bench_argument_is_one_line(args, message):
    proc = run_mpi(2, ["bench/allreduce.py", *args], timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"allreduce.py: error: {message}"


# Every other bench script: a bad value fails in the parser (status 2, the option named, no
# traceback), before any benchmark work. Single-process runs (the parser is the same at any P);
# "{out}" stands for a writable path in the test's temporary directory.
BAD = [
    ("kernels.py", ["--sizes", "0"], "--sizes"),
    ("kernels.py", ["--repeat", "0"], "--repeat"),
    ("kernels.py", ["--density", "-1"], "--density"),
    ("kernels.py", ["--density", "0"], "--density"),
    ("kernels.py", ["--threads", "0"], "--threads"),
    ("kernels.py", ["--torch-threads", "0"], "--torch-threads"),
    ("kernels.py", ["--merge-parallel-min", "-1"], "--merge-parallel-min"),
    ("step_local.py", ["--n", "0"], "--n"),
    ("step_local.py", ["--density", "5"], "--density"),
    ("step_local.py", ["--repeat", "0"], "--repeat"),
    ("step_local.py", ["--algorithms", "nope"], "--algorithms"),
    ("wire.py", ["--n", "0"], "--n"),
    ("wire.py", ["--density", "0"], "--density"),
    ("wire.py", ["--repeat", "0"], "--repeat"),
    ("wire.py", ["--warmup", "-1"], "--warmup"),
    ("wire.py", ["--seed", "-1"], "--seed"),
    ("wire.py", ["--teams", "2"], "--teams"),
    ("wire.py", ["--json", "/nonexistent/x.json"], "--json"),
    ("after_idle.py", ["--n", "0"], "--n"),
    ("after_idle.py", ["--repeat", "0"], "--repeat"),
    ("after_idle.py", ["--density", "1.5"], "--density"),
    ("after_idle.py", ["--pause", "-1"], "--pause"),
    ("auto_step.py", ["--n", "0"], "--n"),
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
    ("gpu.py", ["/nonexistent/x.json"], "json_path"),
    ("allreduce.py", ["--json", "/nonexistent/x.json"], "--json"),
    ("allreduce.py", ["--plot", "/nonexistent/x.png"], "--plot"),
    ("allreduce.py", ["--plot", "{out}.nope"], "--plot"),
    ("allreduce.py", ["--scale", "0"], "--scale"),
    ("cluster.py", ["--n", "0"], "--n"),
    ("cluster.py", ["--density", "0"], "--density"),
    ("cluster.py", ["--repeat", "0"], "--repeat"),
    ("cluster.py", ["--bandwidth", "fast"], "--bandwidth"),
    ("cluster.py", ["--algorithms", "nope"], "algorithm"),
    ("cluster.py", ["--layout", "251x1"], "--layout"),
    ("cluster.py", ["--layout", "4x0"], "--layout"),
    ("cluster.py", ["--out", "/proc/x"], "--out"),
    ("training.py", ["--world-size", "0"], "--world-size"),
    ("training.py", ["--density", "0"], "--density"),
    ("training.py", ["--seeds", "-1"], "--seeds"),
    ("training.py", ["--steps", "0"], "--steps"),
    ("training.py", ["--out", "/proc/x"], "--out"),
    ("validate_model.py", ["--n", "0"], "--n"),
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
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_"))}
    proc = subprocess.run(
        [sys.executable, f"bench/{script}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script}: error: ") and option in last, proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("overlap.py", ["x.json", "--steps", "0"], "argument --steps: must be an integer >= 1"),
        ("wire.py", ["--n", "0"], "argument --n: must be an integer >= 1"),
        ("wire.py", ["--teams", "3"], "--teams must divide the number of ranks P=2"),
    ],
)
def test_bench_usage_error_is_printed_once_under_mpiexec(script, args, message):
    proc = run_mpi(2, [f"bench/{script}", *args], timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith(f"{script}: error: {message}"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
