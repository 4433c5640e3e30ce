"""Regenerate docs/api.md from the docstrings:
``NUMBA_ENABLE_CUDASIM=1 python docs/make_api.py > docs/api.md`` (the simulator lets
``spardl_kernels.cuda.arrays`` import on a machine without a GPU).

Every public name (``__all__``) of both packages, with its signature and the first line of its
docstring. Importing ``spardl.torch`` needs torch; the CUDA kernels need nothing at import.
"""

from __future__ import annotations

import importlib
import inspect

MODULES = [
    "spardl_kernels",
    "spardl_kernels.cpu.wire",
    "spardl_kernels.cpu.arrays",
    "spardl_kernels.cuda.arrays",
    "spardl",
    "spardl.comm",
    "spardl.dtypes",
    "spardl.algorithms.base",
    "spardl.algorithms.auto",
    "spardl.result",
    "spardl.selection",
    "spardl.schedules",
    "spardl.cost_model",
    "spardl.trace",
    "spardl.pingpong",
    "spardl.torch",
    "spardl.elastic",
    "spardl.cli",
    "spardl.cli.common",
    "spardl.cli.model",
    "spardl.cluster",
    "spardl.lm",
]


def _first_line(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.strip().split("\n\n")[0].replace("\n", " ")


def _sig(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""


def main() -> None:
    print("# API reference\n")
    print(
        "Generated from the docstrings by "
        "`NUMBA_ENABLE_CUDASIM=1 python docs/make_api.py > docs/api.md`; every public name "
        "(`__all__`) with its signature and one-line summary. The docstrings hold the shapes, "
        "dtypes, errors and sources.\n"
    )
    for modname in MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError as e:  # pragma: no cover - torch missing
            print(f"## `{modname}`\n\n(not importable here: {e})\n")
            continue
        print(f"## `{modname}`\n\n{_first_line(mod)}\n")
        print("| name | signature | summary |\n|---|---|---|")
        for name in getattr(mod, "__all__", []):
            obj = getattr(mod, name, None)
            if obj is None:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj) or callable(obj):
                sig = _sig(obj) if not inspect.isclass(obj) else _sig(obj.__init__)
                if inspect.isclass(obj):
                    sig = sig.replace("(self, ", "(").replace("(self)", "()")
                summary = _first_line(obj)
            else:
                sig, summary = "", f"{type(obj).__name__}"
                if isinstance(obj, dict):
                    summary += ": " + ", ".join(map(str, list(obj)[:8]))
                elif isinstance(obj, str):
                    summary += f" = {obj!r}"
            sig = sig.replace("|", "\\|")
            summary = summary.replace("|", "\\|")
            print(f"| `{name}` | `{sig}` | {summary} |" if sig else f"| `{name}` | | {summary} |")
        print()


if __name__ == "__main__":
    main()
