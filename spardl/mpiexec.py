"""Where ``mpiexec`` is: the one beside this Python (the ``mpich`` wheel in a venv), else PATH."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

__all__ = ["mpiexec_path"]


def mpiexec_path() -> str:
    """The ``mpiexec`` beside this Python (the ``mpich`` wheel in a venv), else on PATH.

    Returns
    -------
    str
        An absolute path.

    Raises
    ------
    FileNotFoundError
        If there is none.
    """
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError("no mpiexec beside this Python or on PATH (pip install mpich)")
    return found
