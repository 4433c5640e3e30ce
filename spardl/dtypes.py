"""The dtypes of the allreducers' arithmetic, shared by the allreducers and the modules that
build or load their states (:mod:`spardl.elastic`)."""

from __future__ import annotations

import numpy as np

__all__ = ["work_dtype"]


def work_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype residuals and sums are kept in for gradients of dtype ``dtype``.

    Parameters
    ----------
    dtype : numpy dtype
        The gradient's dtype (float16, float32 or float64).

    Returns
    -------
    numpy dtype
        float32 for float16 (float16 sums overflow at 65504: accumulate in float32, round once
        at the end); ``dtype`` itself otherwise.
    """
    return np.dtype(np.float32) if dtype == np.float16 else dtype
