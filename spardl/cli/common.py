"""What every ``spardl`` subcommand shares: the usage error, range-checked option types, the
parser that reports a usage error once under ``mpiexec``, and the collective runner.

Kept free of the subcommands (they import it, never the other way) and light: argparse, os,
re, tempfile and pathlib at import, mpi4py only when a collective runs, matplotlib only when a
plot path is checked. The bench scripts load this file by its path, without importing
``spardl``: nothing here may import relative to the package at module level.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
from pathlib import Path

__all__ = [
    "UsageError",
    "option_type",
    "DENSITY",
    "POSITIVE_INT",
    "NONNEGATIVE_INT",
    "SEED",
    "POSITIVE_FLOAT",
    "LEARNING_RATE",
    "MOMENTUM",
    "MAX_RANKS",
    "output_file",
    "output_file_parents",
    "output_dir",
    "plot_file",
    "launcher_rank",
    "Parser",
    "run_collective",
]


#: What :class:`Parser` takes for a value, not an option, at the start of an argument.
_NEGATIVE_NUMBER = re.compile(r"-\.?\d")


class UsageError(ValueError):
    """An invalid option, found from the options and P alone: the same on every rank, before
    any communication, so every rank can report it and exit without aborting the job."""


def option_type(kind, ok, what):
    """An argparse ``type=``: ``kind(text)`` that must satisfy ``ok``, else a usage error
    (argparse names the option and exits with status 2 on every rank, before MPI is used).

    The returned function keeps ``ok`` and ``what`` as attributes, so a caller can check a value
    that did not come through the parser with the same rule and wording.
    """

    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return v

    parse.__name__ = kind.__name__  # argparse's "invalid <name> value" wording
    parse.__doc__ = f"argparse ``type=``: {what} (a usage error otherwise)."
    parse.ok, parse.what = ok, what
    return parse


DENSITY = option_type(float, lambda v: 0 < v <= 1, "a density in (0, 1]")
POSITIVE_INT = option_type(int, lambda v: v >= 1, "an integer >= 1")
NONNEGATIVE_INT = option_type(int, lambda v: v >= 0, "an integer >= 0")
# Random seeds: NumPy and scikit-learn take 32-bit unsigned ones.
SEED = option_type(int, lambda v: 0 <= v < 2**32, "an integer in [0, 2**32)")
POSITIVE_FLOAT = option_type(float, lambda v: v > 0 and math.isfinite(v), "a finite number > 0")
MOMENTUM = option_type(float, lambda v: 0 <= v < 1, "a momentum in [0, 1)")
# A step size: torch's optimizers multiply float32 parameters by it, so it must be one.
LEARNING_RATE = option_type(
    float, lambda v: 0 < v <= 3.4028234663852886e38, "a number in (0, 3.4e38] (float32's range)"
)


#: The most ranks a launcher here starts on one machine (``spardl demo``, the bench drivers):
#: far more than it has cores for.
MAX_RANKS = 1024

# Output paths. Checked before any work, and without creating or changing anything: under
# mpiexec every rank parses the same options at once.


def _writable_dir(d: Path, text: str) -> None:
    if not d.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: {d} is not a directory")
    try:  # a nameless (or uniquely named) file, gone on close: every rank may probe at once
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(
            f"cannot write {text}: cannot create a file in {d} ({e.strerror or e})"
        ) from None


def _nearest_existing(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _nonempty(text: str) -> None:
    if not text.strip():  # Path("") is ".": the current folder, never what was meant
        raise argparse.ArgumentTypeError("must be a path, got an empty string")


def _file(text: str, parents: bool) -> str:
    _nonempty(text)
    p = Path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"must be a file name, got the directory {text}")
    if p.exists():
        try:  # opened for appending, nothing written
            with open(p, "ab"):
                pass
        except OSError as e:
            raise argparse.ArgumentTypeError(f"cannot write {text}: {e.strerror or e}") from None
        return text
    parent = p.parent
    if not parent.exists() and not parents:
        raise argparse.ArgumentTypeError(
            f"cannot write {text}: the directory {parent} does not exist"
        )
    _writable_dir(_nearest_existing(parent), text)
    return text


def output_file(text: str) -> str:
    """argparse ``type=``: a file path the program can create or overwrite (its directory must
    exist), checked before any work; kept as text."""
    return _file(text, parents=False)


def output_file_parents(text: str) -> str:
    """As :func:`output_file`, for a program that creates the missing directories itself."""
    return _file(text, parents=True)


def path(text: str) -> Path:
    """argparse ``type=``: any path but an empty string (``Path("")`` is the current folder,
    never what was meant), as a Path; what the program does with it is checked where it
    knows (``spardl train`` checks its paths collectively, on every rank)."""
    _nonempty(text)
    return Path(text)


def output_dir(text: str) -> Path:
    """argparse ``type=``: a directory the program writes into (created with its parents where
    missing), checked before any work; as a Path."""
    _nonempty(text)
    p = Path(text)
    _writable_dir(p if p.exists() else _nearest_existing(p.parent), text)
    return p


def plot_file(text: str) -> str:
    """:func:`output_file` whose suffix is a format matplotlib writes (png, pdf, svg, ...)."""
    from matplotlib.backend_bases import FigureCanvasBase

    output_file(text)
    formats = FigureCanvasBase.get_supported_filetypes()
    if Path(text).suffix.lstrip(".").lower() not in formats:
        raise argparse.ArgumentTypeError(
            f"must end in one of {', '.join('.' + f for f in sorted(formats))}, got {text}"
        )
    return text


output_file.__name__ = output_file_parents.__name__ = "path"
output_dir.__name__ = plot_file.__name__ = "path"


def launcher_rank() -> int | None:
    """This process's rank as the MPI launcher set it in the environment (MPICH/Hydra, Open MPI,
    PMIx, Slurm), without initialising MPI; None when not launched by one."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        v = os.environ.get(var)
        if v is not None and v.strip().isdigit():
            return int(v)
    return None


