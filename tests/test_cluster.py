"""Emulated clusters (spardl.cluster, ``spardl cluster``): results across shaped TCP links equal
the shared-memory results bit for bit, the links carried what ``stats`` counted, and nothing a run
creates outlives it.

The tests marked ``cluster`` need root (CAP_NET_ADMIN and CAP_SYS_ADMIN); without them they
skip, and under ``CI=true`` a skip of a ``cluster`` test is a failure (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from mpirun import ROOT, run_mpi

from spardl import cluster

SPARDL = [sys.executable, "-m", "spardl"]
SCRIPT = "tests/scripts/cluster_allreduce.py"
#: Links count Ethernet, IP and TCP headers and the MPI library's own headers and control
#: messages, which ``stats`` does not (measured: 0.2% for dense, 1.1-1.6% for the sparse
#: algorithms at n = 1e6, 1%, 3 steps; GSO keeps headers to one per large segment).
LINK_OVERHEAD = 0.05
LINK_OVERHEAD_FIXED = 32 * 1024

needs_cluster = pytest.mark.skipif(
    cluster.check_quick() is not None, reason=f"cannot run here: {cluster.check_quick()}"
)


def _ours(pid: int) -> list[str]:
    """Namespaces of the cluster run launched by process ``pid``."""
    return [ns for ns in cluster._namespaces() if ns.startswith(f"spardl-{pid}-")]


def _cluster_cli(args, timeout=300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*SPARDL, "cluster", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


# -- no privileges needed -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, bps",
    [("1gbit", 1e9), ("100mbit", 1e8), ("10GBIT", 1e10), ("125mbps", 1e9), ("1mibit", 2**20)],
)
def test_parse_rate(text, bps):
    assert cluster.parse_rate(text) == pytest.approx(bps)


@pytest.mark.parametrize(
    "text", ["", "fast", "0gbit", "-1mbit", "1zbit", "1 g bit", "1", "999kbit", "200gbit"]
)
def test_parse_rate_rejects(text):
    with pytest.raises(ValueError, match="rate"):
        cluster.parse_rate(text)


@pytest.mark.parametrize("text, s", [("50us", 50e-6), ("1ms", 1e-3), ("0.5s", 0.5), ("20", 20e-6)])
def test_parse_time(text, s):
    assert cluster.parse_time(text) == pytest.approx(s)


@pytest.mark.parametrize(
    "parse, text, says",
    [
        (cluster.parse_rate, "-1mbit", "rate must be positive"),
        (cluster.parse_rate, "-.5gbit", "rate must be positive"),
        (cluster.parse_rate, "0gbit", "rate must be positive"),
        (cluster.parse_time, "-1ms", "time must not be negative"),
        (cluster.parse_time, "-0", "time must not be negative"),
        (cluster.parse_time, "1e400s", "time must be finite"),
    ],
)
def test_negative_rates_and_times_say_so(parse, text, says):
    """A negative rate was "must be a number with a tc unit", as if the sign were the error."""
    with pytest.raises(ValueError, match=says):
        parse(text)


def test_cluster_names_a_malformed_rate_or_time():
    with pytest.raises(ValueError, match="^bandwidth: rate must be positive"):
        cluster.Cluster(2, bandwidth="-1mbit")
    with pytest.raises(ValueError, match="^latency: time must not be negative"):
        cluster.Cluster(2, latency="-1ms")
    with pytest.raises(ValueError, match="^latency: time must be a number"):
        cluster.Cluster(2, latency="soon")


def test_cluster_arguments_are_checked():
    with pytest.raises(ValueError, match="nodes"):
        cluster.Cluster(0)
    with pytest.raises(ValueError, match="ranks_per_node must be in"):
        cluster.Cluster(2, ranks_per_node=cluster.MAX_RANKS_PER_NODE + 1)
    with pytest.raises(TypeError, match="ranks_per_node"):
        cluster.Cluster(2, ranks_per_node=1.5)
    with pytest.raises(ValueError, match="rate"):
        cluster.Cluster(2, bandwidth="lots")


NEGATIVE_RATE = "argument --bandwidth: rate must be positive"
NEGATIVE_TIME = "argument --latency: time must not be negative"


@pytest.mark.parametrize(
    "args, says",
    [
        (["run", "--nodes", "2"], "no command given"),
        (["run", "--nodes", "0", "--", "true"], "--nodes"),
        (["run", "--nodes", "2", "--bandwidth", "1zbit", "--", "true"], "--bandwidth"),
        (["run", "--nodes", "2", "--latency", "soon", "--", "true"], "--latency"),
        (["run", "--nodes", "1000", "--", "true"], "--nodes"),
        (["run", "--nodes", "2", "--bandwidth", "1", "--", "true"], "--bandwidth"),
        (["run", "--nodes", "2", "--report", "/nonexistent/dir/r.json", "--", "true"], "--report"),
        # A directory is refused before the nodes exist, not found out after the command ran.
        (["run", "--nodes", "2", "--report", "/tmp", "--", "true"], "--report: must be a file"),
        (["run", "--nodes", "2", "--report", "", "--", "true"], "--report: must be a path"),
        # mpiexec ran with -n 4294967296 and spun until killed.
        (["run", "--nodes", "2", "-R", "2147483648", "--", "true"], "--ranks-per-node"),
        # An option where the program goes: mpiexec took it as its own.
        (["run", "--nodes", "1", "--", "--version"], "must start with a program"),
        (["run", "--nodes", "1", "--", ""], "must start with a program"),
        # Found out by MPI's launcher once per node, in its words, after the cluster was built.
        (["run", "--nodes", "2", "--", "nosuchprogram_xyz"], "no program 'nosuchprogram_xyz'"),
        (["run", "--nodes", "2", "--", "/nonexistent/prog"], "no program '/nonexistent/prog'"),
        # argparse took "-1mbit" for an option: "--bandwidth: expected one argument".
        (["run", "-N", "2", "--bandwidth", "-1mbit", "--", "true"], NEGATIVE_RATE),
        (["run", "-N", "2", "--bandwidth=-1mbit", "--", "true"], NEGATIVE_RATE),
        (["run", "-N", "2", "--bandwidth", "-.5gbit", "--", "true"], NEGATIVE_RATE),
        (["run", "-N", "2", "--latency", "-1ms", "--", "true"], NEGATIVE_TIME),
        (["run", "-N", "2", "--latency=-1ms", "--", "true"], NEGATIVE_TIME),
        (["run", "-N", "2", "--timeout", "-1e3", "--", "true"], "--timeout: must be a finite"),
    ],
)
def test_usage_errors_are_one_line_status_2(args, says):
    proc = _cluster_cli(args, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop privileges")
def test_without_privileges_one_line_status_2():
    """An unprivileged user gets one line and status 2, before anything is created."""
    home = tempfile.mkdtemp(prefix="spardl-nobody-")  # pytest's tmp_path is private to root
    os.chmod(home, 0o777)
    env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(home, "numba"), HOME=home)
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]
    proc = subprocess.run(
        [*drop, *SPARDL, "cluster", "run", "--nodes", "2", "--", "true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    shutil.rmtree(home, ignore_errors=True)
    assert len(lines) == 1 and "CAP_NET_ADMIN" in lines[0], proc.stderr


#: Runs ``python -m spardl ARGS`` after arranging a Ctrl-C (a real SIGINT, to itself) for the
#: moment the module ``argv[1]`` is first imported; prints "not interrupted" if it never was.
_CTRL_C_AT_IMPORT = """
import importlib.abc, os, runpy, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
module = sys.argv.pop(1)
assert module not in sys.modules, module
class CtrlC(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == module:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
sys.meta_path.insert(0, CtrlC())
sys.argv[0] = "spardl"
try:
    runpy.run_module("spardl", run_name="__main__", alter_sys=True)
finally:
    if CtrlC in map(type, sys.meta_path):
        print("not interrupted")
"""


@pytest.mark.parametrize(
    "module, args",
    [
        ("spardl.cli.model", ["cluster", "run", "-q", "-N", "2", "--", "sleep", "5"]),
        ("numpy", ["cluster", "run", "-q", "-N", "2", "--bandwidth", "1gbit", "--", "sleep", "5"]),
        ("spardl.cluster", ["cluster", "run", "-q", "-N", "2", "--", "sleep", "5"]),
        ("numpy", ["train", "--epochs", "1", "--no-progress"]),
        ("mpi4py.MPI", ["bench", "pingpong"]),
        ("numpy", ["model", "--n", "1000000", "--P", "8"]),
        # in numpy's import: its C part turned the KeyboardInterrupt into numpy's ImportError
        ("datetime", ["bench", "pingpong"]),
    ],
)
def test_an_early_ctrl_c_is_one_line_and_status_130(module, args, tmp_path):
    """A Ctrl-C in the first fraction of a second, while the command line still imported its
    modules and what its subcommand needs (numpy: most of its start-up), or before ``cluster
    run`` had its own handling, printed a KeyboardInterrupt traceback (or numpy's ImportError);
    it is one line and status 130, as later."""
    with subprocess.Popen(
        [sys.executable, "-c", _CTRL_C_AT_IMPORT, module, *args],
        cwd=tmp_path,  # where train would write (it never starts)
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert err.strip().splitlines() == ["spardl: interrupted"], err
    assert _ours(proc.pid) == []


# -- on emulated nodes --------------------------------------------------------------------------
def _report(path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.cluster
@needs_cluster
@pytest.mark.parametrize("nodes, per_node", [(4, 1), (2, 2)])
def test_bit_identical_to_shared_memory(tmp_path, nodes, per_node):
    """SparDL (d = 1, 2), Ok-Topk and dense across 1 Gbit/s links give the shared-memory results
    bit for bit; each node's link sent at least what its ranks' stats counted, and with one rank
    per node at most that plus the stated overhead."""
    P = nodes * per_node
    shared = tmp_path / "shared.json"
    run_mpi(P, [SCRIPT, str(shared)], timeout=600)
    across = tmp_path / "cluster.json"
    proc = _cluster_cli(
        ["run", "--nodes", str(nodes), "-R", str(per_node), "--bandwidth", "1gbit"]
        + ["--timeout", "600", "--", sys.executable, SCRIPT, str(across)],
        timeout=700,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    a, b = _report(shared), _report(across)
    assert [r["algorithm"] for r in a["rows"]] == [r["algorithm"] for r in b["rows"]]
    assert len(a["rows"]) == 4
    for ra, rb in zip(a["rows"], b["rows"], strict=True):
        what = f"{ra['algorithm']} {ra['options']}"
        assert [r["digest"] for r in ra["ranks"]] == [r["digest"] for r in rb["ranks"]], what
        assert [r["bytes_sent"] for r in ra["ranks"]] == [r["bytes_sent"] for r in rb["ranks"]]
        heads = [r for r in rb["ranks"] if r["link_tx_bytes"] is not None]
        assert len(heads) == nodes, what
        for r in heads:
            link, counted = r["link_tx_bytes"], r["node_bytes_sent"]
            if per_node == 1:
                assert counted <= link <= counted * (1 + LINK_OVERHEAD) + LINK_OVERHEAD_FIXED, (
                    what,
                    r,
                )
            else:  # ranks of one node talk through shared memory: the link carries less
                assert 0 < link <= counted * (1 + LINK_OVERHEAD) + LINK_OVERHEAD_FIXED, (what, r)


@pytest.mark.cluster
@needs_cluster
def test_exit_status_and_cleanup_after_failure(tmp_path):
    report = tmp_path / "links.json"
    proc = _cluster_cli(
        ["run", "--nodes", "2", "--report", str(report), "--", sys.executable, "-c"]
        + ["import sys; sys.exit(3)"]
    )
    assert proc.returncode == 3, proc.stderr
    assert json.loads(report.read_text())["returncode"] == 3
    assert not [ns for ns in cluster._namespaces() if "-check" not in ns and _dead_run(ns)]


def _dead_run(ns: str) -> bool:
    m = cluster._PREFIX_RE.match(ns)
    return bool(m) and not cluster._pid_alive(int(m.group(1)))


@pytest.mark.cluster
@needs_cluster
def test_timeout_kills_the_job_and_cleans_up():
    t0 = time.monotonic()
    proc = _cluster_cli(["run", "-q", "--nodes", "2", "--timeout", "2", "--", "sleep", "60"])
    assert proc.returncode == 124
    assert time.monotonic() - t0 < 40
    assert "timed out" in proc.stderr
    assert not [ns for ns in cluster._namespaces() if _dead_run(ns)]


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.cluster
@needs_cluster
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_killed_launcher_leaves_nothing(sig, tmp_path):
    """Ctrl-C, a TERM, a hangup (a closed terminal: MPI's libraries had caught it, and the run
    went on) and even a KILL of the launcher: every namespace and process goes."""
    err = tmp_path / "launcher.err"
    launcher = subprocess.Popen(
        [*SPARDL, "cluster", "run", "-q", "--nodes", "2", "--", "sleep", "120"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=err.open("w"),
        # Ctrl-C as at a terminal: a test run started in the background by a shell without
        # job control inherits SIGINT ignored, and so would the launcher.
        preexec_fn=_sigint_default,
    )
    try:
        deadline = time.monotonic() + 60
        while len(_ours(launcher.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_ours(launcher.pid)) == 3  # the switch and two nodes
        time.sleep(1.0)  # the job is running
        launcher.send_signal(sig)
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.send_signal(signal.SIGUSR1)  # the launcher prints where it waits
            time.sleep(2)
            pytest.fail(f"the launcher did not exit within 60 s:\n{err.read_text()}")
        deadline = time.monotonic() + 30
        while _ours(launcher.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _ours(launcher.pid) == []
        if sig != signal.SIGKILL:
            assert launcher.returncode == 128 + sig
    finally:
        if launcher.poll() is None:
            launcher.kill()


@pytest.mark.cluster
@needs_cluster
def test_the_janitor_starts_no_mpi(tmp_path):
    """The last-resort cleanup process imports the cluster module alone: it imported the whole
    package, which starts MPI (seconds under load, and a dependency it must not have)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    probe = cluster._JANITOR + "; print(sorted(m for m in sys.modules if 'mpi4py' in m))"
    proc = subprocess.run(
        [sys.executable, "-c", probe, "spardl-0-none", str(scratch), cluster._PACKAGE_PARENT],
        cwd=tmp_path,  # the package is found by the folder given, not by the current one
        input="",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert not scratch.exists()  # its work: the run's scratch folder removed


def _tools_without_netem(folder: Path) -> dict[str, str]:
    """An environment whose ``tc`` refuses the netem qdisc, as a kernel without it does, and
    whose ``ip`` writes each of its command lines to ``folder/ip.log``; both run the real tools
    otherwise (this machine's kernel may or may not have netem)."""
    real_tc, real_ip = shutil.which("tc"), shutil.which("ip")
    tc, ip = folder / "tc", folder / "ip"
    tc.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" netem "*) echo "Error: Specified qdisc kind is unknown." >&2; '
        "exit 2 ;; esac\n"
        f'exec {real_tc} "$@"\n'
    )
    ip.write_text(f'#!/bin/sh\necho "$*" >> {folder / "ip.log"}\nexec {real_ip} "$@"\n')
    tc.chmod(0o755)
    ip.chmod(0o755)
    return dict(os.environ, PATH=f"{folder}{os.pathsep}{os.environ.get('PATH', '')}")


def _namespaces_added(folder: Path) -> list[str]:
    log = folder / "ip.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [line for line in lines if line.startswith("netns add")]


@pytest.mark.cluster
@needs_cluster
def test_has_netem_asks_the_kernel_and_leaves_nothing(tmp_path):
    """The probe tries the qdisc itself (a tc that refuses it gives False) in a namespace that
    no ``ip netns`` command sees or has to remove."""
    before = cluster._namespaces()
    probe = [sys.executable, "-c", "from spardl import cluster; print(cluster.has_netem())"]
    env = _tools_without_netem(tmp_path)
    proc = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
    # A tc that accepts the qdisc (and sets up nothing): True.
    (tmp_path / "tc").write_text("#!/bin/sh\nexit 0\n")
    proc = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "True", proc.stderr
    # A tc that fails for another reason is no answer: its words, not the kernel's lack.
    (tmp_path / "tc").write_text(
        "#!/bin/sh\necho 'RTNETLINK answers: Operation not permitted' >&2\nexit 2\n"
    )
    proc = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "ClusterError" in proc.stderr
    assert "Operation not permitted" in proc.stderr.strip().splitlines()[-1]
    assert _namespaces_added(tmp_path) == []
    assert cluster._namespaces() == before


@pytest.mark.cluster
@needs_cluster
def test_latency_without_netem_is_refused_before_anything_is_built(tmp_path):
    """``--latency`` on a kernel without netem: a usage error naming the option, found before
    the first namespace (the cluster was built, then refused, then removed)."""
    env = _tools_without_netem(tmp_path)
    proc = _cluster_cli(["run", "--nodes", "2", "--latency", "1ms", "--", "true"], env=env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--latency" in lines[0] and "netem" in lines[0], proc.stderr
    assert _namespaces_added(tmp_path) == []
    # A latency of 0 adds no qdisc: it needs no netem, and the run goes on.
    proc = _cluster_cli(["run", "-q", "--nodes", "1", "--latency", "0", "--", "true"], env=env)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.cluster
@needs_cluster
def test_the_python_api_refuses_a_latency_before_building(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _tools_without_netem(tmp_path)["PATH"])
    c = cluster.Cluster(2, latency="1ms")
    with pytest.raises(cluster.ClusterError, match="^latency='1ms': .*netem"), c:
        pytest.fail("the cluster was created")
    assert _namespaces_added(tmp_path) == []
    assert not [ns for ns in cluster._namespaces() if ns.startswith(c.prefix)]


@pytest.mark.cluster
@needs_cluster
def test_the_launcher_starts_mpiexec_without_mpi(tmp_path):
    """``spardl cluster run`` is a launcher (root, outside mpiexec): up to starting mpiexec it
    imported mpi4py.MPI, which initialises MPI, because ``import spardl`` did."""
    script = (
        "import subprocess, sys\n"
        "from spardl import cluster\n"
        "from spardl.cli import main\n"
        "def run(self, command, timeout=None, **kw):\n"
        "    print('MPI' if 'mpi4py.MPI' in sys.modules else 'no MPI')\n"
        "    return subprocess.CompletedProcess(command, 0)\n"
        "cluster.Cluster.run = run\n"
        "sys.exit(main(['cluster', 'run', '-q', '--nodes', '1', '--', 'true']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "no MPI"


@pytest.mark.cluster
@needs_cluster
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_bench_stopped_by_a_signal_leaves_no_folder(sig, tmp_path):
    """bench/cluster.py ended by TERM left its temporary folder (no handler: the ``with`` blocks
    never ran), and by Ctrl-C printed a traceback. Killed (no handler can run), its folder is
    named as a dead run's scratch, which the next run's sweep removes with its namespaces."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv = [sys.executable, "bench/cluster.py", "--bandwidth", "100mbit", "--layout", "2x1"]
    argv += ["--n", "100000", "--algorithms", "spardl", "--repeat", "100000", "--warmup", "0"]
    bench = subprocess.Popen(
        [*argv, "--out", str(tmp_path / "out")],
        cwd=ROOT,
        env=dict(os.environ, TMPDIR=str(tmp)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sigint_default,
    )
    try:
        deadline = time.monotonic() + 120
        while len(_ours(bench.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_ours(bench.pid)) == 3
        time.sleep(2.0)
        bench.send_signal(sig)
        _, err = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
    if sig == signal.SIGKILL:
        assert bench.returncode == -sig
        sweep = "from spardl import cluster; cluster.sweep()"
        env = dict(os.environ, TMPDIR=str(tmp))
        subprocess.run([sys.executable, "-c", sweep], cwd=ROOT, env=env, timeout=60, check=True)
    else:
        assert "Traceback" not in err, err
        assert bench.returncode == (130 if sig == signal.SIGINT else 128 + sig), err
    assert list(tmp.iterdir()) == [], list(tmp.iterdir())
    assert _ours(bench.pid) == []


@pytest.mark.cluster
@needs_cluster
def test_python_api_counters_and_shaping():
    """The context manager: a 2-node job moves 16 MB through 100 Mbit/s links in about the time
    the rate allows (not faster: the shaping is in the path), and the counters see it."""
    body = (
        "import numpy as np; from mpi4py import MPI; import time; c = MPI.COMM_WORLD; "
        "a = np.ones(4_000_000, np.float32); "
        "c.Barrier(); t = time.perf_counter(); "
        "c.Send(a, 1) if c.rank == 0 else c.Recv(a, 0); "
        "print(time.perf_counter() - t) if c.rank == 1 else None"
    )
    seconds, counters = _on_two_nodes(body, "100mbit")
    assert seconds >= 16e6 * 8 / 100e6 * 0.9  # 1.28 s at the link rate
    assert counters[0]["tx_bytes"] >= 16e6
    assert counters[1]["rx_bytes"] >= 16e6


def _on_two_nodes(body: str, bandwidth: str) -> tuple[float, list[dict]]:
    """``python -c body`` on a 2-node cluster (the context manager, removed after): the number
    it printed last and the links' counters."""
    with cluster.Cluster(2, bandwidth=bandwidth) as cl:
        proc = cl.run([sys.executable, "-c", body], timeout=120, capture_output=True, text=True)
        counters = cl.counters()
        names = list(cl.node_names) + [cl.switch]
        assert set(names) <= set(cluster._namespaces())
    assert proc.returncode == 0, proc.stderr
    assert not set(names) & set(cluster._namespaces())
    return float(proc.stdout.strip().splitlines()[-1]), counters


@pytest.mark.cluster
@needs_cluster
def test_a_short_message_after_a_pause_is_shaped():
    """100 KB after half a second of silence crosses a 10 Mbit/s link in about 80 ms. The
    bucket once held 128 KiB at every rate, so a message that fit in it crossed at memory
    speed (9 ms measured), and slow links favoured algorithms of small messages."""
    body = (
        "import numpy as np, time; from mpi4py import MPI; c = MPI.COMM_WORLD; "
        "a = np.ones(100_000, np.uint8); one = np.zeros(1, np.uint8); best = 1e9\n"
        "for _ in range(3):\n"
        "    c.Barrier(); time.sleep(0.5); t = time.perf_counter()\n"
        "    if c.rank == 0: c.Send(a, 1); c.Recv(one, 1)\n"
        "    else: c.Recv(a, 0); c.Send(one, 0)\n"
        "    best = min(best, time.perf_counter() - t)\n"
        "print(best) if c.rank == 0 else None"
    )
    seconds, _ = _on_two_nodes(body, "10mbit")
    assert seconds >= 100e3 * 8 / 10e6 * 0.9, seconds  # 80 ms at the link rate


@pytest.mark.cluster
@needs_cluster
def test_the_report_counts_the_command_not_the_latency_probe(tmp_path):
    """Without -q the run first measures the links' latency (a 200-round ping-pong between
    nodes 0 and 1); --report and the printed summary once counted it with the command.

    Each node's command prints what its link has sent since it was created, the probe
    included. The report must count at least 180 packets fewer (the probe sends 200).
    (Comparing a run with -q against one without cannot tell: the launch alone sends 28 to
    180 packets per link, as the launcher's small writes happen to coalesce.)"""
    report = tmp_path / "report.json"
    show = 'echo "sent $(hostname) $(cat /sys/class/net/eth0/statistics/tx_packets)"'
    argv = ["run", "--nodes", "2", "--report", str(report), "--", "sh", "-c", show]
    proc = _cluster_cli(argv)
    assert proc.returncode == 0, proc.stderr
    since_created = {}
    for line in proc.stdout.splitlines():
        if line.startswith("sent "):
            _, host, count = line.split()
            since_created[int(host.rsplit("-n", 1)[1])] = int(count)
    assert sorted(since_created) == [0, 1], proc.stdout
    reported = [link["tx_packets"] for link in _report(report)["links"]]
    for node, count in enumerate(reported):
        assert 0 < count <= since_created[node] - 180, (reported, since_created)


def test_check_reports_every_requirement():
    found = cluster.check()
    names = [name for name, _, _ in found.rows]
    for want in ("privileges", "ip", "tc", "unshare", "mpiexec", "netem (optional)"):
        assert want in names
    assert found.ok == (not found.problems())


@pytest.mark.cluster
@needs_cluster
def test_two_clusters_at_once_do_not_collide():
    """Two runs at the same time (same addresses inside, different namespaces): each job sees
    only its own nodes, and each run removes only what it created."""
    body = (
        "import socket; from mpi4py import MPI; "
        "names = MPI.COMM_WORLD.gather(socket.gethostname()); "
        "print(' '.join(names or []))"
    )
    with cluster.Cluster(2) as a, cluster.Cluster(2) as b:
        assert a.prefix != b.prefix
        pa = a.run([sys.executable, "-c", body], timeout=120, capture_output=True, text=True)
        pb = b.run([sys.executable, "-c", body], timeout=120, capture_output=True, text=True)
        assert pa.returncode == 0 and pb.returncode == 0, pa.stderr + pb.stderr
        assert sorted(pa.stdout.split()) == a.node_names
        assert sorted(pb.stdout.split()) == b.node_names
        b.destroy()
        assert set(a.node_names) <= set(cluster._namespaces())
        assert not set(b.node_names) & set(cluster._namespaces())


@pytest.mark.skipif(shutil.which("ip") is None, reason="needs the ip command")
def test_sweep_removes_the_scratch_folder_of_a_dead_run():
    """A run whose launcher and janitor were both killed left its scratch folder, which sweep
    did not remove; a live run's folder (this process's prefix) stays."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert not cluster._pid_alive(dead.pid)
    base = tempfile.gettempdir()
    gone = tempfile.mkdtemp(prefix=f"spardl-{dead.pid}-abc123-", dir=base)
    (Path(gone) / "launch-node").write_text("#!/bin/sh\n")
    live = tempfile.mkdtemp(prefix=f"spardl-{os.getpid()}-abc123-", dir=base)
    try:
        cluster.sweep()
        assert not os.path.exists(gone)
        assert os.path.isdir(live)
    finally:
        shutil.rmtree(gone, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)


@pytest.mark.parametrize("bad", ["t'q", 't"q', "t;q", "t$q", "t q"])
def test_a_tmpdir_the_launchers_shell_would_read_is_refused_up_front(bad, tmp_path):
    """A TMPDIR with a quote or a ; once built the whole cluster, then failed in MPICH's
    launcher (its shell read the scratch path: exit 255, a ; ran the rest as a command)."""
    tmp = tmp_path / bad
    tmp.mkdir()
    code = "from spardl import cluster; print(cluster.check_quick())"
    env = dict(os.environ, TMPDIR=str(tmp))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "TMPDIR" in proc.stdout and repr(str(tmp)) in proc.stdout, proc.stdout
