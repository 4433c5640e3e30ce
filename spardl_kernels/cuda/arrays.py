"""Device array operations besides the fourteen kernels, for code built on them (``spardl``'s
collective layer, through ``spardl._arrays``): the few elementwise operations an allreducer does
on its per-step buffers (X = g + E, setting and zeroing positions, index shifts, casts, packing).
They are not kernels of the contract. Most have no CPU twin module: on the host they are one
NumPy expression each (in ``spardl._arrays``). The exceptions, with twins of the same name and
bits in :mod:`spardl_kernels.cpu.arrays`, are ``cast`` and ``canonicalize`` and the dense
allreducer's passes ``divide_max_abs`` and ``canonical_count_nonfinite``.

Every function takes and returns Numba device arrays (or objects exposing
``__cuda_array_interface__``, wrapped zero-copy) and runs on the GPU or the CUDA simulator.
Launch sizes come from :mod:`spardl_kernels.config` through ``_common.launch``. Results are bit
for bit those of the NumPy expressions named in each docstring (IEEE single/double operations,
no fast-math), with one rule on top (docs/design.md §3.4): a value computed by arithmetic (a sum,
a difference, a quotient) that is NaN is written as the canonical NaN of its dtype, whatever NaN
the GPU made; copies keep their bits.
"""

import math

import numpy as np
from numba import cuda, int64

from .. import _validate
from . import _common as C

__all__ = [
    "view",
    "empty",
    "zeros",
    "copy",
    "cast",
    "canonicalize",
    "add_into",
    "set_at",
    "zero_at",
    "zero_members",
    "set_outside",
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
    "copy_into",
    "shift_into",
    "divide_max_abs",
    "canonical_count_nonfinite",
]

# ---------------------------------------------------------------------------------------------
# kernels (grid-stride, one element per thread)
# ---------------------------------------------------------------------------------------------


@cuda.jit
def _add_into(x, y, nan):
    # x += y, a NaN sum written as `nan`
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        v = x[i] + y[i]
        if v != v:
            x[i] = nan
        else:
            x[i] = v


@cuda.jit
def _fill(x, v):
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        x[i] = v


@cuda.jit
def _set_at(s, idx, vals):
    # s[idx] = vals (idx unique)
    for j in range(cuda.grid(1), idx.shape[0], cuda.gridsize(1)):
        s[idx[j]] = vals[j]


@cuda.jit
def _zero_at(s, idx):
    for j in range(cuda.grid(1), idx.shape[0], cuda.gridsize(1)):
        s[idx[j]] = 0


@cuda.jit(device=True)
def _member(sorted_idx, v):
    # is v in the ascending array sorted_idx (binary search, lower bound)
    lo = 0
    hi = sorted_idx.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if sorted_idx[mid] < v:
            lo = mid + 1
        else:
            hi = mid
    return lo < sorted_idx.shape[0] and sorted_idx[lo] == v


@cuda.jit
def _zero_members(s, idx, members):
    # s[idx[j]] = 0 where idx[j] is in members
    for j in range(cuda.grid(1), idx.shape[0], cuda.gridsize(1)):
        if _member(members, idx[j]):
            s[idx[j]] = 0


@cuda.jit
def _set_outside(s, idx, vals, members):
    # s[idx[j]] = vals[j] where idx[j] is not in members
    for j in range(cuda.grid(1), idx.shape[0], cuda.gridsize(1)):
        if not _member(members, idx[j]):
            s[idx[j]] = vals[j]


@cuda.jit
def _sub_members(s, idx, vals, members, nan):
    # s[idx[j]] += -vals[j] where idx[j] is in members (scatter_add of the negated values), a
    # NaN sum written as `nan`
    for j in range(cuda.grid(1), idx.shape[0], cuda.gridsize(1)):
        if _member(members, idx[j]):
            v = s[idx[j]] + (-vals[j])
            if v != v:
                s[idx[j]] = nan
            else:
                s[idx[j]] = v


@cuda.jit
def _shift(a, c, out):
    # out = a + c (int64)
    for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        out[i] = int64(a[i]) + c


@cuda.jit
def _take(a, pos, out):
    # out = a[pos]
    for j in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        out[j] = a[pos[j]]


@cuda.jit
def _abs(a, out):
    for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        out[i] = abs(a[i])


