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
LEARNING_RATE = _common.LEARNING_RATE
output_file = _common.output_file
output_file_parents = _common.output_file_parents
output_dir = _common.output_dir
plot_file = _common.plot_file

# Missing from spardl.cli.common: seconds of a pause or delay (0 allowed).
NONNEGATIVE_FLOAT = option_type(
    float, lambda v: v >= 0 and math.isfinite(v), "a finite number >= 0"
)

#: The longest gradient (or vector) a bench script builds: MPI's counts are C ints, and a larger
#: length ends in NumPy ("Maximum allowed dimension exceeded", a MemoryError on every rank).
MAX_ELEMENTS = 2**31 - 1
#: A length in elements, 1 to :data:`MAX_ELEMENTS`.
ELEMENTS = option_type(
    int, lambda v: 1 <= v <= MAX_ELEMENTS, "an integer in [1, 2**31 - 1] (elements)"
)
MAX_RANKS = _common.MAX_RANKS

# Student-t (nu = 3) density 6*sqrt(3) / (pi * (3 + t**2)**2) <= 6*sqrt(3) / (pi * t**4), so
# P(|T| > x) <= 4*sqrt(3) / (pi * x**3) for every x > 0.
_T3_TAIL = 4 * math.sqrt(3) / math.pi
#: The chance, at most, that a synthetic gradient exceeds :func:`t3_bound`.
T3_MISS = 1e-6


def t3_bound(count: int) -> float:
    """A bound on the largest |t| of ``count`` Student-t (nu = 3) draws, exceeded with
    probability at most :data:`T3_MISS` (the union bound over the draws)."""
    return (_T3_TAIL * count / T3_MISS) ** (1 / 3)


def max_gradient_scale(dtype, n: int, P: int) -> float:
    """The largest ``--scale`` whose synthetic gradients (``standard_t(3, n) * scale`` on each of
    P ranks, cast to ``dtype``) stay finite, reduced too.

    Every value is below :func:`t3_bound` (n * P) times the scale; float32 and float64 gradients
    are summed in their own dtype (P values: P times that), float16 ones in float32 (only the
    cast to float16 bounds them: the sums are clamped to float16's range, never inf).
    """
    import numpy as np

    dtype = np.dtype(dtype)
    terms = 1 if dtype == np.float16 else P
    return float(np.finfo(dtype).max) / (t3_bound(n * P) * terms)


def check_gradient_scale(scale: float, dtype, n: int, P: int) -> str | None:
    """None, or the usage error of a ``--scale`` whose gradients would overflow ``dtype``."""
    top = max_gradient_scale(dtype, n, P)
    if scale <= top:
        return None
    return (
        f"argument --scale: must be at most {top:.3g} for {dtype} gradients of n = {n} on "
        f"P = {P} rank(s) (Student-t values up to {t3_bound(n * P):.0f} times the scale "
        f"would overflow {dtype}), got {scale:g}"
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
    "ELEMENTS",
    "MAX_ELEMENTS",
    "MAX_RANKS",
    "t3_bound",
    "max_gradient_scale",
    "check_gradient_scale",
    "nonempty_names",
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


def nonempty_names(text: str) -> list[str]:
    """The names of a comma-separated list (blanks dropped); an ArgumentTypeError when none."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise argparse.ArgumentTypeError(
            f"expected at least one comma-separated name, got {text!r}"
        )
    return names


nonempty_names.__name__ = "names"


def run_main(main, prog: str) -> int:
    """``main()``'s status, with SIGTERM and SIGHUP ending it as an exception does (its ``with``
    blocks and ``finally`` clauses run: temporary folders and emulated clusters are removed)
    and Ctrl-C as one line and status 130 instead of a traceback."""
    import signal
    import sys

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    try:
        return main()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return 130
