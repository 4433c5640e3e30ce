"""The result of a sparse allreduce: a sparse vector identical on every rank."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class SparseResult:
    """A sparse vector of length ``n``, the output of every allreducer.

    Attributes
    ----------
    indices : ndarray of shape (nnz,), int64
        Positions of the entries, strictly ascending, each in ``[0, n)``.
    values : ndarray of shape (nnz,), the gradient's dtype
        The reduced values (sum or mean over the ranks, by the allreducer's ``op``).
    n : int
        Length of the dense vector.

    Notes
    -----
    Every rank of the communicator holds bit-identical ``indices`` and ``values`` after a call.
    """

    indices: np.ndarray
    values: np.ndarray
    n: int

    @property
    def nnz(self) -> int:
        """Number of stored entries."""
        return int(self.indices.shape[0])

    @property
    def dtype(self) -> np.dtype:
        """The value dtype."""
        return self.values.dtype

    def to_dense(self, out: np.ndarray | None = None) -> np.ndarray:
        """Scatter into a dense vector.

        Parameters
        ----------
        out : ndarray of shape (n,), optional
            Written in full (zeros outside ``indices``). A new array of the value dtype if omitted.

        Returns
        -------
        ndarray of shape (n,)
            The dense vector.

        Raises
        ------
        ValueError
            If ``out`` does not have shape (n,).
        """
        if out is None:
            out = np.zeros(self.n, dtype=self.values.dtype)
        else:
            if getattr(out, "shape", None) != (self.n,):
                got = getattr(out, "shape", None)
                raise ValueError(f"out must have shape ({self.n},), got {got}")
            out[...] = 0
        out[self.indices] = self.values
        return out

    def __repr__(self) -> str:
        return f"SparseResult(n={self.n}, nnz={self.nnz}, dtype={self.values.dtype})"