@cuda.jit
def _divide(a, s, nan, out):
    # out = a / s, s of a's dtype, a NaN quotient written as `nan`
    for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        v = a[i] / s
        if v != v:
            out[i] = nan
        else:
            out[i] = v


@cuda.jit
def _convert(a, nan, out):
    # out = a converted to out's dtype, a NaN written as `nan` (float pairs other than
    # float16 <-> float32, which convert by bits)
    for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        v = a[i]
        if v != v:
            out[i] = nan
        else:
            out[i] = v


@cuda.jit
def _canonicalize(x, nan):
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        if x[i] != x[i]:
            x[i] = nan


@cuda.jit
def _count_nonfinite(a, res):
    # res[0] += #{i : a[i] is NaN or ±inf}
    c = 0
    for i in range(cuda.grid(1), a.shape[0], cuda.gridsize(1)):
        if math.isinf(a[i]) or math.isnan(a[i]):
            c += 1
    if c:
        cuda.atomic.add(res, 0, c)


@cuda.jit
def _divide_max_abs(x, s, nan, out, res):
    # out = x / s, a NaN quotient written as `nan`; res[0] = max(res[0], max |quotient|), inf
    # once a quotient is NaN or ±inf (the maximum is one of the quotients: order-free bits)
    peak = 0.0
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        v = x[i] / s
        if v != v:
            out[i] = nan
            peak = math.inf
        else:
            out[i] = v
            a = abs(v)
            if a > peak:
                peak = a
    cuda.atomic.max(res, 0, peak)


@cuda.jit
def _canonical_count_nonfinite(x, nan, res):
    # res[0] += #{NaN or ±inf}, every NaN rewritten as `nan`
    c = 0
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        v = x[i]
        if v != v:
            x[i] = nan
            c += 1
        elif math.isinf(v):
            c += 1
    if c:
        cuda.atomic.add(res, 0, c)


# ---------------------------------------------------------------------------------------------
# host wrappers
# ---------------------------------------------------------------------------------------------


def view(x):
    """``x`` as a Numba device array without copying device memory."""
    return C.to_device(x)


def empty(m, dtype):
    """An uninitialised device array of m ``dtype``."""
    return C.empty(int(m), dtype)


def zeros(m, dtype):
    """A device array of m zeros of ``dtype``."""
    out = C.empty(int(m), dtype)
    if m:
        C.launch(_fill, m)(out, np.dtype(dtype).type(0))
    return out


def copy(a):
    """A contiguous device copy, bit for bit (floats move as their bit patterns)."""
    a = view(a)
    dt = np.dtype(a.dtype)
    if dt.kind == "f":
        return C.cast(C.bits_of(a), C.BITS[dt.name]).view(dt)
    return C.cast(a, dt)


def cast(a, dtype):
    """``a`` converted to ``dtype`` on the device (a new array): the twin of
    :func:`spardl_kernels.cpu.arrays.cast`, bit for bit.

    The same dtype is a bit copy; float16 -> float32 is exact and float32 -> float16 rounds once
    (to nearest, ties to even; past ±65504 to ±inf), both by bit manipulation, so a NaN keeps
    its sign and payload as the kernels' conversions keep them (docs/design.md §3.4); any other
    pair of float dtypes converts values and writes a NaN as the canonical NaN of ``dtype``;
    integer dtypes convert as NumPy's ``astype``.

    Parameters
    ----------
    a : device array of shape (m,)
    dtype : dtype

    Returns
    -------
    device array of shape (m,), ``dtype``

    Raises
    ------
    TypeError, ValueError
        As the CPU function: ``a`` not 1-D, ``a``'s dtype or ``dtype`` not in native byte
        order.
    """
    a, dt = view(a), np.dtype(dtype)
    src = np.dtype(a.dtype)
    _validate.check_cast_operand("a", a.ndim, src)
    _validate.require(
        dt.isnative, "dtype", lambda: f"must be in native byte order, got {dt}", TypeError
    )
    if src == dt:
        return copy(a)
    if (src.name, dt.name) == ("float16", "float32"):
        return C.widen_half(a)
    if (src.name, dt.name) == ("float32", "float16"):
        return C.narrow_half(a)
    if src.kind == "f" and dt.kind == "f":
        out = C.empty(a.shape[0], dt)
        if a.shape[0]:
            C.launch(_convert, a.shape[0])(a, C.canonical_nan(dt), out)
        return out
    return C.cast(a, dt)


