"""The dtypes of the allreducers' arithmetic, shared by the allreducers and the modules that
build or load their states (:mod:`spardl.elastic`)."""

from __future__ import annotations

import numpy as np

__all__ = ["VALUE_DTYPES", "work_dtype"]

#: The gradient dtypes the allreducers and the kernels take (native byte order).
VALUE_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def work_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype residuals and sums are kept in for gradients of dtype ``dtype``.

    Parameters
    ----------
    dtype : numpy dtype
        The gradient's dtype (float16, float32 or float64, native byte order), or anything
        :class:`numpy.dtype` reads as one (``np.float32``, ``"float32"``).

    Returns
    -------
    numpy dtype
        float32 for float16 (float16 sums overflow at 65504: accumulate in float32, round once
        at the end); ``dtype`` itself otherwise.

    Raises
    ------
    TypeError
        If ``dtype`` is not a dtype (None included: NumPy would read it as float64).
    ValueError
        If ``dtype`` is another dtype, or a string that names none.
    """
    if dtype is None:
        raise TypeError("dtype must be a NumPy dtype (float16, float32 or float64), got None")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        err = ValueError if isinstance(dtype, str) else TypeError
        raise err(
            f"dtype must be a NumPy dtype (float16, float32 or float64), got {dtype!r}"
        ) from None
    if dt not in VALUE_DTYPES:
        raise ValueError(f"dtype must be float16, float32 or float64, got {dt}")
    return np.dtype(np.float32) if dt == np.float16 else dt
