"""spardl: sparse gradient allreduce over MPI (SparDL, Ok-Topk and the published peers).

>>> import spardl
>>> ar = spardl.make("spardl", comm, n, density=0.01)      # doctest: +SKIP
>>> out = ar(grad)                                           # doctest: +SKIP

``import spardl`` is light: the algorithms, :class:`~spardl.comm.Comm` and
:class:`SparseResult` (and with them ``mpi4py.MPI``, whose import initialises MPI in the
process) are imported on first use of one of their names (PEP 562), so the command line, the
emulated-cluster launcher (:mod:`spardl.cluster`) and ``spardl --help`` run without MPI.
``from spardl import make, Comm`` and ``spardl.ALGORITHMS`` work as with eager imports.
"""

from __future__ import annotations

import importlib
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .algorithms import Allreducer

__version__ = "0.1.0"

#: The keys of :data:`ALGORITHMS`, in its order, known without importing the algorithms (and
#: MPI with them): what a command line offers as choices.
ALGORITHM_NAMES: tuple[str, ...] = (
    "dense",
    "topka",
    "gaussiank",
    "topkdsa",
    "gtopk",
    "spardl",
    "oktopk",
)

#: The names imported on first use (:func:`_load`), mpi4py.MPI with them, and the submodule of
#: each: the public ones, the algorithm classes, ``collective_check`` and ``name_hash``. With
#: them ``ALGORITHMS``, algorithm name -> class (:data:`_CLASSES`); every class takes
#: (comm, n, **options), see :func:`make`.
_FROM = {
    "Allreducer": "algorithms",
    "NonFiniteError": "algorithms",
    "Auto": "algorithms.auto",
    "collective_check": "algorithms.base",
    "Dense": "algorithms.dense",
    "Gaussiank": "algorithms.gaussiank",
    "GTopk": "algorithms.gtopk",
    "OkTopk": "algorithms.oktopk",
    "SparDL": "algorithms.spardl",
    "TopkA": "algorithms.topka",
    "TopkDSA": "algorithms.topkdsa",
    "Comm": "comm",
    "abort_on_exception": "comm",
    "name_hash": "comm",
    "SparseResult": "result",
}
#: The classes of ``ALGORITHMS``, in the order of :data:`ALGORITHM_NAMES`.
_CLASSES = ("Dense", "TopkA", "Gaussiank", "TopkDSA", "GTopk", "SparDL", "OkTopk")
_DEFERRED = frozenset({*_FROM, "ALGORITHMS"})
#: Submodules that ``spardl.<name>`` reaches without an import of its own: each is imported on
#: first use, alone.
_DEFERRED_MODULES = frozenset(
    {
        "_arrays",
        "_checks",
        "algorithms",
        "comm",
        "cost_model",
        "dtypes",
        "result",
        "schedules",
        "selection",
    }
)
# Two threads that ask for a deferred name at once: the second waits, then finds it bound.
# Reentrant: a module imported by _load that asked for such a name at import would fail as a
# circular import (an ImportError), not wait for itself.
_lock = threading.RLock()
_loaded = False  # whether _load has bound the names of _DEFERRED


def _load() -> None:
    """Import the algorithms, Comm and SparseResult (mpi4py.MPI with them) and bind their
    names in this module, once."""
    global _loaded
    with _lock:
        if _loaded:
            return
        names = {
            name: getattr(importlib.import_module(f"{__name__}.{module}"), name)
            for name, module in _FROM.items()
        }
        names["ALGORITHMS"] = {names[c].name: names[c] for c in _CLASSES}
        for name, value in names.items():  # a name the program set itself stays as it set it
            globals().setdefault(name, value)
        _loaded = True


def __getattr__(name: str):
    """The names of :data:`_DEFERRED` and the submodules of :data:`_DEFERRED_MODULES`,
    imported on first use (PEP 562)."""
    if name in _DEFERRED:
        _load()
        if name in globals():
            return globals()[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (deleted)")
    if name in _DEFERRED_MODULES:
        # Also how a submodule's own ``from .. import _arrays`` reaches a sibling not yet
        # imported, in the middle of an import of the package: only that module is imported.
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names, with those imported on first use."""
    return sorted(set(globals()) | _DEFERRED | _DEFERRED_MODULES)


def make(algorithm: str, comm, n: int, **options) -> Allreducer:
    """Create an allreducer: collective over ``comm`` (every rank calls it with the same arguments).

    Parameters
    ----------
    algorithm : str
        A key of :data:`ALGORITHMS`: "spardl", "oktopk", "topka", "topkdsa", "gtopk",
        "gaussiank" or "dense"; or "auto" (:class:`~spardl.algorithms.auto.Auto`: the candidate
        predicted fastest, re-chosen as it runs; not a key of :data:`ALGORITHMS`, whose entries
        are the algorithms themselves).
    comm : mpi4py.MPI.Intracomm or spardl.comm.Comm
        The communicator (an mpi4py one is duplicated inside; a spardl Comm is shared).
        P = its size.
    n : int
        Gradient length.
    **options
        ``density``, ``op``, ``residual``, ``nonfinite``, ``check``, ``wire`` and the
        algorithm's own options (e.g. ``teams`` for SparDL, ``wire_dtype`` for dense); see each
        class.

    Returns
    -------
    Allreducer
        Call it on this rank's gradient to get a :class:`SparseResult`. It holds MPI
        communicators until :meth:`~spardl.algorithms.base.Allreducer.close` (or the end of a
        ``with`` block): close allreducers that a program builds repeatedly.

    Raises
    ------
    ValueError, TypeError
        On every rank, if the algorithm is unknown, an argument is invalid on any rank, or the
        ranks disagree (different n, density, algorithm or options).
    """
    from . import ALGORITHMS
    from .algorithms.auto import Auto
    from .algorithms.base import collective_check
    from .comm import Comm, name_hash

    cls = ALGORITHMS.get(algorithm) if isinstance(algorithm, str) else None
    if algorithm == "auto":
        cls = Auto
    if cls is not None:
        return cls(comm, n, **options)
    c = comm if isinstance(comm, Comm) else Comm(comm)
    if isinstance(algorithm, str):
        err = ValueError(
            f"algorithm must be one of {sorted(ALGORITHMS)} or 'auto', got {algorithm!r}"
        )
    else:
        err = TypeError(f"algorithm must be a string, got {type(algorithm).__name__}")
    # Same collective sequence as a constructor, so ranks that did name a known algorithm
    # fail with this rank instead of waiting for it.
    try:
        collective_check(c, err, [name_hash(repr(algorithm))], {"algorithm": repr(algorithm)})
    finally:
        if c is not comm:
            c.free()
    raise err  # pragma: no cover - collective_check raised


__all__ = [
    "ALGORITHMS",
    "ALGORITHM_NAMES",
    "Allreducer",
    "Comm",
    "abort_on_exception",
    "NonFiniteError",
    "SparseResult",
    "make",
    "__version__",
]