def canonicalize(x):
    """Every NaN of the device array ``x`` rewritten, in place, as the canonical NaN of its
    dtype (docs/design.md §3.4); returns x. The twin of
    :func:`spardl_kernels.cpu.arrays.canonicalize`, with its errors: TypeError for a dtype
    other than float16/32/64 or not native, ValueError for an array not 1-D."""
    x = view(x)
    _validate.check_canonical_target("x", x.ndim, x.dtype)
    if x.shape[0]:
        C.launch(_canonicalize, x.shape[0])(x, C.canonical_nan(x.dtype))
    return x


def add_into(x, y):
    """``x += y`` in place, a NaN sum written as the canonical NaN (docs/design.md §3.4)."""
    if x.shape[0]:
        C.launch(_add_into, x.shape[0])(x, view(y), C.canonical_nan(x.dtype))
    return x


def set_at(s, idx, vals):
    """``s[idx] = vals`` in place (idx unique)."""
    if idx.shape[0]:
        C.launch(_set_at, idx.shape[0])(s, view(idx), view(vals))
    return s


def zero_at(s, idx):
    """``s[idx] = 0`` in place."""
    if idx.shape[0]:
        C.launch(_zero_at, idx.shape[0])(s, view(idx))
    return s


def zero_members(s, idx, members):
    """``s[i] = 0`` for every i of ``idx`` that is in the ascending array ``members``."""
    if idx.shape[0] and members.shape[0]:
        C.launch(_zero_members, idx.shape[0])(s, view(idx), view(members))
    return s


def set_outside(s, idx, vals, members):
    """``s[i] = v`` for every (i, v) of (idx, vals) with i not in the ascending ``members``."""
    if idx.shape[0]:
        C.launch(_set_outside, idx.shape[0])(s, view(idx), view(vals), view(members))
    return s


def set_outside_log(s, log, members):
    """:func:`set_outside` of every (idx, vals) of ``log`` (oldest first), newest first: the
    twin of :func:`spardl_kernels.cpu.arrays.set_outside_log` (the same bits; one launch per
    entry, each searching ``members``)."""
    for idx, vals in reversed(list(log)):
        set_outside(s, idx, vals, members)
    return s


def sub_members(s, idx, vals, members):
    """``s[i] += -v`` for every (i, v) of (idx, vals) with i in the ascending ``members``, a
    NaN sum written as the canonical NaN."""
    if idx.shape[0] and members.shape[0]:
        C.launch(_sub_members, idx.shape[0])(
            s, view(idx), view(vals), view(members), C.canonical_nan(s.dtype)
        )
    return s


def shift(a, c):
    """``a.astype(int64) + c`` as a new int64 array."""
    a = view(a)
    out = C.empty(a.shape[0], np.int64)
    if a.shape[0]:
        C.launch(_shift, a.shape[0])(a, int64(c), out)
    return out


def take(a, pos):
    """``a[pos]`` for any dtype (a new array)."""
    a, pos = view(a), view(pos)
    out = C.empty(pos.shape[0], a.dtype)
    if pos.shape[0]:
        C.launch(_take, pos.shape[0])(a, pos, out)
    return out


def absolute(a):
    """``abs(a)`` (a new array; the sign bit cleared, NaN payloads kept)."""
    a = view(a)
    out = C.empty(a.shape[0], a.dtype)
    if a.shape[0]:
        C.launch(_abs, a.shape[0])(a, out)
    return out


def divide(a, s, out=None):
    """``a / a.dtype.type(s)``: a new array, or into ``out`` (same length and dtype; may be a);
    a NaN quotient written as the canonical NaN."""
    a = view(a)
    out = C.empty(a.shape[0], a.dtype) if out is None else view(out)
    if a.shape[0]:
        dt = np.dtype(a.dtype)
        C.launch(_divide, a.shape[0])(a, dt.type(s), C.canonical_nan(dt), out)
    return out


def all_finite(a):
    """``np.all(np.isfinite(a))``, one small copy back."""
    a = view(a)
    if a.shape[0] == 0:
        return True
    res = cuda.to_device(np.zeros(1, np.int64))
    C.launch(_count_nonfinite, a.shape[0])(a, res)
    return int(res.copy_to_host()[0]) == 0


def arange(m):
    """int64 0 … m−1 on the device."""
    return C.arange(int(m))


