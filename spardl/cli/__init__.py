"""The ``spardl`` command line: ``spardl {train,demo,info,model,bench,cluster}`` (``python -m
spardl`` too).

One module per subcommand family (:mod:`.training`: train and demo; :mod:`.info`; :mod:`.model`:
model and bench; :mod:`.cluster`), each with ``add_<name>(subparsers)`` functions that register a
parser and set ``func`` (called with the parsed arguments, returns an exit code); what they
share (the usage error, option types, the collective runner) is in :mod:`.common`, which imports
none of them. To add a subcommand, write such a function and append it to :data:`COMMANDS`. Keep
module-level imports light: ``spardl --help`` must not import torch, and importing this package
not even numpy (loaded in :func:`main`, where a Ctrl-C is one line, not a traceback).
"""

from __future__ import annotations

import argparse
import signal
import sys

from ..mpiexec import mpiexec_path
from .cluster import add_cluster
from .common import Parser, run_collective
from .info import add_info
from .model import add_bench, add_model
from .training import add_demo, add_train, launch_train

__all__ = ["COMMANDS", "build_parser", "main", "mpiexec_path", "run_collective", "launch_train"]

#: Subcommand registrars, in help order. Append ``add_<name>`` to add a subcommand.
COMMANDS = [add_train, add_demo, add_info, add_model, add_bench, add_cluster]


def build_parser() -> argparse.ArgumentParser:
    """The ``spardl`` parser with every subcommand of :data:`COMMANDS`."""
    import spardl

    parser = Parser(
        prog="spardl",
        description="Sparse gradient allreduce (SparDL, Ok-Topk and peers) over MPI.",
    )
    parser.add_argument("--version", action="version", version=f"spardl {spardl.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``spardl`` and ``python -m spardl``; returns the exit code.

    A Ctrl-C that no subcommand handled (one that arrives while the parser imports what a
    subcommand needs, or before a subcommand installs its own handling) is one line on stderr
    and status 130, as a shell gives an interrupted command, not a traceback.
    """
    try:
        # The subcommands' modules load with Ctrl-C held back, raised once they are loaded: one
        # that interrupts a C extension's import (numpy's) surfaces as its ImportError instead.
        # The mask is read first: a Ctrl-C already pending raises from the call that blocks,
        # and the finally then restores the mask it found.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, ())
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            parser = build_parser()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        args, extra = parser.parse_known_args(argv)
        if extra:  # named by the subcommand whose options they are not ("spardl train: error: ...")
            _leaf(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("spardl: interrupted", file=sys.stderr, flush=True)
        return 130


def _leaf(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The (sub)parser that parsed the chosen (sub)command of ``args``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None))
            if chosen is not None:
                return _leaf(chosen, args)
    return parser
