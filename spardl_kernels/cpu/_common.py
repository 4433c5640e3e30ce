"""Helpers shared by the CPU kernel modules: array coercion and the |x| key mapping."""

import numpy as np

from .. import _validate

# Compiled workers: cached on disk (first call compiles once per signature) and free of the
# GIL, so callers can run kernels from several threads.
JIT = {"cache": True, "nogil": True}

# dtype name -> (signed integer view of the same width, mask clearing the sign bit, key of +inf).
# Key of |x| = (bits & mask), every NaN clamped to inf_key + 1: positive IEEE floats order
# like their bit patterns, so keys order like |x| with NaN above +inf and -0.0 == 0.0.
KEY_INFO = {
    "float16": (np.dtype(np.int16), 0x7FFF, 0x7C00),
    "float32": (np.dtype(np.int32), 0x7FFFFFFF, 0x7F800000),
    "float64": (np.dtype(np.int64), 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
}


def as_array(x):
    """View ``x`` as a NumPy array without copying where NumPy can (CPU torch tensors too)."""
    if isinstance(x, np.ndarray):
        return x
    return np.asarray(x)


def as_values(name, x):
    """Coerce and check a value array (1-D, float16/32/64)."""
    a = as_array(x)
    _validate.check_values(name, a.ndim, a.dtype)
    return a


def as_indices(name, x):
    """Coerce and check an index array (1-D, int32/int64).

    An empty array of any numeric dtype (e.g. ``np.array([])``, float64) is taken as empty int64.
    """
    a = as_array(x)
    if a.ndim == 1 and a.shape[0] == 0 and a.dtype not in _validate.INDEX_DTYPES:
        a = np.empty(0, np.int64)
    _validate.check_indices(name, a.ndim, a.dtype)
    return a


def key_view(x):
    """(signed-int view of x's bits, mask, inf_key, nan_key) for a checked value array."""
    view_dtype, mask, inf_key = KEY_INFO[x.dtype.name]
    return x.view(view_dtype), mask, inf_key, inf_key + 1