def concat(parts, dtype):
    """The concatenation of 1-D device (or small host) arrays, cast to ``dtype``."""
    dtype = np.dtype(dtype)
    total = sum(int(p.shape[0]) for p in parts)
    out = C.empty(total, dtype)
    pos = 0
    for p in parts:
        c = int(p.shape[0])
        if c:
            src = view(p)
            if dtype.kind == "f" and np.dtype(src.dtype) == dtype:
                # floats move as bit patterns (NaN payloads and -0.0 kept)
                C.launch(C._copy, c)(C.bits_of(src), out[pos : pos + c].view(C.BITS[dtype.name]))
            else:
                C.launch(C._copy, c)(src, out[pos : pos + c])
        pos += c
    return out


def _address(a):
    if hasattr(a, "__cuda_array_interface__"):
        return int(a.__cuda_array_interface__["data"][0])
    return int(a._ary.ctypes.data)  # the simulator's arrays wrap host memory


def aligned(a, alignment=8):
    """``a`` itself when its first byte is ``alignment``-aligned, else an aligned device copy
    (byte rows of an all-gather start anywhere; typed views of them must be aligned)."""
    a = view(a)
    if a.shape[0] == 0 or _address(a) % alignment == 0:
        return a
    return copy(a)


def copy_into(dst, src):
    """``dst[:] = src`` (same length; a cast when the dtypes differ, else bit for bit)."""
    src = view(src)
    c = src.shape[0]
    if c:
        dt = np.dtype(dst.dtype)
        if dt.kind == "f" and np.dtype(src.dtype) == dt:
            C.launch(C._copy, c)(C.bits_of(src), dst.view(C.BITS[dt.name]))
        else:
            C.launch(C._copy, c)(src, dst)
    return dst


def shift_into(out, a, c):
    """``out[:] = a + c`` (a's integers shifted by c, stored in out's integer dtype)."""
    if a.shape[0]:
        C.launch(_shift, a.shape[0])(view(a), int64(c), out)
    return out


def _work_array(x, name="x"):
    x = view(x)
    _validate.check_work_array(name, x.ndim, x.dtype, True)
    return x


def _launch_count(kernel, x, *args):
    res = cuda.to_device(np.zeros(1, np.int64))
    if x.shape[0]:
        C.launch(kernel, x.shape[0])(x, *args, C.canonical_nan(x.dtype), res)
    return int(res.copy_to_host()[0])


def divide_max_abs(x, s, out=None):
    """``out = x / s`` on the device, and the largest magnitude of the quotients.

    The twin of :func:`spardl_kernels.cpu.arrays.divide_max_abs` (same arguments, errors and
    bits: IEEE division in x's dtype, a NaN quotient written as the canonical NaN of
    docs/design.md §3.4). One kernel and one number copied back.

    Parameters
    ----------
    x : device array of shape (n,), float32 or float64
    s : real number, finite and non-zero
    out : device array of shape (n,), x's dtype, optional
        Receives the quotients; x itself (in place) when None.

    Returns
    -------
    float
        max |x_i / s|, or ``inf`` if any quotient is NaN or ±inf.

    Raises
    ------
    TypeError, ValueError
        As the CPU function.
    """
    x = view(x)
    _validate.check_work_array("x", x.ndim, x.dtype, True)
    out = x if out is None else _work_array(out, "out")
    _validate.check_same_length("out", out.shape[0], "x", x.shape[0])
    _validate.check_same_dtype("out", out.dtype, "x", x.dtype)
    s = _validate.check_divisor_in(s, x.dtype)
    res = cuda.to_device(np.zeros(1, np.float64))
    if x.shape[0]:
        C.launch(_divide_max_abs, x.shape[0])(x, s, C.canonical_nan(x.dtype), out, res)
    return float(res.copy_to_host()[0])


def canonical_count_nonfinite(x):
    """The number of NaN and ±inf entries of a device array, every NaN rewritten as the
    canonical NaN: the twin of :func:`spardl_kernels.cpu.arrays.canonical_count_nonfinite`.

    Parameters
    ----------
    x : device array of shape (n,), float32 or float64

    Returns
    -------
    int

    Raises
    ------
    TypeError, ValueError
        As the CPU function.
    """
    return _launch_count(_canonical_count_nonfinite, _work_array(x))
