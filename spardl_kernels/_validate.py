"""Argument checks of the kernel contract (docs/design.md §3), shared by the CPU and CUDA kernels.

Every function here takes metadata (a name, an ``ndim``, a ``dtype``, a length, a Python
number), never array data, so the CUDA twins can call them on device arrays without copying.
Checks that need the data (sorted, unique, in range) are computed by each backend and reported
through :func:`require`. Every message starts with the argument's name.
"""

import math
import numbers
import operator

import numpy as np

VALUE_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
INT32_MAX = int(np.iinfo(np.int32).max)


def require(ok, name, message, exc=ValueError):
    """Raise ``exc(f"{name}: {message}")`` unless ``ok``.

    ``message`` may be a function of no arguments that returns it, called only on failure:
    formatting a dtype or a shape costs microseconds, and these checks run on every kernel
    call.
    """
    if not ok:
        raise exc(f"{name}: {message() if callable(message) else message}")


def check_ndim(name, ndim):
    """A kernel argument must be 1-D."""
    require(ndim == 1, name, lambda: f"expected a 1-D array, got ndim={ndim}")


def check_values(name, ndim, dtype):
    """A value array: 1-D, float16, float32 or float64 (native byte order)."""
    check_ndim(name, ndim)
    dtype = np.dtype(dtype)
    require(
        dtype in VALUE_DTYPES,
        name,
        lambda: f"dtype must be float16, float32 or float64, got {dtype}",
        TypeError,
    )


def check_indices(name, ndim, dtype):
    """An index array: 1-D, int32 or int64 (native byte order)."""
    check_ndim(name, ndim)
    dtype = np.dtype(dtype)
    require(
        dtype in INDEX_DTYPES, name, lambda: f"dtype must be int32 or int64, got {dtype}", TypeError
    )


