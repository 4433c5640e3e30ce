"""``spardl cluster {run,check,sweep}``: emulated multi-node runs on one machine
(:mod:`spardl.cluster`).

``spardl cluster run --nodes 4 --bandwidth 1gbit -- python bench/allreduce.py`` creates four
nodes linked at 1 Gbit/s, runs ``mpiexec -n 4 python bench/allreduce.py`` across them, prints what
each link carried, removes everything it created (also on Ctrl-C, a failure or a timeout) and
exits with the command's status as ``mpiexec`` reports it (124 after ``--timeout``; a rank killed
by a signal gives MPICH's 255 across several nodes, where ``mpiexec`` on one host gives the
signal's number). Usage errors, and a machine that cannot create namespaces, are one line on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import shutil
import signal
import sys
from pathlib import Path

from .common import POSITIVE_FLOAT, output_file

__all__ = ["add_cluster", "rate_type", "time_type"]


def _checked_text(parse_name: str, text: str) -> str:
    """``text`` if :mod:`spardl.cluster`'s ``parse_name`` accepts it, else argparse's error."""
    from .. import cluster

    try:
        getattr(cluster, parse_name)(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def rate_type(text: str) -> str:
    """argparse ``type=`` for a link rate in ``tc`` syntax (checked, kept as text)."""
    return _checked_text("parse_rate", text)


def time_type(text: str) -> str:
    """argparse ``type=`` for a time in ``tc`` syntax (checked, kept as text)."""
    return _checked_text("parse_time", text)


def _count_type(limit: str):
    """argparse ``type=``: an integer in [1, ``spardl.cluster.<limit>``] (the module is loaded
    when an option is parsed, not when the parser is built)."""

    def parse(text: str) -> int:
        from .. import cluster

        top = getattr(cluster, limit)
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not 1 <= v <= top:
            raise argparse.ArgumentTypeError(f"must be in [1, {top}], got {v}")
        return v

    parse.__name__ = "int"
    return parse


_nodes_type = _count_type("MAX_NODES")
_ranks_type = _count_type("MAX_RANKS_PER_NODE")


def add_cluster(sub) -> None:
    """Register ``spardl cluster`` and its subcommands on ``sub`` (an argparse subparsers)."""
    p = sub.add_parser(
        "cluster",
        help="run an MPI job across emulated nodes with shaped network links",
        description="Emulated nodes on this machine (network + UTS namespaces on a bridge, each "
        "link shaped with tc tbf), so MPI runs over real TCP links of a chosen rate. Needs root "
        "or CAP_NET_ADMIN and CAP_SYS_ADMIN.",
    )
    cs = p.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND", required=True)
    r = cs.add_parser(
        "run",
        help="create N nodes, run mpiexec -n N*R COMMAND across them, remove everything",
        description="Creates N nodes, runs `mpiexec -n N*R COMMAND ARGS...` with R ranks on "
        "each node, prints the bytes each node's link carried, tears everything down (also on "
        "Ctrl-C, failure or timeout) and exits with the command's status as mpiexec reports "
        "it (a rank killed by a signal: 255 across several nodes).",
    )
    r.add_argument("--nodes", "-N", type=_nodes_type, required=True, help="N, 1 to 250")
    r.add_argument(
        "--ranks-per-node", "-R", type=_ranks_type, default=1, help="R, 1 to 1024 (default 1)"
    )
    r.add_argument(
        "--bandwidth",
        type=rate_type,
        default="1gbit",
        help="each node's link rate, tc syntax: 100mbit, 1gbit, 10gbit (default %(default)s)",
    )
    r.add_argument(
        "--latency",
        type=time_type,
        default=None,
        help="added one-way delay, tc syntax (50us, 1ms); needs the netem qdisc (refused, "
        "before anything is created, where the kernel lacks it)",
    )
    r.add_argument("--timeout", type=POSITIVE_FLOAT, default=None, help="seconds; exit 124")
    r.add_argument(
        "--report",
        type=output_file,  # checked before the nodes exist and the command runs
        default=None,
        metavar="PATH",
        help="write the link counters as JSON",
    )
    r.add_argument("--quiet", "-q", action="store_true", help="no header and no link summary")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    r.set_defaults(func=_cmd_run)
    c = cs.add_parser("check", help="can this machine run emulated clusters? (what was found)")
    c.set_defaults(func=_cmd_check)
    s = cs.add_parser("sweep", help="remove what killed runs left behind")
    s.set_defaults(func=_cmd_sweep)


def _error(msg: str) -> int:
    print(f"spardl cluster: error: {msg}", file=sys.stderr, flush=True)
    return 2


def _cmd_check(args) -> int:
    from ..cluster import check

    found = check()
    width = max(len(name) for name, _, _ in found.rows)
    for name, ok, detail in found.rows:
        print(f"{'ok  ' if ok else 'FAIL'} {name:<{width}}  {detail}")
    print("this machine can run emulated clusters" if found.ok else "cannot run here")
    return 0 if found.ok else 2


def _cmd_sweep(args) -> int:
    from ..cluster import check_quick, sweep

    problem = check_quick()
    if problem:
        return _error(problem)
    removed = sweep()
    print(f"removed {len(removed)} namespace(s)" + (": " + ", ".join(removed) if removed else ""))
    return 0


def _on_sigterm(signum, frame):
    name = signal.Signals(signum).name
    print(f"spardl cluster: {name}; removing everything", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def _cmd_run(args) -> int:
    from ..cluster import (
        NETEM_MISSING,
        Cluster,
        ClusterError,
        check_quick,
        has_netem,
        measure_latency,
        parse_time,
    )

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        return _error("no command given (spardl cluster run --nodes N -- COMMAND [ARGS...])")
    if not command[0] or command[0].startswith("-"):
        # mpiexec would take it as one of its own options (or an empty program name).
        return _error(f"the command must start with a program, got {command[0]!r}")
    if shutil.which(command[0]) is None:
        # Checked here, before any namespace exists: MPI's launcher would report it once per
        # node, in its own words, after the cluster was built.
        return _error(f"no program {command[0]!r} (not an executable file, nor on PATH)")
    problem = check_quick()
    if problem:
        return _error(problem)
    if args.latency is not None and parse_time(args.latency) > 0:
        # Probed here, before any namespace exists (a namespace of the probe's own, gone when
        # it exits): the cluster would otherwise be built only to be refused.
        try:
            netem = has_netem()
        except ClusterError as e:
            return _error(f"--latency: {e}")
        if not netem:
            return _error(f"--latency {args.latency}: {NETEM_MISSING}")
    # SIGHUP (a closed terminal or SSH session) ends the run as SIGTERM does, with everything
    # removed. Set here, after the imports: MPI's libraries may install their own handler.
    previous = {sig: signal.signal(sig, _on_sigterm) for sig in (signal.SIGTERM, signal.SIGHUP)}
    # SIGUSR1 prints every thread's stack to stderr: how a launcher that does not exit can be
    # asked where it waits (tests/test_cluster.py does when one is late).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        with Cluster(args.nodes, args.ranks_per_node, args.bandwidth, args.latency) as cl:
            if not args.quiet:
                lat = ""
                if cl.nodes >= 2:
                    lat = f"; one-way latency {measure_latency(cl) * 1e6:.0f} us (TCP ping-pong)"
                    cl.reset_counters()  # --report and the summary count the command only
                print(f"spardl cluster: {cl.describe()}{lat}", file=sys.stderr, flush=True)
            proc = cl.run(command, timeout=args.timeout)
            counters = cl.counters()
    except ClusterError as e:
        return _error(str(e))
    except KeyboardInterrupt:
        print("spardl cluster: interrupted; everything removed", file=sys.stderr, flush=True)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if proc.returncode == 124 and args.timeout is not None:
        print(f"spardl cluster: timed out after {args.timeout:g} s", file=sys.stderr, flush=True)
    if not args.quiet:
        for i, c in enumerate(counters):
            print(
                f"spardl cluster: node {i}: sent {c['tx_bytes'] / 1e6:.3f} MB, "
                f"received {c['rx_bytes'] / 1e6:.3f} MB",
                file=sys.stderr,
            )
    status = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    if args.report is not None:
        try:
            _write_report(args, command, proc.returncode, counters)
        except OSError as e:  # the folder removed or filled while the command ran
            print(f"spardl cluster: --report: {e}", file=sys.stderr, flush=True)
            return status or 1
    return status


def _write_report(args, command, returncode, counters) -> None:
    """``--report``: the layout, the command, its status and each link's counters, as JSON."""
    report = {
        "nodes": args.nodes,
        "ranks_per_node": args.ranks_per_node,
        "bandwidth": args.bandwidth,
        "command": command,
        "returncode": returncode,
        "links": counters,
    }
    Path(args.report).write_text(json.dumps(report, indent=1))
