"""Helpers shared by the CPU kernel modules: array coercion, key views, threads, the canonical
NaN of computed values and exact float16 <-> float32 conversions."""

import contextlib
import functools
import os
import threading

import numba
import numpy as np
from numba import njit, types
from numba.extending import overload

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


def in_place(x, name="x"):
    """:func:`as_array` for an argument written in place: TypeError naming ``name`` when NumPy
    could only copy it (a list, a tuple), since the writes would then reach a temporary."""
    a = as_array(x, name)
    if a is not x and not np.may_share_memory(a, x):
        raise TypeError(
            f"{name} is written in place, so it must be an array (or a buffer NumPy views "
            f"without copying), got {type(x).__name__}"
        )
    return a


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


# Environment variables in which MPI launchers tell a process how many ranks share its node:
# MPICH's and Intel MPI's Hydra, Open MPI, MVAPICH2.
_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")


@functools.lru_cache(maxsize=1)
def node_share():
    """Threads this process may run without oversubscribing its cores: the cores it may run on
    (its CPU affinity) divided by the ranks an MPI launcher put on the node, at least 1; None
    when no launcher said (a plain process: Numba's own setting stands).

    P ranks per node each running Numba's default thread count (one per core) put P times more
    threads than cores on the node, and every parallel call then waits on descheduled threads:
    measured on 2 cores with 4 ranks, Gaussian-k's step took 7x as long with 2 threads per rank
    as with 1 (docs/performance.md, "Threads per rank"). Read from the environment once, without
    MPI.
    """
    for var in _LOCAL_SIZE_VARS:
        v = os.environ.get(var, "").strip()
        if v.isdigit() and int(v) > 0:
            try:
                cores = len(os.sched_getaffinity(0))
            except (AttributeError, OSError):
                cores = os.cpu_count() or 1
            return max(1, cores // int(v))
    return None


def cpu_threads(size, min_size):
    """Threads a parallel kernel may use on ``size`` elements (1 = take the serial path).

    ``config.CPU_THREADS`` (None: Numba's current ``numba.get_num_threads()``, capped by
    :func:`node_share` under an MPI launcher), capped by ``NUMBA_NUM_THREADS``; 1 when
    ``size < min_size``, so small inputs never wake the pool.
    """
    if size < min_size:
        return 1
    limit = numba.config.NUMBA_NUM_THREADS
    if limit <= 1:
        return 1
    wanted = config.CPU_THREADS
    if wanted is None:
        share = node_share()
        if share == 1:  # decided without numba.get_num_threads(), which starts Numba's pool
            return 1
        threads = numba.get_num_threads()
        return threads if share is None else max(1, min(threads, share))
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


_SCRATCH = threading.local()


def scratch(name, size, dtype, zero=False):
    """A scratch array of ``size`` entries of ``dtype`` for the calling thread, reused from call
    to call: its memory stays mapped, where a fresh megabyte-sized ``np.empty`` on every call
    pays its page faults again (a window pass at n = 25 M, ρ = 1 %: 3 ms of 17, measured).

    For workers' private buffers only (a window pass's lists): the array is overwritten by the
    next call with the same ``name`` on this thread, so nothing a kernel returns may be, or
    view, a scratch array. Per thread, so kernels called from several threads at once (the
    GIL released) never share one. Grows by a quarter beyond the largest size asked for.
    With ``zero``, a new array starts all zero (a caller that needs it zero on every call
    leaves it so: the bitmap of :func:`spardl_kernels.cpu.arrays.set_outside_log`).
    """
    pool = _SCRATCH.__dict__
    key = (name, np.dtype(dtype).str)
    buf = pool.get(key)
    if buf is None or buf.shape[0] < size:
        buf = (np.zeros if zero else np.empty)(size + size // 4, dtype)
        pool[key] = buf
    return buf[:size]


def part_bounds(n, parts):
    """parts + 1 int64 bounds of near-equal contiguous parts of [0, n), first n mod parts longer."""
    q, r = divmod(n, parts)
    s = np.arange(parts + 1, dtype=np.int64)
    return s * q + np.minimum(s, r)


# ---------------------------------------------------------------------------------------------
# canonical NaN and exact float16 <-> float32 conversions (docs/design.md §3.4)
# ---------------------------------------------------------------------------------------------


def canonical(v):
    """``v``, or the canonical NaN of v's type (``_contract.CANONICAL_NAN_BITS``) if v is NaN.

    Called from compiled code, where it becomes one compare and one select on the value just
    computed (no branch). This Python body serves NumPy float scalars.
    """
    return v if v == v else type(v)(np.nan)


@overload(canonical)
def _canonical_compiled(v):
    if isinstance(v, types.Float):
        # A constant of v's own type: np.float32(np.nan) is 0x7FC00000, np.float64(np.nan)
        # 0x7FF8000000000000 (asserted by the kernel tests), with no conversion at run time.
        nan = np.dtype(v.name).type(np.nan)

        def impl(v):
            return v if v == v else nan

        return impl
    if isinstance(v, types.Integer):  # integers have no NaN (code typed for bit views too)

        def same(v):
            return v

        return same
    return None


@njit(**JIT)
def _half_to_single_bits(h, out):
    """out[i] = the float32 bits of the float16 with bits h[i], exactly (NaN payloads and
    signalling NaNs kept: no hardware conversion, which may quiet them)."""
    for i in range(h.shape[0]):
        b = np.int64(h[i]) & 0xFFFF
        sign = (b & 0x8000) << 16
        e = (b >> 10) & 0x1F
        m = b & 0x3FF
        if e == 0x1F:  # inf and NaN: the payload moves to the top of float32's fraction
            r = sign | 0x7F800000 | (m << 13)
        elif e != 0:
            r = sign | ((e + 112) << 23) | (m << 13)
        elif m == 0:
            r = sign
        else:  # subnormal m * 2**-24: normalised
            shift = 0
            while (m & 0x400) == 0:
                m <<= 1
                shift += 1
            r = sign | ((113 - shift) << 23) | ((m & 0x3FF) << 13)
        out[i] = r


@njit(**JIT)
def _fix_half_nans(w, out):
    """Where the float32 bits w[i] are a NaN, out[i] = the float16 NaN of the same sign whose
    payload is the top 10 bits of w's (the inverse of :func:`_half_to_single_bits`; the
    canonical 0x7FC00000 gives 0x7E00). Numbers are left as the rounding wrote them."""
    for i in range(w.shape[0]):
        b = np.int64(w[i]) & 0xFFFFFFFF
        if (b & 0x7FFFFFFF) > 0x7F800000:
            m = (b >> 13) & 0x3FF
            if m == 0:  # a payload in the low 13 bits only: still a NaN in float16
                m = 0x200
            out[i] = ((b >> 16) & 0x8000) | 0x7C00 | m


def widen_half(v):
    """float16 values as float32, exactly, NaN bits included (a new array)."""
    out = np.empty(v.shape[0], np.float32)
    if v.shape[0]:
        _half_to_single_bits(np.ascontiguousarray(v).view(np.uint16), out.view(np.uint32))
    return out


def narrow_half(w):
    """float32 values rounded once to float16 (to nearest, ties to even); a NaN keeps its sign
    and the top 10 bits of its payload, so that ``narrow_half(widen_half(v))`` is v bit for bit
    and the canonical float32 NaN becomes the canonical float16 one. A new array."""
    with np.errstate(over="ignore"):
        out = w.astype(np.float16)
    if w.shape[0]:
        _fix_half_nans(w.view(np.uint32), out.view(np.uint16))
    return out