class Parser(argparse.ArgumentParser):
    """argparse, but under an MPI launcher a usage error is one line, printed by rank 0 only
    (every rank still exits with status 2 before MPI is used).

    And an argument that starts with ``-`` and a digit (``-1mbit``, ``-1e3``, ``-.5``) is a
    value, for the option's type to judge: argparse before Python 3.13 takes it for an option
    unless it is a plain negative number, so ``--bandwidth -1mbit`` was "expected one argument"
    instead of the option's own message ("rate must be positive"). The rule is the one later
    versions of argparse apply; like theirs, it holds while no option of the parser looks like
    a negative number, and none of ours does. Subparsers are of this class too (argparse makes
    them of the parent parser's class).
    """

    # argparse's __init__ assigns its own rule to this attribute; the property keeps this one.
    @property
    def _negative_number_matcher(self):
        return _NEGATIVE_NUMBER

    @_negative_number_matcher.setter
    def _negative_number_matcher(self, value):
        pass

    def error(self, message):
        rank = launcher_rank()
        if rank is None:
            super().error(message)
        self.exit(2, f"{self.prog}: error: {message}\n" if rank == 0 else None)


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def run_collective(fn, *args, prog: str = "spardl") -> int:
    """Run ``fn(*args, world)`` on every rank; an exception on any rank ends the whole job.

    Under ``mpiexec`` a rank that raises would leave the others blocked in their next collective,
    so the failing rank prints its traceback and aborts the MPI job (every rank exits non-zero
    within seconds; :func:`spardl.abort_on_exception`). A :class:`UsageError` (raised by every
    rank alike, before any communication) is printed once by rank 0 and gives status 2. A
    :class:`spardl.NonFiniteError` (a reduced gradient with NaN or Inf: every rank raises it at
    the same step, so nothing waits) is printed once by rank 0 and gives status 1, without a
    traceback or an abort. A rank interrupted (Ctrl-C: mpiexec passes SIGINT to every rank)
    says so in one line, without a traceback, and ends the job with status 130, as a shell
    does for an interrupted command.
    """
    from ..algorithms.base import NonFiniteError
    from ..comm import _mpi_abort, abort_on_exception

    world = _world()
    try:
        with abort_on_exception(world, reraise=(UsageError, NonFiniteError, KeyboardInterrupt)):
            fn(*args, world)
    except KeyboardInterrupt:  # the others may be waiting for this rank: the job ends
        print(
            f"{prog}: interrupted on rank {world.Get_rank()}; ending every rank",
            file=sys.stderr,
            flush=True,
        )
        _mpi_abort(world, 130)
    except UsageError as e:  # raised by every rank before any communication: no abort needed
        if world.Get_rank() == 0:
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except NonFiniteError as e:  # raised by every rank at the same step
        if world.Get_rank() == 0:
            print(f"{prog}: error: the training diverged: {e}", file=sys.stderr, flush=True)
        return 1
    return 0