def check_int(name, value):
    """A Python or NumPy integer (not bool, not float); returns it as ``int``."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an integer, got bool")
    try:
        # operator.index accepts int, NumPy integers and 0-d integer arrays, and rejects floats.
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__}") from None


def check_k(k, n):
    """``k`` is an integer with 0 <= k <= n; returns it as ``int``."""
    k = check_int("k", k)
    require(0 <= k <= n, "k", lambda: f"must satisfy 0 <= k <= n = {n}, got k={k}")
    return k


def check_k_positive(k, n):
    """``k`` is an integer with 1 <= k <= n (kth_largest_abs); returns it as ``int``."""
    k = check_int("k", k)
    require(1 <= k <= n, "k", lambda: f"must satisfy 1 <= k <= n = {n}, got k={k}")
    return k


def check_index_dtype(index_dtype, n):
    """``index_dtype`` is int32 or int64, and int32 only if every index below ``n`` fits.

    Returns the ``np.dtype``.
    """
    try:
        dt = np.dtype(index_dtype)
    except TypeError:
        raise TypeError(f"index_dtype: expected int32 or int64, got {index_dtype!r}") from None
    require(
        dt in INDEX_DTYPES, "index_dtype", lambda: f"expected int32 or int64, got {dt}", TypeError
    )
    if dt == np.int32:
        require(
            n - 1 <= INT32_MAX,
            "index_dtype",
            lambda: f"int32 cannot hold indices up to n - 1 = {n - 1}; use int64",
        )
    return dt


def check_threshold(threshold):
    """A real number (compared as float64); returns it as ``float``."""
    if isinstance(threshold, (bool, np.bool_)) or not isinstance(
        threshold, (numbers.Real, np.floating, np.integer)
    ):
        arr = np.asarray(threshold) if hasattr(threshold, "__array__") else None
        if arr is None or arr.ndim != 0 or arr.dtype.kind not in "iuf":
            raise TypeError(f"threshold: expected a real number, got {type(threshold).__name__}")
        threshold = arr[()]
    try:
        return float(threshold)
    except OverflowError:  # an integer beyond float64's range: above every finite value
        return math.inf if threshold > 0 else -math.inf


def check_n(n):
    """A vector length: an integer >= 0; returns it as ``int``."""
    n = check_int("n", n)
    require(n >= 0, "n", lambda: f"must be >= 0, got {n}")
    require(n <= np.iinfo(np.int64).max, "n", lambda: f"must fit in int64, got {n}")
    return n


#: The most ranks a communicator holds (MPI's ranks and sizes are C ints).
MAX_P = 2**31 - 1


def check_P(P):
    """A number of blocks (ranks): an integer in [1, :data:`MAX_P`] (what an MPI communicator
    can hold); returns it as ``int``."""
    P = check_int("P", P)
    require(P >= 1, "P", lambda: f"must be >= 1, got {P}")
    require(P <= MAX_P, "P", lambda: f"must be <= 2**31 - 1 (a number of ranks), got {P}")
    return P


def check_same_length(name, length, other_name, other_length):
    """Paired arrays (indices and values) have equal lengths."""
    require(
        length == other_length,
        name,
        lambda: f"length {length} does not match {other_name} (length {other_length})",
    )


def check_same_dtype(name, dtype, other_name, other_dtype):
    """Arrays that are added together share one value dtype."""
    require(
        np.dtype(dtype) == np.dtype(other_dtype),
        name,
        lambda: f"dtype {np.dtype(dtype)} does not match {other_name} ({np.dtype(other_dtype)})",
        TypeError,
    )


def check_sample_size(sample_size):
    """``sample_size`` is None or an integer >= 1; returns it (``int`` or None)."""
    if sample_size is None:
        return None
    s = check_int("sample_size", sample_size)
    require(s >= 1, "sample_size", lambda: f"must be >= 1, got {s}")
    return s


def check_seed(seed):
    """``seed`` is an integer; returns it reduced modulo 2**64."""
    return check_int("seed", seed) % (1 << 64)


def check_writeable(name, writeable):
    """An in-place target must be writeable."""
    require(writeable, name, "array is read-only; scatter_add writes into it")


def check_blocks(ks, bounds, n):
    """Per-block budgets and block boundaries of ``accumulate_topk`` (small host arrays).

    Returns (ks, bounds) as int64 NumPy arrays: bounds rise from 0 to n, and
    0 <= ks[b] <= bounds[b+1] - bounds[b] for each of the len(bounds) - 1 blocks.
    """
    bounds = np.asarray(bounds)
    ks = np.asarray(ks)
    require(
        bounds.dtype.kind in "iu",
        "bounds",
        lambda: f"must be an integer array, got {bounds.dtype}",
        TypeError,
    )
    require(
        bounds.ndim == 1 and bounds.shape[0] >= 2,
        "bounds",
        lambda: f"expected a 1-D array of at least 2 boundaries, got shape {bounds.shape}",
    )
    bounds = bounds.astype(np.int64)
    require(
        bounds[0] == 0 and bounds[-1] == n and bool(np.all(np.diff(bounds) >= 0)),
        "bounds",
        lambda: f"must rise from 0 to n={n}",
    )
    require(
        ks.dtype.kind in "iu", "ks", lambda: f"must be an integer array, got {ks.dtype}", TypeError
    )
    require(
        ks.ndim == 1 and ks.shape[0] == bounds.shape[0] - 1,
        "ks",
        lambda: f"expected shape ({bounds.shape[0] - 1},) (one per block), got {ks.shape}",
    )
    ks = ks.astype(np.int64)
    require(
        bool(np.all((ks >= 0) & (ks <= np.diff(bounds)))),
        "ks",
        "every ks[b] must be in [0, bounds[b+1] - bounds[b]]",
    )
    return ks, bounds


def check_accumulate(g_dtype, e_dtype, e_length, n, ks, bounds):
    """The arguments of ``accumulate_topk`` but ``out``: :func:`check_accumulated`, then
    :func:`check_blocks`. Returns (work dtype, ks, bounds)."""
    work = check_accumulated(g_dtype, e_dtype, e_length, n)
    ks, bounds = check_blocks(ks, bounds, n)
    return work, ks, bounds


def check_accumulated(g_dtype, e_dtype, e_length, n):
    """g and e of ``accumulate_topk`` / ``accumulate_above``: e in g's work dtype (float32 for a
    float16 g, else g's own) and of g's length n. Returns the work dtype."""
    g_dtype, e_dtype = np.dtype(g_dtype), np.dtype(e_dtype)
    work = np.dtype(np.float32) if g_dtype == np.float16 else g_dtype
    require(
        e_dtype == work,
        "e",
        lambda: f"dtype must be {work} for a {g_dtype} gradient, got {e_dtype}",
        TypeError,
    )
    check_same_length("e", e_length, "g", n)
    return work


def check_accumulate_out(shape, dtype, n, work, writeable, overlaps):
    """``out`` of ``accumulate_topk``: shape (n,), the work dtype, writeable, and (``overlaps``,
    computed by the backend) no memory shared with g or e."""
    require(
        tuple(shape) == (n,) and np.dtype(dtype) == work,
        "out",
        lambda: f"expected shape ({n},) and dtype {work}, got {tuple(shape)} {np.dtype(dtype)}",
    )
    require(writeable, "out", "array is read-only")
    require(not overlaps, "out", "must not share memory with g or e")


def check_cast_operand(name, ndim, dtype) -> None:
    """An operand of ``cast`` / ``canonicalize``: 1-D, in native byte order (a NaN's
    canonical bits are native; a swapped array would get them in the wrong order)."""
    check_ndim(name, ndim)
    dtype = np.dtype(dtype)
    require(
        dtype.isnative, name, lambda: f"dtype must be in native byte order, got {dtype}", TypeError
    )


def check_canonical_target(name, ndim, dtype) -> None:
    """The target of ``canonicalize``: as :func:`check_cast_operand`, and float16/32/64."""
    check_cast_operand(name, ndim, dtype)
    dtype = np.dtype(dtype)
    require(
        dtype.kind == "f" and dtype.itemsize in (2, 4, 8),
        name,
        lambda: f"dtype must be float16, float32 or float64, got {dtype}",
        TypeError,
    )


def check_indices_in_blocks(m, B, ends) -> None:
    """``block_offsets``: every one of the m sorted indices lies in a block, i.e. in
    ``[bounds[0], bounds[-1])``; with none (B = 0) an index lies in none. ``ends()`` returns
    ``(indices[0], indices[-1], bounds[0], bounds[-1])``, called only when m > 0 and B > 0
    (on the device it copies four numbers back)."""
    if m == 0:
        return
    require(B > 0, "indices", "every index must lie in a block, and bounds is empty")
    first, last, lo, hi = (int(v) for v in ends())
    require(
        lo <= first and last < hi,
        "indices",
        lambda: f"every index must lie in [bounds[0], bounds[-1]) = [{lo}, {hi})",
    )


def check_work_array(name, ndim, dtype, writeable):
    """The target of ``divide_max_abs`` / ``canonical_count_nonfinite``: 1-D,
    float32 or float64 (an allreducer's work dtype), writeable."""
    check_ndim(name, ndim)
    dtype = np.dtype(dtype)
    require(
        dtype in VALUE_DTYPES[1:],
        name,
        lambda: f"dtype must be float32 or float64, got {dtype}",
        TypeError,
    )
    require(writeable, name, "array is read-only; the pass writes into it")


def check_divisor(s, name="s"):
    """A real, finite, non-zero divisor (the number of ranks); returns it as ``float``."""
    real = isinstance(s, (numbers.Real, np.floating, np.integer))
    if isinstance(s, (bool, np.bool_)) or not real:
        raise TypeError(f"{name}: expected a real number, got {type(s).__name__}")
    try:
        s = float(s)
    except OverflowError:
        s = math.inf  # an integer beyond float64's range
    require(np.isfinite(s) and s != 0.0, name, lambda: f"must be finite and non-zero, got {s}")
    return s


def check_divisor_in(s, dtype, name="s"):
    """:func:`check_divisor`, then s in ``dtype`` (the division's), which must still be finite
    and non-zero there (1e-46 is 0 in float32, 1e39 is inf). Returns it as a ``dtype`` scalar."""
    s = check_divisor(s, name)
    with np.errstate(over="ignore", under="ignore"):
        t = np.dtype(dtype).type(s)
    require(
        np.isfinite(t) and t != 0,
        name,
        lambda: f"must be finite and non-zero in {np.dtype(dtype)}, got {s} (which is {t} there)",
    )
    return t
