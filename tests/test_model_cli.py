"""``spardl model`` (JSON shape, the BERT-base acceptance) and ``spardl bench pingpong``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from mpirun import ROOT, run_mpi

from spardl import cost_model
from spardl.cli.model import parse_P, teams_candidates


def _model(*args):
    proc = subprocess.run(
        [sys.executable, "-m", "spardl", "model", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc


def test_model_json_shape_and_acceptance():
    proc = _model(
        "--model",
        "bert-base",
        "--density",
        "0.01",
        "--network",
        "ethernet-10g",
        "--P",
        "8,256",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert {r["algorithm"] for r in rows} == set(cost_model.FORMULAS)
    assert {r["P"] for r in rows} == {8, 256}
    for r in rows:
        for key in ("algorithm", "P", "n", "density", "network", "teams", "seconds"):
            assert key in r
        assert r["n"] == 110_000_000 and r["density"] == 0.01
        assert r["network"] == "ethernet-10g" and r["seconds"] > 0
        assert r["P"] % r["teams"] == 0
    for P in (8, 256):
        here = [r for r in rows if r["P"] == P]
        assert sum(r["best"] for r in here) == 1
        assert min(here, key=lambda r: r["seconds"])["best"]
    t = {r["algorithm"]: r["seconds"] for r in rows if r["P"] == 256}
    assert t["spardl"] <= 0.6 * t["oktopk"]
    assert t["spardl"] <= 0.1 * t["dense"]


def test_model_overrides_plot_and_errors(tmp_path):
    png = tmp_path / "m.png"
    proc = _model(
        "--n",
        "1000000",
        "--alpha",
        "1e-6",
        "--beta",
        "1e-10",
        "--P",
        "2-16",
        "--algorithms",
        "spardl,dense",
        "--plot",
        str(png),
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert sorted({r["P"] for r in rows}) == [2, 4, 8, 16]
    assert all(r["alpha"] == 1e-6 and r["beta"] == 1e-10 for r in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = _model("--P", "0-4")
    assert bad.returncode == 2 and "--P" in bad.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--alpha", "inf"], "alpha must be a finite number >= 0"),
        (["--alpha", "1e308", "--beta", "1e308", "--P", "4096"], "not finite"),
        # A world size past a C int printed rows of 5e18 seconds.
        (["--P", "99999999999999999999999"], "--P must be integers in [1, 2**31 - 1]"),
        (["--P", "2-4294967296"], "--P must be integers in [1, 2**31 - 1]"),
        (["--plot", "{tmp}/missing/x.png"], "does not exist"),
        (["--plot", "{tmp}/x.xyz"], "--plot: must end in one of"),
        (["--plot", "{tmp}"], "--plot: must be a file name"),
        (["--plot", "/proc/x.png"], "--plot: cannot write /proc/x.png"),
    ],
)
def test_model_rejects_what_it_cannot_print_or_plot(tmp_path, args, message):
    """Exit status 2 and one error line (after argparse's usage for an option's own type),
    before anything is written (JSON never holds inf/NaN)."""
    proc = _model(*(a.replace("{tmp}", str(tmp_path)) for a in args))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("spardl model: error: ") and message in last, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr


def test_model_repeated_algorithm_and_P_1():
    rows = json.loads(_model("--P", "1,4", "--algorithms", "spardl,spardl,dense", "--json").stdout)
    assert [(r["algorithm"], r["P"]) for r in rows].count(("spardl", 4)) == 1
    assert not any(r["best"] for r in rows if r["P"] == 1)  # nothing is sent: no cheapest
    assert sum(r["best"] for r in rows if r["P"] == 4) == 1


def test_parse_P_and_teams():
    assert parse_P("2-16") == [2, 4, 8, 16]
    assert parse_P("3-20") == [3, 4, 8, 16, 20]
    assert parse_P("6,2") == [2, 6]
    with pytest.raises(ValueError, match="--P"):
        parse_P("x")
    assert teams_candidates(12) == [1, 2, 3, 4, 6, 12]
    assert teams_candidates(4096) == [1 << i for i in range(13)]


@pytest.mark.mpi
def test_bench_pingpong_under_mpiexec(tmp_path):
    out = tmp_path / "pp.json"
    proc = run_mpi(
        2,
        [
            "-m",
            "spardl",
            "bench",
            "pingpong",
            "--sizes",
            "8,1024,65536,1048576",
            "--repeat",
            "5",
            "--no-gamma",
            "--json",
            str(out),
        ],
        timeout=120,
    )
    assert "alpha =" in proc.stdout and "beta" in proc.stdout
    doc = json.loads(out.read_text())
    assert [r["bytes"] for r in doc["rows"]] == [8, 1024, 65536, 1048576]
    assert all(r["seconds"] > 0 for r in doc["rows"])
    # α and β are the fit of the rows it wrote (their sizes are timings, which on a loaded
    # machine can make either one 0: only the fit's consistency is the program's to keep).
    from spardl.pingpong import fit_alpha_beta

    fitted = fit_alpha_beta([r["bytes"] for r in doc["rows"]], [r["seconds"] for r in doc["rows"]])
    assert (doc["alpha"], doc["beta"]) == pytest.approx(fitted, rel=1e-12, abs=0)
    assert doc["alpha"] >= 0 and doc["beta"] >= 0


def test_fit_alpha_beta_recovers_a_line():
    from spardl.pingpong import fit_alpha_beta

    sizes = [8 << i for i in range(20)]
    alpha, beta = fit_alpha_beta(sizes, [3e-6 + 2e-10 * s for s in sizes])
    assert alpha == pytest.approx(3e-6, rel=1e-6) and beta == pytest.approx(2e-10, rel=1e-6)
    with pytest.raises(ValueError, match="distinct"):
        fit_alpha_beta([8, 8], [1e-6, 1e-6])


def test_pingpong_needs_two_ranks_given_an_mpi4py_communicator_or_a_comm():
    import numpy as np
    from mpi4py import MPI

    from spardl.comm import Comm
    from spardl.pingpong import pingpong

    with pytest.raises(ValueError, match="at least 2 ranks"):
        pingpong(MPI.COMM_SELF, [8])
    c = Comm(MPI.COMM_SELF)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        pingpong(c, [8])
    assert c.stats["messages"] == 0  # a Comm given is used as it is, and left usable
    assert c.allreduce(np.ones(2)).tolist() == [1.0, 1.0]
    c.free()


@pytest.mark.parametrize(
    "kwargs, kind, message",
    [
        ({"repeat": 0}, ValueError, "repeat must be >= 1"),
        ({"repeat": -3}, ValueError, "repeat must be >= 1"),
        ({"repeat": 2.5}, TypeError, "repeat must be an integer"),
        ({"repeat": True}, TypeError, "repeat must be an integer"),
        ({"repeat": "2"}, TypeError, "repeat must be an integer"),
        ({"warmup": -1}, ValueError, "warmup must be >= 0"),
        ({"warmup": None}, TypeError, "warmup must be an integer"),
        ({"sizes": []}, ValueError, "sizes must be positive"),
        ({"sizes": [8, 0]}, ValueError, "sizes must be positive"),
        ({"sizes": [8.0]}, TypeError, "sizes must be an integer"),
        ({"sizes": "8"}, TypeError, "sizes must be a sequence"),
    ],
)
def test_pingpong_rejects_bad_arguments_before_measuring(kwargs, kind, message):
    """Bad ``sizes``, ``repeat`` or ``warmup``: an error naming the argument (raised before the
    rank count is looked at, so the same on every rank), never timings of 0 s."""
    from mpi4py import MPI

    from spardl.pingpong import pingpong

    args = {"sizes": [8], **kwargs}
    with pytest.raises(kind, match=message):
        pingpong(MPI.COMM_SELF, **args)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--repeat", "0"], "argument --repeat: must be an integer >= 1, got 0"),
        (["--sizes", "8,0"], "argument --sizes: must be comma-separated byte counts in [1, "),
        (["--sizes", "abc"], "argument --sizes: expected comma-separated byte counts in [1, "),
        # One size (or one repeated) cannot fit alpha and beta: it was found after measuring,
        # and aborted the MPI job.
        (["--sizes", "8"], "at least two distinct, got 8"),
        (["--sizes", "8,8"], "at least two distinct, got 8,8"),
        (["--sizes", "8", "--repeat", "5", "--no-gamma"], "at least two distinct, got 8"),
        (["--sizes", ","], "argument --sizes: must be comma-separated byte counts"),
        (["--sizes", f"8,{2**31}"], "byte counts in [1, 2**31 - 1], at least two distinct, got"),
    ],
)
def test_bench_pingpong_usage_errors(argv, message, capsys):
    from spardl.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "pingpong", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "P, argv, message",
    [
        (1, ["--sizes", "8,16"], "bench pingpong needs at least 2 ranks"),
        (2, ["--sizes", "8,16", "--json", "/nonexistent-dir/pp.json"], "--json: cannot write"),
        # A directory was taken (its parent is writable) and failed after the measurement.
        (2, ["--sizes", "8,16", "--json", "/tmp"], "--json: must be a file name"),
        # Refused by the parser on every rank, before any measurement (it aborted the job).
        (2, ["--sizes", "8", "--repeat", "5", "--no-gamma"], "at least two distinct, got 8"),
        (2, ["--sizes", "8,8", "--repeat", "5", "--no-gamma"], "at least two distinct, got 8,8"),
    ],
)
def test_bench_pingpong_run_time_usage_errors(P, argv, message):
    """Found before any measurement: one line and status 2."""
    proc = run_mpi(P, ["-m", "spardl", "bench", "pingpong", *argv], timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "argv, prog",
    [
        (["train", "--bogus"], "spardl train"),
        (["bench", "pingpong", "--zzz", "1"], "spardl bench pingpong"),
        (["info", "--x"], "spardl info"),
    ],
)
def test_unknown_options_are_named_by_their_subcommand(argv, prog, capsys):
    """An option no parser knows: exit status 2 and the subcommand's own usage line, not the
    top-level 'spardl: error:'."""
    from spardl.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert (
        f"{prog}: error: unrecognized arguments: {' '.join(argv[len(prog.split()) - 1 :])}" in err
    )


def test_the_demo_summary_states_bytes_without_a_meaningless_ratio():
    from spardl.cli.training import bytes_sentence

    assert bytes_sentence(1_000, 50_000) == (
        "SparDL sends 2.00% of the dense allreduce's bytes per rank (50.0x less)."
    )
    assert "At P = 1 no allreduce sends a byte" in bytes_sentence(0, 0)
    assert "nothing sent" in bytes_sentence(0, 50_000)
    # At a density near 1 SparDL sends indices beside every value: more than dense.
    assert "(2.0x more)" in bytes_sentence(100_000, 50_000)
    assert "(as many)" in bytes_sentence(50_000, 50_000)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # mpiexec took any -n; across emulated links, 251 nodes was a traceback from Cluster.
        (["-n", "2000"], "--world-size/-n: must be an integer in [1, 1024]"),
        (["-n", "251", "--bandwidth", "1gbit"], "--bandwidth: at most 250 emulated nodes"),
        # Path("") is the current folder, where both runs once wrote; a file was found only
        # after mpiexec had started.
        (["--out", ""], "argument --out: must be a path, got an empty string"),
        (["--out", "/etc/passwd"], "argument --out: cannot write /etc/passwd"),
    ],
)
def test_demo_refuses_a_world_it_cannot_run_before_any_run(argv, message, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "spardl", "demo", "--out", str(tmp_path), *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())  # nothing ran


def test_pingpong_says_when_its_sizes_do_not_resolve_beta(monkeypatch, capsys):
    """A fit whose slope clips at 0 printed "inf GB/s"; it now says the sizes are too small."""
    import argparse

    from spardl import pingpong

    class TwoRanks:  # rank 0 of 2; the measurement itself is replaced below
        def Get_size(self):
            return 2

        def Get_rank(self):
            return 0

    monkeypatch.setattr(pingpong, "pingpong", lambda world, sizes, repeat: [(8, 1e-5), (16, 9e-6)])
    args = argparse.Namespace(sizes=[8, 16], repeat=1, json=None, no_gamma=True)
    assert pingpong.run(args, TwoRanks()) == 0
    out = capsys.readouterr().out
    assert "beta  = 0 s/byte (not resolved by these sizes" in out and "inf" not in out
