"""The array operations the allreducers use besides the twelve kernels, for host and device.

Every per-step buffer of an allreducer (X = g + E_old, partial sums, the residual, selections)
is either a NumPy array or, for GPU gradients, a Numba device array; these functions take either
and return the same kind, so an algorithm reads the same for both. Host arrays run NumPy; device
arrays run the small ``@cuda.jit`` kernels of :mod:`spardl_kernels.cuda.arrays` (imported only
when a device array is seen, so CPU-only use never imports ``numba.cuda``). Results are bit for
bit equal on both sides, NaN included: plain IEEE operations in the same order, every NaN that
arithmetic makes written as the canonical NaN, casts between float16 and float32 by bits
(docs/design.md §3.4). Small host-side metadata
(counts, bounds, schedules) stays NumPy and does not come here.
"""

from __future__ import annotations

import sys

import numpy as np

import spardl_kernels as K
from spardl_kernels.cpu import arrays as host_ops
from spardl_kernels.devices import cuda_backend, is_device_array

__all__ = [
    "is_device",
    "device_ops",
    "view",
    "to_host",
    "to_device",
    "like",
    "empty",
    "zeros",
    "copy",
    "cast",
    "accumulate",
    "add_into",
    "set_at",
    "zero_at",
    "zero_members",
    "set_outside_log",
    "sub_members",
    "shift",
    "take",
    "absolute",
    "divide",
    "all_finite",
    "arange",
    "concat",
    "aligned",
    "BufferPool",
]


def is_device(x) -> bool:
    """True for GPU arrays (``__cuda_array_interface__``, Numba device arrays, the simulator's)."""
    return is_device_array(x)


def device_ops():
    """The device implementation module (imports ``numba.cuda``); RuntimeError without CUDA."""
    cuda_backend()  # the clear "no CUDA" error, if any
    from spardl_kernels.cuda import arrays

    return arrays


def view(x):
    """A device array as a Numba device array (zero copy); host arrays unchanged."""
    return device_ops().view(x) if is_device(x) else x


def to_host(x) -> np.ndarray:
    """A host NumPy copy of a device array; host arrays are returned as NumPy arrays."""
    if is_device(x):
        return device_ops().view(x).copy_to_host()
    return np.asarray(x)


def to_device(x):
    """A device copy of a host array; device arrays are returned as they are (zero copy)."""
    if is_device(x):
        return view(x)
    from numba import cuda

    return cuda.to_device(np.ascontiguousarray(x))


def like(x, on_device: bool):
    """``x`` on the device when ``on_device``, else on the host (a copy only when it moves)."""
    return to_device(x) if on_device else to_host(x)


def empty(m: int, dtype, device: bool):
    """An uninitialised 1-D array of length m."""
    return device_ops().empty(m, dtype) if device else np.empty(int(m), dtype=dtype)


def zeros(m: int, dtype, device: bool):
    """A 1-D array of m zeros."""
    return device_ops().zeros(m, dtype) if device else np.zeros(int(m), dtype=dtype)


def arange(m: int, device: bool):
    """int64 0 … m−1."""
    return device_ops().arange(m) if device else np.arange(int(m), dtype=np.int64)


def copy(x):
    """A contiguous copy (bit for bit)."""
    return device_ops().copy(x) if is_device(x) else np.array(x, copy=True)


def cast(x, dtype, copy: bool = True):
    """x converted to ``dtype`` (``spardl_kernels.cpu.arrays.cast``: float16 <-> float32 by
    bits, NaN kept); without ``copy`` the same object when the dtype already matches."""
    dtype = np.dtype(dtype)
    if not copy and x.dtype == dtype:
        return x
    return (device_ops() if is_device(x) else host_ops).cast(x, dtype)


def accumulate(g, e, out=None):
    """X = g + e in e's dtype (g is converted exactly, then added; a NaN sum canonical): the
    summing pass of ``accumulate_topk`` with nothing selected, one pass over memory. Written
    into ``out`` (a host array of e's shape and dtype, sharing no memory with g or e) when
    given, else into a new array; ``out`` is ignored for device arrays."""
    none, whole = np.zeros(1, np.int64), np.array([0, e.shape[0]], np.int64)
    return K.accumulate_topk(g, e, none, whole, out=None if is_device(g) else out)[0]


def add_into(x, y):
    """``x += y`` in place, a NaN sum canonical; returns x."""
    if is_device(x):
        return device_ops().add_into(x, y)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and Inf are the caller's to judge
        x += y
    return host_ops.canonicalize(x)


def set_at(s, idx, vals):
    """``s[idx] = vals`` in place (idx unique); returns s."""
    if is_device(s):
        return device_ops().set_at(s, idx, vals)
    s[idx] = vals
    return s


def zero_at(s, idx):
    """``s[idx] = 0`` in place; returns s."""
    if is_device(s):
        return device_ops().zero_at(s, idx)
    s[idx] = 0
    return s


