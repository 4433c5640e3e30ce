"""What the bench scripts' command lines share: spardl.cli.common's range-checked option types
and its ``Parser`` (a usage error is one line, printed by rank 0 only under ``mpiexec``, status
2 on every rank), and the few types it lacks (non-negative seconds, output paths).

spardl.cli.common is loaded from this checkout's file without importing ``spardl``: importing
the package initialises MPI, which the drivers that spawn ``mpiexec`` jobs (validate_model.py)
must not do, and which the single-process scripts (kernels.py, gpu.py) do not need. Only its
module-level part is used (argparse, os, math; no relative imports).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load_common():
    spec = importlib.util.spec_from_file_location(
        "_bench_spardl_cli_common", ROOT / "spardl" / "cli" / "common.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_common = _load_common()
option_type = _common.option_type
launcher_rank = _common.launcher_rank
Parser = _common.Parser
DENSITY = _common.DENSITY
POSITIVE_INT = _common.POSITIVE_INT
NONNEGATIVE_INT = _common.NONNEGATIVE_INT
SEED = _common.SEED
POSITIVE_FLOAT = _common.POSITIVE_FLOAT

# Missing from spardl.cli.common: seconds of a pause or delay (0 allowed).
NONNEGATIVE_FLOAT = option_type(
    float, lambda v: v >= 0 and math.isfinite(v), "a finite number >= 0"
)

__all__ = [
    "Parser",
    "option_type",
    "launcher_rank",
    "DENSITY",
    "POSITIVE_INT",
    "NONNEGATIVE_INT",
    "SEED",
    "POSITIVE_FLOAT",
    "NONNEGATIVE_FLOAT",
    "comma_list",
    "output_file",
    "output_file_parents",
    "output_dir",
    "plot_file",
]


def comma_list(item):
    """An argparse ``type=`` for a comma-separated list of ``item`` values (at least one)."""

    def parse(text):
        parts = [s.strip() for s in text.split(",") if s.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected comma-separated values, got {text!r}")
        return [item(s) for s in parts]  # item's ArgumentTypeError names the bad one

    parse.__name__ = f"comma-separated {item.__name__}"
    return parse


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


def _file(text: str, parents: bool) -> str:
    # Nothing is created or changed: under mpiexec every rank checks the same path at once.
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
    """argparse ``type=``: a file path the script can create or overwrite (its directory must
    exist), checked before any work; kept as text."""
    return _file(text, parents=False)


def output_file_parents(text: str) -> str:
    """As :func:`output_file`, for a script that creates the missing directories itself."""
    return _file(text, parents=True)


def output_dir(text: str) -> Path:
    """argparse ``type=``: a directory the script writes into (created with its parents where
    missing), checked before any work; as a Path."""
    p = Path(text)
    if p.exists():
        _writable_dir(p, text)
    else:
        _writable_dir(_nearest_existing(p.parent), text)
    return p


def plot_file(text: str) -> str:
    """:func:`output_file` whose suffix is a format matplotlib writes (as ``spardl model
    --plot`` checks it)."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if Path(text).suffix.lstrip(".").lower() not in formats:
        raise argparse.ArgumentTypeError(
            f"must end in one of {', '.join('.' + f for f in sorted(formats))}, got {text}"
        )
    return output_file(text)


output_file.__name__ = output_file_parents.__name__ = "path"
output_dir.__name__ = plot_file.__name__ = "path"
