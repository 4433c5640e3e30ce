"""spardl: sparse gradient allreduce over MPI (SparDL, Ok-Topk and the published peers).

>>> import spardl
>>> ar = spardl.make("spardl", comm, n, density=0.01)      # doctest: +SKIP
>>> out = ar(grad)                                           # doctest: +SKIP
"""

from __future__ import annotations

from .algorithms import Allreducer, NonFiniteError
from .algorithms.auto import Auto
from .algorithms.base import collective_check
from .algorithms.dense import Dense
from .algorithms.gaussiank import Gaussiank
from .algorithms.gtopk import GTopk
from .algorithms.oktopk import OkTopk
from .algorithms.spardl import SparDL
from .algorithms.topka import TopkA
from .algorithms.topkdsa import TopkDSA
from .comm import Comm, abort_on_exception, name_hash
from .result import SparseResult

__version__ = "0.1.0"

#: Algorithm name -> class. Every class takes (comm, n, **options); see :func:`make`.
ALGORITHMS: dict[str, type[Allreducer]] = {
    "dense": Dense,
    "topka": TopkA,
    "gaussiank": Gaussiank,
    "topkdsa": TopkDSA,
    "gtopk": GTopk,
    "spardl": SparDL,
    "oktopk": OkTopk,
}


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
    "Allreducer",
    "Comm",
    "abort_on_exception",
    "NonFiniteError",
    "SparseResult",
    "make",
    "__version__",
]
