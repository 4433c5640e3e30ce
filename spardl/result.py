"""The result of a sparse allreduce: a sparse vector identical on every rank."""

from __future__ import annotations

import numpy as np

from ._checks import check_int_at_least, type_name
from .dtypes import VALUE_DTYPES

__all__ = ["SparseResult"]


class SparseResult:
    """A sparse vector of length ``n``, the output of every allreducer.

    Parameters
    ----------
    indices : array_like of shape (nnz,), integer dtype
        Strictly ascending positions in ``[0, n)`` (kept as int64). An empty list or tuple
        (whose NumPy dtype would be float64) is taken as int64.
    values : array_like of shape (nnz,), floating dtype
        The value at each position.
    n : int
        Length of the dense vector, ≥ 0.

    :meth:`from_dense` builds the dense form. Device arrays (``__cuda_array_interface__``)
    are taken as they are: their shapes and dtypes are checked, not their contents.

    Raises
    ------
    TypeError
        If ``n`` is not an integer, ``indices`` not of an integer dtype or ``values`` not of a
        floating one.
    ValueError
        If ``n`` is negative or above 2**63 (the indices are int64), ``indices`` or ``values``
        not 1-D or not of one length, or ``indices`` not strictly ascending in ``[0, n)``.

    Attributes
    ----------
    indices : ndarray of shape (nnz,), int64
        Positions of the entries, strictly ascending, each in ``[0, n)``. Entries whose reduced
        value is exactly ±0 are not listed (NaN is).
    values : ndarray of shape (nnz,), the gradient's dtype
        The reduced values (sum or mean over the ranks, by the allreducer's ``op``).
    n : int
        Length of the dense vector.

    Notes
    -----
    Every rank of the communicator holds bit-identical ``indices`` and ``values`` after a call.

    Two forms, one meaning. The sparse allreducers return the sparse form: ``indices`` and
    ``values`` are what they computed. The dense allreduce returns the *dense form*
    (:attr:`is_dense`): it holds the reduced vector itself and makes ``indices`` and ``values``
    only when first read, by one pass over the vector that lists its entries other than ±0,
    exactly as the sparse form would (the same promise: no explicit zeros; ``nnz`` is their
    count, so reading it costs that pass too). :meth:`to_dense` of the dense form is a copy of
    the vector; it never needs the indices. Code that wants the vector should call
    :meth:`to_dense`, which is O(n) for both forms; code that reads ``indices`` gets the same
    arrays from either form of the same vector.

    For GPU gradients (``__cuda_array_interface__``) ``indices`` and ``values`` are Numba device
    arrays (wrap them zero-copy with ``torch.as_tensor(a, device="cuda")`` or
    ``cupy.asarray(a)``), bit-identical to the host result for the same data, and
    :meth:`to_dense` scatters (or, for the dense form, copies) on the device.

    A result is read-only: its attributes cannot be reassigned. Its arrays are not copied
    on access: writing into ``indices`` or ``values`` changes what the result holds (and, for
    a sparse result, what :meth:`to_dense` returns); copy them to change them.
    """

    __slots__ = ("n", "_indices", "_values", "_dense")

    def __init__(self, indices, values, n: int):
        from . import _arrays as A

        n = check_int_at_least("n", n, 0)
        if n > 2**63:  # the indices are int64: a position past 2**63 - 1 would wrap
            raise ValueError(f"n must be at most 2**63 (indices are int64), got {n}")
        device = A.is_device(indices) or A.is_device(values)
        if not device:
            listed = isinstance(indices, (list, tuple))
            indices, values = np.asarray(indices), np.asarray(values)
            if listed and indices.shape == (0,):  # [] has no dtype of its own
                indices = indices.astype(np.int64)
            if indices.dtype == object or values.dtype == object:
                raise TypeError("indices and values must be arrays of numbers")
        for name, a in (("indices", indices), ("values", values)):
            if len(a.shape) != 1:
                raise ValueError(f"{name} must be 1-D, got shape {tuple(a.shape)}")
        if indices.shape != values.shape:
            raise ValueError(
                f"indices and values must have one length, got {indices.shape[0]} and "
                f"{values.shape[0]}"
            )
        if np.dtype(indices.dtype).kind not in "iu":
            raise TypeError(f"indices must have an integer dtype, got {np.dtype(indices.dtype)}")
        if np.dtype(values.dtype).kind != "f":
            raise TypeError(f"values must have a floating dtype, got {np.dtype(values.dtype)}")
        if not device:
            if indices.size and (
                indices[0] < 0 or indices[-1] >= n or not np.all(indices[1:] > indices[:-1])
            ):
                raise ValueError(f"indices must be strictly ascending in [0, {n}), n = {n}")
            indices = indices.astype(np.int64, copy=False)
        self._set(indices, values, n)

    def _set(self, indices, values, n: int) -> None:
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "_indices", indices)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_dense", None)

    @classmethod
    def _of(cls, indices, values, n: int) -> SparseResult:
        """The sparse form of an allreducer's own output, taken as it is (no checks: its indices
        are int64, ascending and in range by construction)."""
        out = cls.__new__(cls)
        out._set(indices, values, n)
        return out

    @classmethod
    def from_dense(cls, vector) -> SparseResult:
        """The dense form of the vector ``vector`` (taken over, not copied: the caller must not
        write to it afterwards).

        Parameters
        ----------
        vector : ndarray of shape (n,), or a Numba device array
            The reduced vector, in the gradient's dtype.

        Returns
        -------
        SparseResult
            ``n = len(vector)``; :attr:`indices` and :attr:`values` are made on first read.

        Raises
        ------
        TypeError
            If ``vector`` is not a NumPy or device array (a list, say) or not of a floating
            dtype.
        ValueError
            If ``vector`` is not 1-D.
        """
        from . import _arrays as A

        if not (isinstance(vector, np.ndarray) or A.is_device(vector)):
            raise TypeError(
                f"vector must be a NumPy array or a device array, got {type_name(vector)}"
            )
        if len(vector.shape) != 1:
            raise ValueError(f"vector must be 1-D, got shape {tuple(vector.shape)}")
        if np.dtype(vector.dtype).kind != "f":
            raise TypeError(f"vector must have a floating dtype, got {np.dtype(vector.dtype)}")
        out = cls._of(None, None, int(vector.shape[0]))
        object.__setattr__(out, "_dense", vector)
        return out

    def __setattr__(self, name, value):
        raise AttributeError(f"SparseResult is read-only (cannot set {name!r})")

    @property
    def is_dense(self) -> bool:
        """Whether this result holds the dense vector (the dense allreduce's result)."""
        return self._dense is not None

    def _split(self) -> None:
        """Make ``indices`` and ``values`` of the dense form: its entries other than ±0."""
        import spardl_kernels as K

        v = self._dense
        if isinstance(v, np.ndarray) and v.dtype not in VALUE_DTYPES:
            # a dtype the kernels do not take (big-endian, longdouble): the same entries
            keep = np.flatnonzero((v != 0) | np.isnan(v)).astype(np.int64)
            object.__setattr__(self, "_indices", keep)
            object.__setattr__(self, "_values", v[keep])
            return
        tiny = float(np.nextafter(v.dtype.type(0), v.dtype.type(1)))
        keep, kept = K.select_above(v, tiny)  # |v| >= smallest subnormal  <=>  v != 0 or NaN
        object.__setattr__(self, "_indices", keep)
        object.__setattr__(self, "_values", kept)

    @property
    def indices(self) -> np.ndarray:
        """Positions of the entries other than ±0, ascending, int64 (see the class notes)."""
        if self._indices is None:
            self._split()
        return self._indices

    @property
    def values(self) -> np.ndarray:
        """The reduced values at :attr:`indices`, in the gradient's dtype."""
        if self._values is None:
            self._split()
        return self._values

    @property
    def nnz(self) -> int:
        """Number of stored entries (for the dense form: one pass over the vector, once)."""
        return int(self.indices.shape[0])

    @property
    def dtype(self) -> np.dtype:
        """The value dtype."""
        return np.dtype((self._values if self._dense is None else self._dense).dtype)

    def to_dense(self, out: np.ndarray | None = None) -> np.ndarray:
        """Scatter into a dense vector (the dense form: copy its vector).

        Parameters
        ----------
        out : ndarray of shape (n,), optional
            Written in full (zeros outside ``indices``). A new array of the value dtype if
            omitted, on the device when the result is on the device (then ``out``, if given,
            must be a device array too). Its dtype must be the result's :attr:`dtype` (no
            silent cast: cast the returned array yourself if another dtype is wanted).

        Returns
        -------
        ndarray of shape (n,)
            The dense vector (a Numba device array for a device result). Never the result's own
            storage: writing to it leaves the result unchanged.

        Raises
        ------
        ValueError
            If ``out`` does not have shape (n,) or is read-only.
        TypeError
            If ``out`` is not an array (a list, say), is a host array for a device result or the
            other way round, or its dtype is not the result's dtype.
        """
        from . import _arrays as A

        src = self._dense
        device = A.is_device(self._values if src is None else src)
        if out is not None:
            if not (isinstance(out, np.ndarray) or A.is_device(out)):
                raise TypeError(
                    f"out must be a NumPy array (a device array for a device result), got "
                    f"{type(out).__name__}"
                )
            if isinstance(out, np.ndarray) and not out.flags.writeable:
                raise ValueError("out is read-only")
            if tuple(getattr(out, "shape", ()) or ()) != (self.n,):
                got = getattr(out, "shape", None)
                raise ValueError(f"out must have shape ({self.n},), got {got}")
            if A.is_device(out) != device:
                raise TypeError("out must be a device array for a device result, a host array else")
            got = np.dtype(getattr(out, "dtype", None))
            if got != self.dtype:
                raise TypeError(f"out has dtype {got}, the result has dtype {self.dtype}")
        if src is not None:
            if out is None:
                return A.copy(src)
            if device:
                A.device_ops().copy_into(A.view(out), src)
            else:
                np.copyto(out, src, casting="unsafe")
            return out
        if out is None:
            return A.set_at(A.zeros(self.n, self.values.dtype, device), self.indices, self.values)
        if device:
            dev = A.view(out)
            A.device_ops().copy_into(dev, A.zeros(self.n, dev.dtype, True))
            A.set_at(dev, self.indices, self.values)
            return out
        out[...] = 0
        out[self.indices] = self.values
        return out

    def __repr__(self) -> str:
        if self._dense is not None:
            return f"SparseResult(n={self.n}, dense form, dtype={self.dtype})"
        return f"SparseResult(n={self.n}, nnz={self.nnz}, dtype={self.dtype})"