def zero_members(s, idx, members):
    """``s[i] = 0`` for every i in ``idx`` that is also in the ascending array ``members``."""
    return (device_ops() if is_device(s) else host_ops).zero_members(s, idx, members)


def set_outside(s, idx, vals, members):
    """``s[i] = v`` for (i, v) in (idx, vals) with i NOT in the ascending ``members`` (idx
    unique); returns s."""
    return (device_ops() if is_device(s) else host_ops).set_outside(s, idx, vals, members)


def set_outside_log(s, log, members):
    """:func:`set_outside` of every (idx, vals) of ``log`` (oldest first), newest first, against
    one ascending ``members``; returns s."""
    return (device_ops() if is_device(s) else host_ops).set_outside_log(s, log, members)


def sub_members(s, idx, vals, members):
    """``s[i] = s[i] + (−v)`` for (i, v) in (idx, vals) with i in the ascending ``members``
    (idx unique), a NaN result written as the canonical NaN; returns s."""
    return (device_ops() if is_device(s) else host_ops).sub_members(s, idx, vals, members)


def shift(idx, c: int):
    """``idx.astype(int64) + c`` (a new array)."""
    if is_device(idx):
        return device_ops().shift(idx, c)
    out = idx.astype(np.int64, copy=True)
    out += int(c)
    return out


def take(a, pos):
    """``a[pos]`` for any dtype (a new array)."""
    return device_ops().take(a, pos) if is_device(a) else a[pos]


def absolute(a):
    """``abs(a)`` (a new array)."""
    return device_ops().absolute(a) if is_device(a) else np.abs(a)


def divide(a, s, out=None):
    """``a / a.dtype.type(s)`` in a's dtype, a NaN quotient canonical: a new array, or written
    into ``out`` (an array of the same kind, length and dtype; ``out`` may be ``a``) and
    returned."""
    if is_device(a):
        return device_ops().divide(a, s, out)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        return host_ops.canonicalize(np.divide(a, a.dtype.type(s), out=out))


def all_finite(a) -> bool:
    """``np.all(np.isfinite(a))``."""
    return device_ops().all_finite(a) if is_device(a) else bool(np.all(np.isfinite(a)))


def aligned(a):
    """A byte buffer whose typed views are aligned: device rows that start at an odd offset of
    a received buffer are copied; host arrays are returned as they are."""
    return device_ops().aligned(a) if is_device(a) else a


def concat(parts, dtype, device: bool):
    """The concatenation of 1-D arrays as one new array of ``dtype`` on the host or device."""
    if device:
        return device_ops().concat(list(parts), dtype)
    parts = list(parts)
    if not parts:
        return np.empty(0, dtype=dtype)
    return np.concatenate(parts).astype(dtype, copy=False)


class BufferPool:
    """Host buffers kept from step to step and handed out again once nothing else refers to them.

    A fresh length-n buffer costs its page faults on every step (tens of ms for 100 MB, about
    half of SparDL's local work at n = 25 M, measured); a buffer reused while a caller still
    holds it (a result, a residual, a view or a tensor of either) would change that caller's
    data. So a kept buffer is handed out only when its reference count shows that the pool is
    its only holder. Used for the base allreducer's X = g + E buffer and dense's result buffers.

    Parameters
    ----------
    capacity : int
        How many buffers are kept, ≥ 1; keeping one more gives up the oldest.

    Notes
    -----
    The reference count is CPython's (``sys.getrefcount``); what it reports for a buffer that
    only the pool holds is measured once at import (:data:`_POOL_ONLY`), not assumed, so it
    stays right on any CPython version. Device arrays are never kept: their memory is the
    caller's (a GPU gradient's step allocates on the device).
    """

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self._kept: list = []

    def take(self, n: int, dtype):
        """A kept host buffer of shape (n,) and ``dtype`` that nothing outside the pool refers
        to (it stays kept), or None."""
        dtype = np.dtype(dtype)
        kept = self._kept
        for i in range(len(kept)):
            # No local name for kept[i]: it would count as one more holder.
            if kept[i].shape == (n,) and kept[i].dtype == dtype:
                if _pool_refs(kept, i) <= _POOL_ONLY:
                    return kept[i]
        return None

    def keep(self, buf) -> None:
        """Keep host array ``buf`` for later :meth:`take` calls (the oldest kept buffer is given
        up when the pool is full); device arrays and buffers already kept are ignored."""
        if is_device(buf) or any(b is buf for b in self._kept):
            return
        self._kept.append(buf)
        del self._kept[: -self.capacity]

    def clear(self) -> None:
        """Give up every kept buffer (their memory is freed once nothing else holds them)."""
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)

    def __iter__(self):
        return iter(list(self._kept))


def _pool_refs(kept: list, i: int) -> int:
    """``sys.getrefcount`` of ``kept[i]`` as seen from here (the list, the local, the call)."""
    buf = kept[i]
    return sys.getrefcount(buf)


#: What :func:`_pool_refs` counts for a buffer that only the pool holds.
_POOL_ONLY = _pool_refs([np.empty(0)], 0)
