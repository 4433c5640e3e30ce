"""The result of a sparse allreduce: a sparse vector identical on every rank."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SparseResult"]


@dataclass(frozen=True, eq=False)
class SparseResult:
    """A sparse vector of length ``n``, the output of every allreducer.

    Attributes
    ----------
    indices : ndarray of shape (nnz,), int64
        Positions of the entries, strictly ascending, each in ``[0, n)``. Entries whose reduced
        value is exactly ±0 are not listed.
    values : ndarray of shape (nnz,), the gradient's dtype
        The reduced values (sum or mean over the ranks, by the allreducer's ``op``).
    n : int
        Length of the dense vector.

    Notes
    -----
    Every rank of the communicator holds bit-identical ``indices`` and ``values`` after a call.

    For GPU gradients (``__cuda_array_interface__``) ``indices`` and ``values`` are Numba device
    arrays (wrap them zero-copy with ``torch.as_tensor(a, device="cuda")`` or
    ``cupy.asarray(a)``), bit-identical to the host result for the same data, and
    :meth:`to_dense` scatters on the device.
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
            Written in full (zeros outside ``indices``). A new array of the value dtype if
            omitted, on the device when the result is on the device (then ``out``, if given,
            must be a device array too).

        Returns
        -------
        ndarray of shape (n,)
            The dense vector (a Numba device array for a device result).

        Raises
        ------
        ValueError
            If ``out`` does not have shape (n,).
        TypeError
            If ``out`` is a host array for a device result, or the other way round.
        """
        from . import _arrays as A

        device = A.is_device(self.values)
        if out is None:
            return A.set_at(A.zeros(self.n, self.values.dtype, device), self.indices, self.values)
        if tuple(getattr(out, "shape", ()) or ()) != (self.n,):
            got = getattr(out, "shape", None)
            raise ValueError(f"out must have shape ({self.n},), got {got}")
        if A.is_device(out) != device:
            raise TypeError("out must be a device array for a device result, a host array else")
        if device:
            dev = A.view(out)
            A.device_ops().copy_into(dev, A.zeros(self.n, dev.dtype, True))
            A.set_at(dev, self.indices, self.values)
            return out
        out[...] = 0
        out[self.indices] = self.values
        return out

    def __repr__(self) -> str:
        return f"SparseResult(n={self.n}, nnz={self.nnz}, dtype={self.values.dtype})"
