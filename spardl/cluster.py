"""Emulated multi-node clusters on one Linux machine: MPI over real TCP links of a chosen rate.

A *node* is a network namespace (its own interfaces, addresses and routing) entered together with
a UTS namespace (its own hostname, so MPI treats ranks on different nodes as remote and never uses
shared memory between them). Each node has one interface, ``eth0``, the end of a veth pair whose
other end is a port of a bridge (the *switch*) that lives in a namespace of its own. Both ends of
every link are shaped with a token bucket (``tc qdisc ... tbf rate RATE``): a node sends and
receives at most RATE, like a full-duplex NIC on a non-blocking switch. Ranks on the same node
(``ranks_per_node > 1``) talk through shared memory, as on a real node.

``mpiexec`` (MPICH's hydra) runs in the switch namespace and starts its proxies on the nodes
through a launcher shim written for the run: hydra calls it the way it would call ``ssh``, and
the shim enters the node's namespaces instead. The network transport is forced to TCP
(``UCX_TLS=tcp,self``): other transports could reach another namespace through shared memory and
bypass the shaping. Bytes that crossed a link can be read from each node's interface counters
(:meth:`Cluster.counters`, :func:`node_counters`).

Addresses come from 198.18.0.0/15, the range set aside for network benchmarks (RFC 2544), and
exist only inside the namespaces a run creates; no route leads anywhere else. Every name carries a
per-run prefix (``spardl-<pid>-<tag>``) so two runs never collide. Everything a run creates is
removed when it ends, also on an exception, Ctrl-C or a timeout; a janitor process removes it if
the launcher itself is killed, and :func:`sweep` removes what runs killed in other ways left.

Latency: ``tc netem`` adds delay where the kernel has it; where it does not (:func:`has_netem`),
asking for a latency is an error, raised before anything is created, and :func:`measure_latency`
reports what the links give.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ._checks import check_int
from .mpiexec import mpiexec_path

__all__ = [
    "Cluster",
    "ClusterError",
    "CheckResult",
    "check",
    "has_netem",
    "measure_latency",
    "node_counters",
    "parse_rate",
    "parse_time",
    "sweep",
]

#: The benchmarking range (RFC 2544): node i is 198.18.0.(i+1), mpiexec runs at .254.
SUBNET = "198.18.0"
HEAD_ADDRESS = f"{SUBNET}.254"
MAX_NODES = 250
#: Ranks per node: far more processes than one machine runs (and mpiexec's -n stays an int).
MAX_RANKS_PER_NODE = 1024
#: Link rates the emulation accepts, in bits per second: below 1 Mbit/s an MPI job's start-up
#: alone takes minutes; above 100 Gbit/s the shaping is not what limits a veth pair.
MIN_RATE, MAX_RATE = 1e6, 1e11
#: Transport settings that keep MPI on the shaped TCP links (UCX, the MPICH wheel's netmod).
TCP_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}
_PREFIX_RE = re.compile(r"^spardl-(\d+)-([0-9a-f]{6})-")
_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21
#: The folder that holds this package (the janitor imports it from there).
_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)


class ClusterError(RuntimeError):
    """The cluster could not be created or used (privileges, tools, kernel features)."""


#: Why a latency is refused where :func:`has_netem` is False.
NETEM_MISSING = (
    "an added latency needs the netem qdisc, which this kernel does not have (links keep "
    "their own latency; measure it with spardl.cluster.measure_latency or spardl bench pingpong)"
)


# -- units ---------------------------------------------------------------------------------------
_RATE_UNITS = {
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "kibit": 2**10,
    "mibit": 2**20,
    "gibit": 2**30,
    "tibit": 2**40,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
    "tbps": 8e12,
    "kibps": 8 * 2**10,
    "mibps": 8 * 2**20,
    "gibps": 8 * 2**30,
    "tibps": 8 * 2**40,
}
_TIME_UNITS = {
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "ms": 1e-3,
    "msec": 1e-3,
    "msecs": 1e-3,
    "us": 1e-6,
    "usec": 1e-6,
    "usecs": 1e-6,
    "": 1e-6,  # tc reads a bare number as microseconds
}
_NUM_UNIT = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_rate(text: str) -> float:
    """A rate in ``tc`` syntax, in bits per second.

    Parameters
    ----------
    text : str
        A number and a unit as ``tc`` reads them: ``bit`` (or no unit), ``kbit``, ``mbit``,
        ``gbit``, ``tbit``; ``bps``, ``kbps``, ... are *bytes* per second, as in ``tc``;
        ``kibit``, ``mibit``, ... are binary multiples. Case does not matter.

    Returns
    -------
    float
        Bits per second, in [:data:`MIN_RATE`, :data:`MAX_RATE`] (1 Mbit/s to 100 Gbit/s).

    Raises
    ------
    ValueError
        If ``text`` is not a rate in that syntax and range (a negative or zero rate: "rate must
        be positive").
    """
    m = _NUM_UNIT.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or (unit or "bit") not in _RATE_UNITS:
        raise ValueError(
            f"rate must be a number with a tc unit (e.g. 1gbit, 100mbit, 10gbit), got {text!r}"
        )
    value = float(m.group(1)) * _RATE_UNITS[unit or "bit"]
    if value <= 0:
        raise ValueError(f"rate must be positive (e.g. 1gbit, 100mbit), got {text!r}")
    if not MIN_RATE <= value <= MAX_RATE:
        raise ValueError(
            f"rate must be between 1mbit and 100gbit (tc syntax, e.g. 1gbit), got {text!r}"
        )
    return value


def parse_time(text: str) -> float:
    """A time in ``tc`` syntax (``50us``, ``1ms``, ``0.5s``; a bare number is microseconds),
    in seconds.

    Parameters
    ----------
    text : str
        A number and a unit: ``s`` (``sec``, ``secs``), ``ms`` (``msec``, ``msecs``), ``us``
        (``usec``, ``usecs``) or none (microseconds). Case does not matter.

    Returns
    -------
    float
        Seconds, finite and >= 0.

    Raises
    ------
    ValueError
        If ``text`` is not a non-negative, finite time in that syntax.
    """
    m = _NUM_UNIT.match(str(text))
    if not m or m.group(2).lower() not in _TIME_UNITS:
        raise ValueError(f"time must be a number with a tc unit (e.g. 50us, 1ms), got {text!r}")
    value = float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]
    if value < 0 or m.group(1).startswith("-"):
        raise ValueError(f"time must not be negative (e.g. 50us, 1ms), got {text!r}")
    if not math.isfinite(value):
        raise ValueError(f"time must be finite (e.g. 50us, 1ms), got {text!r}")
    return value


#: The bytes of the largest Ethernet frame the links carry (MTU 1500 and its 14-byte header).
_FRAME_BYTES = 1514


def _tbf_args(rate_bps: float) -> list[str]:
    # A bucket of 1 ms at the link rate (at least two full frames) and a queue of up to
    # 100 ms: TCP reaches the rate without drops, and the shaping error stays within a
    # millisecond per burst. The kernel's tbf splits an offloaded (GSO) segment larger than the
    # bucket into frames. A floor of two 64 KiB segments, as the bucket once had, let 128 KiB
    # through unshaped after every pause: 10 ms at 100 Mbit/s, a second at 1 Mbit/s.
    burst = max(int(rate_bps / 8 / 1000), 2 * _FRAME_BYTES)
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "100ms"]


# -- running commands ----------------------------------------------------------------------------
def _run(cmd: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise ClusterError(f"{' '.join(cmd)}: {msg[-1] if msg else f'exit {proc.returncode}'}")
    return proc


def _in_ns(ns: str, cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return _run(["ip", "netns", "exec", ns, *cmd], **kw)


def _namespaces() -> list[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_namespaces(names: list[str]) -> None:
    """Kill every process inside ``names`` (TERM, then KILL), then delete the namespaces."""
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
        pids = set()
        for ns in names:
            proc = _run(["ip", "netns", "pids", ns], check=False)
            pids.update(int(p) for p in proc.stdout.split() if p.isdigit())
        pids.discard(os.getpid())
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.05)
    for ns in names:
        _run(["ip", "netns", "del", ns], check=False)


def _remove_prefix(prefix: str) -> list[str]:
    names = [ns for ns in _namespaces() if ns.startswith(prefix + "-")]
    _remove_namespaces(names)
    return names


def sweep() -> list[str]:
    """Remove the namespaces and scratch folders of cluster runs whose launcher process no
    longer exists.

    Returns
    -------
    list of str
        The names removed. Namespaces of live runs (another ``spardl cluster run`` now) stay.
    """
    dead = sorted(
        {
            m.group(0)[:-1]
            for ns in _namespaces()
            if (m := _PREFIX_RE.match(ns)) and not _pid_alive(int(m.group(1)))
        }
    )
    removed = []
    for prefix in dead:
        removed += _remove_prefix(prefix)
    # The scratch folders of such runs (Cluster's mkdtemp, named by the same prefix): the
    # janitor removes them, unless it was killed too.
    scratch = Path(tempfile.gettempdir())
    for d in scratch.glob("spardl-*"):
        m = _PREFIX_RE.match(d.name)
        if m and d.is_dir() and not d.is_symlink() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)
    return removed


# -- capability check ----------------------------------------------------------------------------
@dataclass
class CheckResult:
    """What :func:`check` found: ``ok`` and one (name, passed, detail) row per requirement."""

    ok: bool
    rows: list[tuple[str, bool, str]] = field(default_factory=list)
    netem: bool = False

    def problems(self) -> list[str]:
        """The failed requirements, as ``name: detail`` strings."""
        return [f"{name}: {detail}" for name, passed, detail in self.rows if not passed]


def _has_privileges() -> bool:
    """Whether this process may build a cluster: CAP_NET_ADMIN (links, qdiscs) and
    CAP_SYS_ADMIN (``ip netns add`` mounts the namespace), as root has them."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                caps = int(line.split()[1], 16)
                return all(caps >> bit & 1 for bit in (_CAP_NET_ADMIN, _CAP_SYS_ADMIN))
    except OSError:
        pass
    return os.geteuid() == 0


def check() -> CheckResult:
    """Whether this machine can run an emulated cluster, and what was found.

    Checks: root, or CAP_NET_ADMIN and CAP_SYS_ADMIN; the ``ip``, ``tc`` and ``unshare``
    commands; that a network namespace, a veth pair and a ``tbf`` qdisc can be created (a
    scratch namespace, removed again); whether ``netem`` exists (needed only for ``latency``);
    an ``mpiexec`` with hydra's ssh launcher.

    Returns
    -------
    CheckResult
    """
    rows: list[tuple[str, bool, str]] = []
    priv = _has_privileges()
    rows.append(
        (
            "privileges",
            priv,
            "CAP_NET_ADMIN, CAP_SYS_ADMIN"
            if priv
            else "needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN (run as root or with sudo)",
        )
    )
    tools = {t: shutil.which(t) for t in ("ip", "tc", "unshare")}
    for t, path in tools.items():
        rows.append((t, path is not None, path or f"`{t}` not found (iproute2 / util-linux)"))
    try:
        mpiexec = mpiexec_path()
        rows.append(("mpiexec", True, mpiexec))
    except FileNotFoundError as e:
        rows.append(("mpiexec", False, str(e)))
    netem, netem_tried = False, False
    if priv and all(tools.values()):
        ns = f"spardl-{os.getpid()}-{secrets.token_hex(3)}-check"
        try:
            _run(["ip", "netns", "add", ns])
            veth = ["veth", "peer", "name", "c1", "netns", ns]
            _run(["ip", "link", "add", "c0", "netns", ns, "type", *veth])
            _in_ns(ns, ["tc", "qdisc", "add", "dev", "c0", "root", *_tbf_args(1e9)])
            rows.append(("namespaces, veth, tbf", True, "created and removed a scratch node"))
        except (ClusterError, subprocess.TimeoutExpired) as e:
            rows.append(("namespaces, veth, tbf", False, str(e)))
        else:
            with contextlib.suppress(ClusterError):  # a probe that cannot run: not checked
                netem, netem_tried = has_netem(), True
        finally:
            if ns in _namespaces():
                _remove_namespaces([ns])
    rows.append(
        (
            "netem (optional)",
            True,
            "not checked (needs the privileges, tools and namespaces above)"
            if not netem_tried
            else "available: --latency works"
            if netem
            else "not in this kernel: --latency is refused; links add only their own latency",
        )
    )
    return CheckResult(all(p for _, p, _ in rows), rows, netem)


# -- the cluster ---------------------------------------------------------------------------------
_SHIM = """#!/bin/sh
# Launcher shim of one spardl cluster run: hydra calls it as it would call ssh
# (options, then the host, then the command line); it enters that node instead.
while [ $# -gt 0 ]; do
  case "$1" in -x|-q|-T|-n|-t) shift ;; -o|-p|-l|-i) shift 2 ;; *) break ;; esac
done
host=$1; shift
case "$host" in
{cases}
  *) echo "spardl cluster: no node $host in this run" >&2; exit 255 ;;
esac
export SPARDL_CLUSTER_NODE="$name"
exec ip netns exec "$ns" unshare --uts /bin/sh -c 'hostname "$0" && exec /bin/sh -c "$1"' \\
  "$name" "$*"
"""


class Cluster:
    """An emulated cluster: ``nodes`` namespaces on a shaped switch, used as a context manager.

    Parameters
    ----------
    nodes : int
        N, the number of nodes, 1 ≤ N ≤ 250.
    ranks_per_node : int, default 1
        R, MPI ranks started on each node, 1 ≤ R ≤ 1024 (world size N·R, ranks placed node by
        node: ranks 0 … R−1 on node 0, and so on).
    bandwidth : str, default "1gbit"
        Each node's link rate in ``tc`` syntax, applied in both directions.
    latency : str, optional
        Added one-way delay in ``tc`` syntax (``50us``); needs the ``netem`` qdisc
        (:func:`has_netem`; without it, entering the ``with`` block raises ClusterError before
        anything is created).
    env : dict, optional
        Extra environment for the MPI job (on top of :data:`TCP_ENV`).

    Raises
    ------
    TypeError
        For an argument of the wrong type (named).
    ValueError
        For an argument out of range or malformed (named).
    ClusterError
        On entry, before anything is created, if the machine cannot create the cluster (see
        :func:`check`), or ``latency`` is given and the kernel lacks netem.

    Examples
    --------
    >>> with Cluster(nodes=4, bandwidth="1gbit") as c:            # doctest: +SKIP
    ...     proc = c.run([sys.executable, "bench/allreduce.py"], timeout=600)
    ...     c.counters()  # bytes each node's link sent and received so far
    """

    def __init__(self, nodes, ranks_per_node=1, bandwidth="1gbit", latency=None, env=None):
        check_int("nodes", nodes, numpy=False)
        check_int("ranks_per_node", ranks_per_node, numpy=False)
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes must be in [1, {MAX_NODES}], got {nodes}")
        if not 1 <= ranks_per_node <= MAX_RANKS_PER_NODE:
            raise ValueError(
                f"ranks_per_node must be in [1, {MAX_RANKS_PER_NODE}], got {ranks_per_node}"
            )
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.bandwidth = str(bandwidth)
        try:
            self.rate_bps = parse_rate(bandwidth)
        except ValueError as e:
            raise ValueError(f"bandwidth: {e}") from None
        self.latency = None if latency is None else str(latency)
        try:
            self.latency_s = None if latency is None else parse_time(latency)
        except ValueError as e:
            raise ValueError(f"latency: {e}") from None
        self.env = dict(env or {})
        self.prefix = f"spardl-{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.prefix}-sw"
        self.node_names = [f"{self.prefix}-n{i}" for i in range(nodes)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(nodes)]
        self._tmp: str | None = None
        self._janitor: subprocess.Popen | None = None
        self._baseline: list[dict] | None = None

    @property
    def world_size(self) -> int:
        """N·R, the number of MPI ranks :meth:`run` starts."""
        return self.nodes * self.ranks_per_node

    # -- life cycle ---------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def create(self) -> None:
        """Create the switch, the nodes and their shaped links (called by ``with``)."""
        found = check_quick()
        if found:
            raise ClusterError(found)
        if self.latency_s and not has_netem():  # before anything exists
            raise ClusterError(f"latency={self.latency!r}: {NETEM_MISSING}")
        sweep()
        self._tmp = tempfile.mkdtemp(prefix=self.prefix + "-")
        # The janitor removes everything if this process dies without cleaning up (SIGKILL).
        self._janitor = subprocess.Popen(
            [sys.executable, "-c", _JANITOR, self.prefix, self._tmp, _PACKAGE_PARENT],
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            self._build()
        except BaseException:
            self.destroy()
            raise

    def _build(self) -> None:
        sw = self.switch
        _run(["ip", "netns", "add", sw])
        _run(["ip", "-n", sw, "link", "set", "lo", "up"])
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "addr", "add", f"{HEAD_ADDRESS}/24", "dev", "br0"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        shaping = _tbf_args(self.rate_bps)
        for i, (ns, addr) in enumerate(zip(self.node_names, self.addresses, strict=True)):
            port = f"p{i}"
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(
                ["ip", "link", "add", "eth0", "netns", ns, "type", "veth"]
                + ["peer", "name", port, "netns", sw]
            )
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", sw, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            for where, dev in ((ns, "eth0"), (sw, port)):
                _in_ns(where, ["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", *shaping])
                if self.latency_s:
                    proc = _in_ns(
                        where,
                        ["tc", "qdisc", "add", "dev", dev, "parent", "1:", "handle", "10:"]
                        + ["netem", "delay", f"{self.latency_s / 2 * 1e6:.0f}us"],
                        check=False,
                    )
                    if proc.returncode != 0:
                        raise ClusterError(f"latency={self.latency!r}: {NETEM_MISSING}")
        shim = Path(self._tmp) / "launch-node"
        cases = "\n".join(
            f"  {addr}) ns={ns}; name={ns} ;;"
            for ns, addr in zip(self.node_names, self.addresses, strict=True)
        )
        shim.write_text(_SHIM.format(cases=cases))
        shim.chmod(0o755)
        self._shim = str(shim)
        self._baseline = self._read_counters()

    def destroy(self) -> None:
        """Kill every process in the cluster and remove all it created (idempotent)."""
        _remove_prefix(self.prefix)
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if self._janitor is not None:
            with contextlib.suppress(OSError):
                self._janitor.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._janitor.wait(timeout=10)
            self._janitor = None

    # -- using it -----------------------------------------------------------------------------
    def mpiexec_command(self, command: list[str]) -> list[str]:
        """The command line that starts ``command`` on N·R ranks across the nodes (run it with
        :meth:`run`, which also sets the environment)."""
        hosts = ",".join(f"{a}:{self.ranks_per_node}" for a in self.addresses)
        return [
            "ip",
            "netns",
            "exec",
            self.switch,
            mpiexec_path(),
            "-localhost",
            HEAD_ADDRESS,
            "-launcher",
            "ssh",
            "-launcher-exec",
            self._shim,
            "-hosts",
            hosts,
            "-n",
            str(self.world_size),
            *command,
        ]

    def environment(self) -> dict[str, str]:
        """The environment :meth:`run` gives the MPI job."""
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_"))}
        return {
            **inherited,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "NUMBA_NUM_THREADS": "1",
            **TCP_ENV,
            "SPARDL_CLUSTER_BANDWIDTH": self.bandwidth,
            "SPARDL_CLUSTER_NODES": str(self.nodes),
            **self.env,
        }

    def run(self, command: list[str], timeout: float | None = None, **popen_kw):
        """Run ``command`` on every rank (``mpiexec -n N·R``) and wait for it.

        Parameters
        ----------
        command : list of str
            The program and its arguments, as for ``mpiexec``.
        timeout : float, optional
            Seconds; the whole MPI job is killed when it runs longer.
        **popen_kw
            Passed to :func:`subprocess.run` (``capture_output=True``, ``text=True``, ``cwd``).

        Returns
        -------
        subprocess.CompletedProcess
            ``returncode`` 124 if the job timed out (its output so far in stdout/stderr).
        """
        if self._tmp is None:
            raise ClusterError("the cluster is not created (use it in a with block)")
        cmd = self.mpiexec_command(list(command))
        proc = subprocess.Popen(
            cmd, env=self.environment(), start_new_session=True, **_popen(popen_kw)
        )
        try:
            out, err = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            code = 124
        except BaseException:
            _kill_group(proc)
            proc.wait()
            raise
        return subprocess.CompletedProcess(cmd, code, out, err)

    def _read_counters(self) -> list[dict]:
        rows = []
        for ns in self.node_names:
            vals = {}
            for key in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"):
                proc = _in_ns(ns, ["cat", f"/sys/class/net/eth0/statistics/{key}"])
                vals[key] = int(proc.stdout.strip())
            rows.append(vals)
        return rows

    def reset_counters(self) -> None:
        """Count the links' traffic from now on (:meth:`counters`), e.g. after a probe such as
        :func:`measure_latency` that is not part of the job being measured."""
        self._baseline = self._read_counters()

    def counters(self) -> list[dict]:
        """Per node, what its link carried since the cluster was created or
        :meth:`reset_counters` last called: a dict with ``tx_bytes``, ``rx_bytes``,
        ``tx_packets``, ``rx_packets``, as the veth counts them: packets with their headers,
        where a packet is a frame below 1 Gbit/s and mostly a whole offload segment (up to
        64 KiB, one set of headers) at 1 Gbit/s and above, where tbf's bucket holds one and
        does not split it (docs/design.md, "Counters")."""
        now = self._read_counters()
        return [
            {k: v - b[k] for k, v in n.items()} for n, b in zip(now, self._baseline, strict=True)
        ]

    def describe(self) -> str:
        """One line: nodes, ranks, rate, latency."""
        lat = f", +{self.latency} latency" if self.latency else ""
        return (
            f"{self.nodes} node(s) x {self.ranks_per_node} rank(s), "
            f"{self.bandwidth} links{lat} ({self.prefix})"
        )


def _popen(kw: dict) -> dict:
    kw = dict(kw)
    if kw.pop("capture_output", False):
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
    return kw


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=3)
            return
        except subprocess.TimeoutExpired:
            continue


def check_quick() -> str | None:
    """The first missing requirement in one line (no namespace is created), or None."""
    if not _has_privileges():
        return (
            "emulated clusters need root, or CAP_NET_ADMIN and CAP_SYS_ADMIN "
            "(try: sudo spardl cluster ...)"
        )
    for t in ("ip", "tc", "unshare"):
        if shutil.which(t) is None:
            return f"emulated clusters need the `{t}` command (iproute2 / util-linux)"
    tmp = tempfile.gettempdir()
    if any(c.isspace() for c in tmp):
        # MPICH's launcher splits the launcher path of the run's scratch folder at blanks.
        return f"the temporary folder {tmp!r} has a blank in its path: set TMPDIR to one without"
    bad = sorted(set(_UNSAFE_PATH.findall(tmp)))
    if bad:
        # ... and hands it to a shell unquoted: a quote or ; there would be read as shell
        return (
            f"the temporary folder {tmp!r} has {''.join(bad)!r} in its path, which the MPI "
            "launcher's shell would read: set TMPDIR to a path of letters, digits and _./+,:=@%-"
        )
    return None


#: The characters of a TMPDIR that the MPI launcher's shell would read as syntax.
_UNSAFE_PATH = re.compile(r"[^A-Za-z0-9_./+,:=@%-]")


#: What :func:`has_netem`'s probe exits with when the qdisc was refused (not tc's own codes, nor
#: unshare's 1).
_NO_NETEM = 97
#: What ``tc`` prints for a qdisc kind the kernel does not have.
_UNKNOWN_QDISC = "qdisc kind is unknown"


def has_netem() -> bool:
    """Whether this kernel has the ``netem`` qdisc, which a cluster's ``latency`` needs.

    Tried as a run would use it: ``tc qdisc add ... netem delay 1ms`` on the loopback of a
    network namespace of the probe's own (``unshare --net``: it has no name, nothing else in it,
    and goes when the probe exits, also if this process is killed), in a few milliseconds.
    Needs what :func:`check_quick` checks (root, or CAP_NET_ADMIN and CAP_SYS_ADMIN, and
    ``tc`` and ``unshare``).

    Returns
    -------
    bool
        True if the qdisc was created, False if ``tc`` refused it as a kind the kernel does not
        have.

    Raises
    ------
    ClusterError
        If the probe could not run (no namespace could be created), or ``tc`` failed for
        another reason (its message is given).
    """
    # The qdisc itself is tried, not a list of modules: netem may be built in (absent from
    # /proc/modules and the module tree), a module that the kernel loads on demand (present in
    # /lib/modules/$(uname -r), which a container often lacks), or a module file a kernel that
    # forbids module loading cannot use (modprobe -n still finds it). Only the kernel knows.
    probe = f"tc qdisc add dev lo root netem delay 1ms || exit {_NO_NETEM}"
    try:
        proc = _run(["unshare", "--net", "--", "/bin/sh", "-c", probe], check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ClusterError(f"cannot probe for the netem qdisc: {e}") from None
    msg = (proc.stderr or proc.stdout).strip().splitlines()
    # tc's words for a qdisc the kernel lacks; any other refusal (EPERM, say) is no answer
    if proc.returncode == 0 or (proc.returncode == _NO_NETEM and _UNKNOWN_QDISC in str(msg)):
        return proc.returncode == 0
    raise ClusterError(
        f"cannot probe for the netem qdisc: {msg[-1] if msg else f'exit {proc.returncode}'}"
    )


def _janitor_main(prefix: str, tmp: str) -> None:
    """The janitor of one run, in its own session: waits until the launcher's pipe closes
    (the run ended, or the launcher died without cleaning up), then removes every namespace of
    the run and its scratch folder."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdin.read()
    _remove_prefix(prefix)
    shutil.rmtree(tmp, ignore_errors=True)


# The janitor imports this module from the launcher's copy of the package (its parent folder
# first on sys.path, whatever the current folder holds). The package's import is light (MPI is
# imported with the algorithms, on first use): the last-resort cleanup never starts MPI.
_JANITOR = (
    "import sys; sys.path.insert(0, sys.argv[3]); "
    "from spardl.cluster import _janitor_main; _janitor_main(*sys.argv[1:3])"
)


# -- measurements from inside a node -------------------------------------------------------------
def node_counters(interface: str = "eth0") -> dict | None:
    """This node's interface counters, read from inside a cluster node (a rank of a job that
    :meth:`Cluster.run` started); None outside a cluster.

    Returns
    -------
    dict or None
        ``tx_bytes``, ``rx_bytes``, ``tx_packets``, ``rx_packets`` since the link was created.
    """
    if not os.environ.get("SPARDL_CLUSTER_NODE"):
        return None
    base = Path("/sys/class/net") / interface / "statistics"
    try:
        return {
            k: int((base / k).read_text())
            for k in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
        }
    except OSError:
        return None


def measure_latency(cluster: Cluster, rounds: int = 200, size: int = 1) -> float:
    """One-way latency between node 0 and node 1 of ``cluster``: half the median round trip of
    a ``size``-byte TCP ping-pong (Python sockets, so it includes a few µs of interpreter time).

    Returns
    -------
    float
        Seconds.

    Raises
    ------
    ValueError
        If the cluster has fewer than 2 nodes.
    """
    if cluster.nodes < 2:
        raise ValueError("measure_latency needs a cluster of at least 2 nodes")
    port = 47000 + secrets.randbelow(1000)
    server = subprocess.Popen(
        ["ip", "netns", "exec", cluster.node_names[1], sys.executable, "-c", _ECHO, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        server.stdout.readline()  # "ready"
        proc = _in_ns(
            cluster.node_names[0],
            [sys.executable, "-c", _PING, cluster.addresses[1], str(port), str(rounds), str(size)],
            timeout=60,
        )
        return float(proc.stdout.strip()) / 2
    finally:
        server.kill()
        server.wait()


_ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    b = c.recv(1 << 16)
    if not b:
        break
    c.sendall(b)
"""

_PING = """
import socket, statistics, sys, time
host, port, rounds, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
for _ in range(100):
    try:
        c = socket.create_connection((host, port), timeout=5); break
    except OSError:
        time.sleep(0.05)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
msg = b"x" * size; ts = []
for i in range(rounds + 10):
    t = time.perf_counter(); c.sendall(msg); got = 0
    while got < size:
        got += len(c.recv(size - got))
    if i >= 10:
        ts.append(time.perf_counter() - t)
print(statistics.median(ts))
"""
