"""Helpers shared by the CPU kernel modules: array coercion, key views and threads."""

import contextlib

import numba
import numpy as np

from .. import _contract, _validate, config

# Compiled workers: cached on disk (first call compiles once per signature) and free of the
# GIL, so callers can run kernels from several threads.
JIT = {"cache": True, "nogil": True}
# The few multithreaded workers (numba.prange over contiguous parts). Each part writes only its
# own output range and the parts are joined in a fixed order, so results do not depend on the
# thread count. They are only called for large inputs with more than one thread allowed.
JIT_PARALLEL = {"cache": True, "nogil": True, "parallel": True}


def as_array(x, name="x"):
    """View ``x`` as a NumPy array without copying where NumPy can (CPU torch tensors too).

    Raises
    ------
    TypeError
        Naming ``name``, when NumPy cannot view ``x`` (e.g. a bfloat16 tensor, or a tensor that
        requires grad).
    """
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(
            f"{name} must be an array NumPy can view (float16/32/64 values or int32/int64 "
            f"indices; detach tensors that require grad), got {type(x).__name__}: {e}"
        ) from e


def as_values(name, x):
    """Coerce and check a value array (1-D, float16/32/64)."""
    a = as_array(x, name)
    _validate.check_values(name, a.ndim, a.dtype)
    return a


def as_indices(name, x):
    """Coerce and check an index array (1-D, int32/int64).

    An empty array of any numeric dtype (e.g. ``np.array([])``, float64) is taken as empty int64.
    """
    a = as_array(x, name)
    if a.ndim == 1 and a.shape[0] == 0 and a.dtype not in _validate.INDEX_DTYPES:
        a = np.empty(0, np.int64)
    _validate.check_indices(name, a.ndim, a.dtype)
    return a


def key_view(x):
    """(signed-int view of x's bits, mask, inf_key, nan_key) for a checked value array
    (``_contract.KEY_INFO``)."""
    view_dtype, mask, inf_key, nan_key = _contract.key_info(x.dtype)
    return x.view(view_dtype), mask, inf_key, nan_key


def cpu_threads(size, min_size):
    """Threads a parallel kernel may use on ``size`` elements (1 = take the serial path).

    ``config.CPU_THREADS`` (None: Numba's current ``numba.get_num_threads()``), capped by
    ``NUMBA_NUM_THREADS``; 1 when ``size < min_size``, so small inputs never wake the pool.
    """
    if size < min_size:
        return 1
    limit = numba.config.NUMBA_NUM_THREADS
    if limit <= 1:
        return 1
    wanted = config.CPU_THREADS
    if wanted is None:
        return numba.get_num_threads()
    return max(1, min(int(wanted), limit))


@contextlib.contextmanager
def numba_threads(threads):
    """Run a parallel worker on ``threads`` threads; the caller's own setting is restored."""
    saved = numba.get_num_threads()
    if saved == threads:
        yield
        return
    numba.set_num_threads(threads)
    try:
        yield
    finally:
        numba.set_num_threads(saved)


def part_bounds(n, parts):
    """parts + 1 int64 bounds of near-equal contiguous parts of [0, n), first n mod parts longer."""
    q, r = divmod(n, parts)
    s = np.arange(parts + 1, dtype=np.int64)
    return s * q + np.minimum(s, r)
