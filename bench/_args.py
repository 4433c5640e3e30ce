"""What the bench scripts' command lines share: spardl.cli.common's range-checked option types
and output paths, its ``Parser`` (a usage error is one line, printed by rank 0 only under
``mpiexec``, status 2 on every rank), and the few types it lacks (non-negative seconds, lists).

spardl.cli.common is loaded from this checkout's file without importing ``spardl``: importing
the package initialises MPI, which the drivers that spawn ``mpiexec`` jobs (validate_model.py)
must not do, and which the single-process scripts (kernels.py, gpu.py) do not need. Only its
module-level part is used (argparse, os, math, tempfile, pathlib; no relative imports).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
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
output_file = _common.output_file
output_file_parents = _common.output_file_parents
output_dir = _common.output_dir
plot_file = _common.plot_file

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
