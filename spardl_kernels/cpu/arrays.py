"""Host array passes besides the fourteen kernels, for code built on them (``spardl``'s
collective layer): the fused division and magnitude bound that start a dense allreduce, the
non-finite count that checks its sums when the bound cannot, and the casts and NaN rewriting
whose bits must equal the device's.

Not kernels of the contract (docs/design.md §3.5): they are in-place passes of one allreducer
over a dense work vector, not operations on sparse vectors, so ``spardl_kernels`` does not
dispatch them. Their device twins live in :mod:`spardl_kernels.cuda.arrays`, with the same bits:
IEEE division in x's dtype, and every NaN written as the canonical NaN (§3.4).
"""

import contextlib

import numpy as np
from numba import njit

from .. import _contract, _validate
from ._common import JIT, as_array, canonical, in_place, narrow_half, scratch, widen_half
from ._simd import bits_float32, float_bits

__all__ = [
    "divide_max_abs",
    "canonical_count_nonfinite",
    "cast",
    "canonicalize",
    "zero_members",
    "set_outside",
    "set_outside_log",
    "sub_members",
    "mask_sent",
    "accumulate_velocity",
    "sum_half",
    "scale_to_half",
    "scale_from_half",
]


@njit(**JIT)
def _divide_abs_bits(x, bits, mask, s, out):
    # out = x / s (NaN canonical); the largest bits of |x_i| (bits: x's bits as unsigned
    # integers, mask: all but the sign bit). An integer maximum vectorises where a float one
    # cannot (NaN), and a non-negative float's bits order as its value, NaN above inf.
    # x's bits are read before out is written: out may be x itself (in place).
    top = mask ^ mask  # zero of the mask's unsigned type
    for i in range(x.shape[0]):
        b = bits[i] & mask
        out[i] = canonical(x[i] / s)
        top = max(top, b)
    return top


@njit(**JIT)
def _canonical_count_nonfinite(x):
    c = 0
    for i in range(x.shape[0]):
        v = x[i]
        c += not (abs(v) < np.inf)
        if v != v:  # rare: the pass stays read-only on finite data
            x[i] = canonical(v)
    return c


@njit(**JIT)
def _lower_bound(members, v, lo):
    """The first position ≥ ``lo`` of the ascending ``members`` whose value is ≥ v, where every
    value before ``lo`` is < v: a galloping search from ``lo`` (steps 1, 2, 4, ...), then a
    binary search inside the last step. For ascending queries, each costs the log of the
    distance to the previous answer: a merge of two sorted arrays in O(q + m) overall."""
    m = members.shape[0]
    step = 1
    hi = lo
    while hi < m and members[hi] < v:
        lo = hi + 1
        hi += step
        step *= 2
    hi = min(hi, m)
    while lo < hi:
        mid = (lo + hi) // 2
        if members[mid] < v:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(inline="always", **JIT)
def _member_write(s, v, vals, j, mode):
    # mode 0 zeroes s[v], mode 1 writes vals[j], mode 2 adds -vals[j] (a NaN sum canonical)
    if mode == 0:
        s[v] = 0
    elif mode == 1:
        s[v] = vals[j]
    else:
        s[v] = canonical(s[v] + (-vals[j]))


@njit(**JIT)
def _member_scan(idx, members, want, s, vals, mode):
    # _member_write at idx[j] for each j with (idx[j] in members) == want. Ascending runs of
    # idx reuse the search position; a descent starts the search again from 0.
    lo = 0
    prev = idx[0] if idx.shape[0] else 0
    for j in range(idx.shape[0]):
        v = idx[j]
        if v < prev:
            lo = 0
        prev = v
        lo = _lower_bound(members, v, lo)
        hit = lo < members.shape[0] and members[lo] == v
        if hit != want:
            continue
        _member_write(s, v, vals, j, mode)


@njit(**JIT)
def _outside(a, n):
    # the number of entries of a outside [0, n)
    c = 0
    for i in range(a.shape[0]):
        c += a[i] < 0 or a[i] >= n
    return c


@njit(**JIT)
def _descents(a):
    # the number of i with a[i + 1] < a[i]
    c = 0
    for i in range(a.shape[0] - 1):
        c += a[i + 1] < a[i]
    return c


@njit(**JIT)
def _marked_pass(idx, bits, want, s, vals, mode):
    # _member_scan's passes with membership read from a bitmap of s's positions (_mark). A
    # branch, not a select: the writes to s are scattered cache misses, and a position whose
    # test fails is not touched at all.
    one = np.uint64(1)
    for j in range(idx.shape[0]):
        v = idx[j]
        hit = ((bits[v >> 6] >> np.uint64(v & 63)) & one) == one
        if hit != want:
            continue
        _member_write(s, v, vals, j, mode)


@contextlib.contextmanager
def _members_bitmap(n, members):
    """A bitmap of n bits with ``members`` (those in [0, n): no other can be a position) set:
    per-thread scratch, cleared again on the way out, so it is all zero between calls."""
    if _outside(members, n):
        members = members[(members >= 0) & (members < n)]
    members = members.astype(np.int64, copy=False)
    bits = scratch("members bitmap", (n + 63) // 64, np.uint64, zero=True)
    _mark(bits, members, True)
    try:
        yield bits
    finally:
        _mark(bits, members, False)


#: From this many members on, the member passes mark them in a bitmap of n bits and look each
#: position up, instead of merging against them (250 000 against 250 000 at n = 25 M: 6.4 ms
#: merged, about 1.5 marked).
BITMAP_MIN_MEMBERS = 4096


def _positions(name, a):
    a = as_array(a, name)
    if a.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: dtype must be an integer type, got {a.dtype}")
    if not a.dtype.isnative:  # big-endian: the compiled passes take native integers
        a = a.astype(a.dtype.newbyteorder("="))
    return a


def _checked_target(s, members):
    """``s`` (a writeable 1-D float32/float64 array) and the ascending integer ``members``."""
    s = in_place(s, "s")
    _validate.check_work_array("s", s.ndim, s.dtype, s.flags.writeable)
    members = _positions("members", members)
    if _descents(members):
        raise ValueError("members: must be ascending")
    return s, members


def _checked_entry(s, idx, vals, needs_vals=True):
    """``idx``: integer positions in [0, n); ``vals``: of idx's shape and s's dtype (ignored
    without ``needs_vals``: zero_members)."""
    idx = _positions("idx", idx)
    if _outside(idx, s.shape[0]):
        raise ValueError(f"idx: positions must lie in [0, {s.shape[0]})")
    if not needs_vals:
        return idx, np.zeros(0, s.dtype)
    if vals is None:
        raise TypeError(f"vals: expected an array of shape {idx.shape} and dtype {s.dtype}")
    vals = as_array(vals, "vals")
    if vals.shape != idx.shape or vals.dtype != s.dtype:
        raise ValueError(
            f"vals: expected shape {idx.shape} and dtype {s.dtype}, got {vals.shape} {vals.dtype}"
        )
    return idx, vals


def _member_pass(s, idx, vals, members, want, mode):
    s, members = _checked_target(s, members)
    idx, vals = _checked_entry(s, idx, vals, needs_vals=mode != 0)
    if not idx.shape[0]:
        return s
    if members.shape[0] < BITMAP_MIN_MEMBERS:
        _member_scan(idx, members, want, s, vals, mode)
        return s
    with _members_bitmap(s.shape[0], members) as bits:
        _marked_pass(idx.astype(np.int64, copy=False), bits, want, s, vals, mode)
    return s


def zero_members(s, idx, members):
    """``s[i] = 0`` for every i of ``idx`` that is in ``members``, in place.

    Parameters
    ----------
    s : ndarray of shape (n,), float32 or float64
        The dense work vector; modified in place.
    idx : ndarray of shape (q,), int64
        Positions of ``s``, unique; ascending is fastest (a merge), any order is correct.
    members : ndarray of shape (m,), int64, ascending
        The set tested against.

    Returns
    -------
    ndarray
        ``s``.

    Raises
    ------
    TypeError, ValueError
        Naming the argument: ``s`` not a writeable 1-D float32/float64 array, positions not
        integers or outside [0, n), ``members`` not ascending.
    """
    return _member_pass(s, idx, None, members, True, 0)


def set_outside(s, idx, vals, members):
    """``s[i] = v`` for every (i, v) of (``idx``, ``vals``) with i not in ``members``, in place.

    Parameters
    ----------
    s : ndarray of shape (n,), float32 or float64
        The dense work vector; modified in place.
    idx : ndarray of shape (q,), int64
        Positions of ``s``, unique; ascending is fastest (a merge), any order is correct.
    vals : ndarray of shape (q,), ``s``'s dtype
        The values written.
    members : ndarray of shape (m,), int64, ascending
        The positions left alone.

    Returns
    -------
    ndarray
        ``s``. SparDL's Global Residual Collection writes its undo log back this way
        (docs/design.md §4.4).

    Raises
    ------
    TypeError, ValueError
        As :func:`zero_members`; also ``vals`` not of ``idx``'s length and ``s``'s dtype.
    """
    return _member_pass(s, idx, vals, members, False, 1)


@njit(**JIT)
def _mark(bits, members, on):
    # bit i of the bitmap (word i >> 6, bit i & 63) set (on) or cleared for every member i
    one = np.uint64(1)
    for j in range(members.shape[0]):
        v = members[j]
        b = one << np.uint64(v & 63)
        if on:
            bits[v >> 6] |= b
        else:
            bits[v >> 6] &= ~b


def set_outside_log(s, log, members):
    """:func:`set_outside` of every entry of ``log``, newest first, against one ``members``.

    The same as ``for idx, vals in reversed(log): set_outside(s, idx, vals, members)``, bit for
    bit, but ``members`` is checked once and marked once in a bitmap of n bits (per-thread
    scratch, cleared again before returning), so each entry costs one lookup per position
    instead of a merge against all of ``members``: SparDL's Global Residual Collection replays
    a log of 2⌈log₂P⌉ entries against the 250 000 output indices at n = 25 M, ρ = 1 %.

    Parameters
    ----------
    s : ndarray of shape (n,), float32 or float64
        The dense work vector; modified in place.
    log : sequence of (idx, vals)
        Oldest first; each ``idx`` an int64 array of unique positions of ``s`` (any order),
        ``vals`` of its length and ``s``'s dtype. Positions may repeat across entries: the
        oldest entry's value is what remains.
    members : ndarray of shape (m,), int64, ascending
        The positions left alone.

    Returns
    -------
    ndarray
        ``s``.

    Raises
    ------
    TypeError, ValueError
        As :func:`set_outside`, for any entry.
    """
    s, members = _checked_target(s, members)
    if isinstance(log, (str, bytes)) or not hasattr(log, "__iter__"):
        raise TypeError(f"log: expected a sequence of (idx, vals) pairs, got {type(log).__name__}")
    entries = []
    for entry in log:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise TypeError(f"log: every entry must be an (idx, vals) pair, got {entry!r:.60}")
        entries.append(_checked_entry(s, *entry))
    if not entries:
        return s
    with _members_bitmap(s.shape[0], members) as bits:
        for idx, vals in reversed(entries):
            if idx.shape[0]:
                _marked_pass(idx.astype(np.int64, copy=False), bits, False, s, vals, 1)
    return s


def sub_members(s, idx, vals, members):
    """``s[i] = s[i] + (−v)`` for every (i, v) of (``idx``, ``vals``) with i in ``members``, in
    place; a NaN result is written as the canonical NaN (docs/design.md §3.4).

    Parameters
    ----------
    s : ndarray of shape (n,), float32 or float64
        The dense work vector; modified in place.
    idx : ndarray of shape (q,), int64
        Positions of ``s``, unique; ascending is fastest (a merge), any order is correct.
    vals : ndarray of shape (q,), ``s``'s dtype
        The values subtracted.
    members : ndarray of shape (m,), int64, ascending
        The positions changed.

    Returns
    -------
    ndarray
        ``s``.

    Raises
    ------
    TypeError, ValueError
        As :func:`set_outside`.
    """
    return _member_pass(s, idx, vals, members, True, 2)


@njit(**JIT)
def _mask_sent(u, residual, x):
    for i in range(u.shape[0]):
        if residual[i] == 0 and x[i] != 0:
            u[i] = 0


@njit(**JIT)
def _accumulate_velocity(u, m, g, out, residual, x):
    with_x = x.shape[0] > 0
    for i in range(u.shape[0]):
        v = m * u[i] + g[i]
        out[i] = v
        g[i] = v
        if with_x:
            x[i] = v + residual[i]


def _momentum(m, dtype):
    """``m`` as a finite number of ``dtype`` (TypeError for a non-number, ValueError when it is
    not finite there)."""
    _validate.require(
        isinstance(m, (int, float, np.floating, np.integer)) and not isinstance(m, bool),
        "m",
        lambda: f"must be a real number, got {type(m).__name__}",
        TypeError,
    )
    with np.errstate(over="ignore"):
        try:
            mm = np.asarray(m, dtype=dtype)[()]
        except OverflowError:
            mm = np.asarray(np.inf, dtype=dtype)[()]
    _validate.require(bool(np.isfinite(mm)), "m", lambda: f"must be finite in {dtype}, got {m!r}")
    return mm


def accumulate_velocity(u, m, g, out, residual=None, x=None):
    """Momentum correction's accumulation in one pass: ``out = m·u + g``, written into ``out``
    and over ``g`` (the allreducer's input), and ``x = out + residual`` when ``x`` is given.

    Deep Gradient Compression's momentum correction (arXiv 1712.01887 §3.2): a rank sparsifies
    its velocity u ← m·u + g plus its residual E, not its gradient. The old velocity ``u`` is
    only read (a step that fails puts it back); ``x`` is the accumulation X = u + E that factor
    masking (:func:`mask_sent`) compares after the step. The operations are those of
    ``u.mul_(m).add_(g)`` then ``u + E`` (two roundings each, no fused multiply-add), so the
    bits are those of torch's or NumPy's separate passes.

    Parameters
    ----------
    u : ndarray of shape (n,), float32 or float64
        The velocity before the step (read only).
    m : real number
        The momentum coefficient, converted once to u's dtype.
    g : ndarray of shape (n,), u's dtype, writeable
        This rank's gradient; overwritten with the new velocity.
    out : ndarray of shape (n,), u's dtype, writeable
        Receives the new velocity; must not overlap ``u`` or ``g``.
    residual : ndarray of shape (n,), float32 or float64, optional
        The residual E before the step; given with ``x`` and only then. A residual wider than
        ``x`` is rounded to x's dtype first.
    x : ndarray of shape (n,), float32 or float64, writeable, optional
        Receives X = out + residual in x's dtype (the allreducer's work dtype).

    Returns
    -------
    ndarray
        out.

    Raises
    ------
    TypeError
        An array not float32/float64, ``g``'s or ``out``'s dtype not u's, or ``m`` not a real
        number.
    ValueError
        An array not 1-D or of another length than u; ``g``, ``out`` or ``x`` read-only;
        ``m`` not finite in u's dtype; ``g`` overlapping u, ``out`` overlapping u or g,
        ``residual`` overlapping g or out, ``x`` overlapping any other array; ``x`` without
        ``residual`` or ``residual`` without ``x``.
    """
    u = as_array(u, "u")
    _validate.check_work_array("u", u.ndim, u.dtype, True)
    g, out = _work_array(g, "g"), _work_array(out, "out")
    for name, a in (("g", g), ("out", out)):
        _validate.check_same_length(name, a.shape[0], "u", u.shape[0])
        _validate.check_same_dtype(name, a.dtype, "u", u.dtype)
    _validate.require(not np.shares_memory(g, u), "g", "overlaps u; u is only read")
    _validate.require(
        not np.shares_memory(out, u) and not np.shares_memory(out, g),
        "out",
        "overlaps u or g; the old velocity must stay as it was",
    )
    m = _momentum(m, u.dtype)
    if x is None:
        _validate.require(residual is None, "residual", "is read only with x; pass both or neither")
        x = residual = np.empty(0, u.dtype)
    else:
        _validate.require(residual is not None, "residual", "is required with x")
        x, residual = _work_array(x, "x"), as_array(residual, "residual")
        _validate.check_work_array("residual", residual.ndim, residual.dtype, True)
        for name, a in (("x", x), ("residual", residual)):
            _validate.check_same_length(name, a.shape[0], "u", u.shape[0])
        _validate.require(
            not any(np.shares_memory(residual, a) for a in (g, out)),
            "residual",
            "overlaps g or out, which the pass writes",
        )
        _validate.require(
            not any(np.shares_memory(x, a) for a in (u, g, out, residual)),
            "x",
            "overlaps u, g, out or residual",
        )
        if residual.dtype.itemsize > x.dtype.itemsize:
            # Rounded to x's dtype first, as torch's residual.to(x.dtype) + u: one rounding
            # of a wider sum would differ.
            residual = residual.astype(x.dtype)
    _accumulate_velocity(u, m, g, out, residual, x)
    return out


def mask_sent(u, residual, x):
    """Factor masking: ``u[i] = 0`` wherever ``residual[i] == 0`` and ``x[i] != 0``, in one pass.

    Deep Gradient Compression's momentum factor masking (arXiv 1712.01887 §3.2): a rank's
    velocity u is cleared where its accumulation X = u + E was sent, which is where the step left
    a zero residual though X was not zero. One pass where the mask's NumPy or torch form makes
    four (two comparisons, their conjunction, the masked write) and allocates three arrays.

    Parameters
    ----------
    u : ndarray of shape (n,), float32 or float64, writeable
        The velocity, masked in place.
    residual : ndarray of shape (n,), float32 or float64
        The residual E after the step.
    x : ndarray of shape (n,), float32 or float64
        The accumulation X the step selected from (u + E before the step).

    Returns
    -------
    ndarray
        u itself.

    Raises
    ------
    TypeError
        An array not float32/float64.
    ValueError
        An array not 1-D, u read-only, the lengths differ, or residual or x overlapping u.
    """
    u = _work_array(u, "u")
    residual, x = as_array(residual, "residual"), as_array(x, "x")
    for name, a in (("residual", residual), ("x", x)):
        _validate.check_work_array(name, a.ndim, a.dtype, True)
        _validate.check_same_length(name, a.shape[0], "u", u.shape[0])
        _validate.require(not np.shares_memory(a, u), name, "overlaps u, which the pass writes")
    _mask_sent(u, residual, x)
    return u


def _work_array(x, name="x"):
    a = in_place(x, name)
    _validate.check_work_array(name, a.ndim, a.dtype, a.flags.writeable)
    return a


def divide_max_abs(x, s, out=None):
    """``out = x / s``, and the largest magnitude of the quotients, in one pass.

    The pass a dense allreduce makes before it sums: each rank scales its gradient by 1/P into
    the buffer MPI reduces in place, and the largest magnitude, summed over the ranks, bounds
    every partial sum, so one number tells whether the sums can hold NaN or ±inf.

    Parameters
    ----------
    x : ndarray of shape (n,), float32 or float64
        The values to divide (a rank's gradient in its work dtype).
    s : real number, finite and non-zero
        The divisor (P for a mean, 1 for a sum), converted once to x's dtype.
    out : ndarray of shape (n,), x's dtype, writeable, optional
        Receives x / s; x itself (in place) when None or x. It may be x, and must otherwise not
        overlap it.

    Returns
    -------
    float
        max |x_i / s| over i (0.0 for n = 0), or ``inf`` if any quotient is NaN or ±inf.

    Raises
    ------
    TypeError
        x or out not float32/float64, out's dtype not x's, or s not a real number (bool
        included).
    ValueError
        x or out not 1-D, out read-only or of another length; s zero or not finite.

    Notes
    -----
    IEEE division in x's dtype, as NumPy's ``x / x.dtype.type(s)``; a NaN quotient is written as
    the canonical NaN (docs/design.md §3.4), so a dense mean is the same bits on every machine.
    The maximum is one of the quotients (fl(max |x_i| / |s|): rounding is monotone), so it is
    the same bits whatever order it is found in.
    """
    x = (in_place if out is None else as_array)(x, "x")  # written in place without out
    _validate.check_work_array("x", x.ndim, x.dtype, True)
    out = _work_array(x, "x") if out is None else _work_array(out, "out")
    _validate.check_same_length("out", out.shape[0], "x", x.shape[0])
    _validate.check_same_dtype("out", out.dtype, "x", x.dtype)
    if out is not x:
        _validate.require(
            not np.shares_memory(out, x), "out", "overlaps x; pass out=None to divide in place"
        )
    s = _validate.check_divisor_in(s, x.dtype)
    uint = np.dtype(f"uint{8 * x.dtype.itemsize}").type
    mask = np.iinfo(uint).max >> 1
    top = _divide_abs_bits(x, x.view(uint), uint(mask), s, out)
    if top >= np.array(np.inf, x.dtype).view(uint):  # inf or NaN among the x_i
        return float("inf")
    # Rounding is monotone, so the largest quotient is the largest |x_i| divided by |s|.
    peak = np.array(top, uint).view(x.dtype)[()] / abs(s)
    return float(peak) if np.isfinite(peak) else float("inf")


def canonical_count_nonfinite(x):
    """The number of NaN and ±inf entries of x, every NaN rewritten as the canonical NaN, in one
    pass (writes only where x is NaN).

    Parameters
    ----------
    x : ndarray of shape (n,), float32 or float64, writeable

    Returns
    -------
    int

    Raises
    ------
    TypeError
        x not float32/float64.
    ValueError
        x not 1-D or read-only.

    Notes
    -----
    docs/design.md §3.4: a dense allreduce's sum keeps no NaN payload of the MPI library's.
    """
    x = _work_array(x)
    return int(_canonical_count_nonfinite(x))


def canonicalize(x):
    """Every NaN of x rewritten, in place, as the canonical NaN of its dtype; returns x.

    Parameters
    ----------
    x : ndarray of shape (m,), float16, float32 or float64, writeable

    Returns
    -------
    ndarray
        x itself.

    Notes
    -----
    docs/design.md §3.4: float16 ``0x7E00``, float32 ``0x7FC00000``, float64
    ``0x7FF8000000000000``. Used by ``spardl``'s layer after the arithmetic it does in NumPy, so
    that its results have the device's bits (:func:`spardl_kernels.cuda.arrays.canonicalize`).

    Raises
    ------
    TypeError
        x not a float16/32/64 array in native byte order (the canonical bits are native), or
        something NumPy can only copy (a list).
    ValueError
        x not 1-D or read-only.
    """
    x = in_place(x, "x")
    _validate.check_canonical_target("x", x.ndim, x.dtype)
    _validate.require(x.flags.writeable, "x", "array is read-only; canonicalize writes into it")
    nan = np.isnan(x)
    if nan.any():
        x.view(_contract.BITS[x.dtype.name])[nan] = _contract.canonical_nan_bits(x.dtype)
    return x


def cast(a, dtype):
    """``a`` converted to ``dtype`` (a new array), with the same bits on every machine.

    Parameters
    ----------
    a : ndarray of shape (m,)
    dtype : dtype

    Returns
    -------
    ndarray of shape (m,), ``dtype``

    Notes
    -----
    The same dtype is a bit copy. float16 -> float32 is exact and float32 -> float16 rounds once
    (to nearest, ties to even; past ±65504 to ±inf), both by bit manipulation: a NaN keeps its
    sign and its payload's top bits, as in the kernels' float16 sums (docs/design.md §3.4), where
    NumPy's conversions may quiet a signalling NaN. Any other pair of float dtypes converts
    values and writes a NaN as the canonical NaN of ``dtype``; integer dtypes convert as
    ``astype``. The device twin is :func:`spardl_kernels.cuda.arrays.cast`.

    Raises
    ------
    TypeError
        ``a``'s dtype or ``dtype`` not in native byte order (a NaN's canonical bits are native).
    ValueError
        ``a`` not 1-D.
    """
    a, dt = as_array(a, "a"), np.dtype(dtype)
    _validate.check_cast_operand("a", a.ndim, a.dtype)
    _validate.require(
        dt.isnative, "dtype", lambda: f"must be in native byte order, got {dt}", TypeError
    )
    if a.dtype == dt:
        return np.array(a, copy=True)
    if (a.dtype.name, dt.name) == ("float16", "float32"):
        return widen_half(a)
    if (a.dtype.name, dt.name) == ("float32", "float16"):
        return narrow_half(np.ascontiguousarray(a))
    with np.errstate(over="ignore", invalid="ignore"):
        out = a.astype(dt)
    return canonicalize(out) if a.dtype.kind == "f" and dt.kind == "f" else out


# float16 <-> float32 with integer and float32 operations only: no branch (selects, which the
# loop vectoriser keeps), no subnormal float32 operand on the widening side, and no call into a
# runtime library (Numba has no float16 arithmetic on the CPU).
_F16_EXP = np.uint32(0x7C00 << 13)  # float16's exponent field, moved to float32's position
_F16_REBIAS = np.uint32((127 - 15) << 23)  # 112 added to the exponent: float16 to float32 bias
_F16_SUBNORMAL_BASE = np.float32(2.0**-14)  # float16's smallest normal, 113 << 23 in bits
_F32_HALF = np.uint32(126 << 23)  # 0.5f: adding it rounds below 2**-14 at float16's spacing


@njit(**JIT, inline="always")
def _widen_half(h):
    """The float32 value of the float16 with bits ``h`` (an int32 in [0, 65536)), exactly."""
    o = (h & 0x7FFF) << 13  # exponent and fraction at float32's positions
    e = o & _F16_EXP
    o += _F16_REBIAS
    o = o + _F16_REBIAS if e == _F16_EXP else o  # inf and NaN: float32's top exponent
    # A subnormal float16 (e = 0): its fraction on the exponent 2**-14, then 2**-14 taken off.
    sub = float_bits(bits_float32(np.int32(o + (1 << 23))) - _F16_SUBNORMAL_BASE)
    o = sub if e == 0 else o
    return bits_float32(np.int32(o | ((h & 0x8000) << 16)))


@njit(**JIT, inline="always")
def _narrow_half(f):
    """The bits (int32) of float32 ``f`` rounded to float16, to nearest, ties to even; a NaN
    gives float16's quiet NaN of the same sign, a magnitude from 65520 up gives ±inf."""
    u = float_bits(f)
    sign = (u >> 16) & 0x8000
    u &= 0x7FFFFFFF
    big = 0x7E00 if u > 0x7F800000 else 0x7C00  # NaN, else inf
    # Below 2**-14: adding 0.5 lets the float32 adder round at float16's subnormal spacing.
    tiny = float_bits(bits_float32(np.int32(u)) + bits_float32(np.int32(_F32_HALF))) - _F32_HALF
    # Normal: rebias, then round the 13 dropped bits to nearest, ties to the even fraction.
    normal = (u - (112 << 23) + 0xFFF + ((u >> 13) & 1)) >> 13
    o = big if u >= 0x47800000 else (tiny if u < 0x38800000 else normal)
    return o | sign


@njit(**JIT)
def _sum_half_bits(a, out):
    for i in range(a.shape[0]):
        s = _widen_half(np.int32(a[i])) + _widen_half(np.int32(out[i]))
        o = _narrow_half(s)
        # Every NaN sum is the positive quiet NaN, whichever operand was NaN (or inf − inf,
        # whose NaN the CPU signs): the sum is commutative bit for bit, as an MPI operation
        # declared commutative must be for every rank to get the same bits.
        out[i] = np.uint16(0x7E00 if (o & 0x7FFF) > 0x7C00 else o)


def sum_half(a, out):
    """``out[i] = float16(a[i] + out[i])`` for float16 arrays, in place: MPI's float16 sum.

    Parameters
    ----------
    a : ndarray of shape (n,), float16 or uint16 (float16 bits)
    out : ndarray of shape (n,), float16 or uint16 (float16 bits), writeable
        Receives the sums.

    Returns
    -------
    ndarray
        ``out``.

    Raises
    ------
    TypeError
        a or out neither float16 nor uint16.
    ValueError
        a or out not 1-D, out read-only, or of another length than a.

    Notes
    -----
    Each sum is IEEE 754 binary16 addition, rounded to nearest, ties to even, as the sum of
    the two values widened to float32 and rounded once to float16: float32 holds
    24 ≥ 2·11 + 2 bits, so its rounding before the final one cannot change it (the sum is the
    correctly rounded float16 sum of a and out). A sum of magnitude 65520 or more is ±inf; a
    NaN operand or inf − inf gives float16's positive quiet NaN 0x7E00 (sign and payload not
    kept), so that the sum is commutative bit for bit. ``a`` may be ``out`` itself; arrays that
    overlap otherwise are summed as given (``a`` is copied first). It is the
    reduction of the host 16-bit allreduce (:mod:`spardl.comm`), which MPI libraries that sum
    float16 in software run several times slower (docs/performance.md, "The 16-bit dense
    allreduce's own sum").
    """
    a, out = _checked_pass(a, "a", True, out, "out", True)
    _sum_half_bits(a.view(np.uint16), out.view(np.uint16))
    return out


@njit(**JIT)
def _scale_to_half_bits(x, f, out):
    for i in range(x.shape[0]):
        out[i] = np.uint16(_narrow_half(x[i] * f))


@njit(**JIT)
def _scale_from_half_bits(h, f, out):
    for i in range(h.shape[0]):
        out[i] = _widen_half(np.int32(h[i])) * f


def _checked_pass(src, src_name, src_half, dst, dst_name, dst_half):
    """``src`` and ``dst`` of a one-pass float16 kernel, checked: each float16 or uint16
    (float16 bits) where its ``*_half`` is true, else float32; both 1-D, of one length; ``dst``
    writeable. Errors name the argument."""
    src, dst = as_array(src, src_name), in_place(dst, dst_name)
    for name, v, half in ((src_name, src, src_half), (dst_name, dst, dst_half)):
        if half:
            ok, want = v.dtype in (np.float16, np.uint16), "float16 or uint16 (float16 bits)"
        else:
            ok, want = v.dtype == np.float32, "float32"
        _validate.require(ok, name, lambda v=v, w=want: f"must be {w}, got {v.dtype}", TypeError)
        _validate.require(v.ndim == 1, name, lambda v=v: f"must be 1-D, got shape {v.shape}")
    _validate.require(dst.flags.writeable, dst_name, "array is read-only; the pass writes it")
    _validate.check_same_length(dst_name, dst.shape[0], src_name, src.shape[0])
    if np.shares_memory(src, dst) and not _same_elements(src, dst):
        src = src.copy()  # the pass runs forward: it would read entries it has overwritten
    return src, dst


def _same_elements(a, b) -> bool:
    """Whether ``a`` and ``b`` are views of the same memory, element for element (entry i of
    each at one address, of one size), so that a pass reading a[i] then writing b[i] is safe."""
    return (
        a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.strides == b.strides
        and a.itemsize == b.itemsize
    )


def _half_pass_args(src, src_name, dst, dst_name, f, src_half):
    """The checked arrays and float32 factor of :func:`scale_to_half` / :func:`scale_from_half`."""
    src, dst = _checked_pass(src, src_name, src_half, dst, dst_name, not src_half)
    return src, dst, _validate.check_divisor_in(f, np.dtype(np.float32), "f")


def scale_to_half(x, f, out):
    """``out[i] = float16(x[i] · f)``: float32 values scaled and rounded to float16 in one pass.

    Parameters
    ----------
    x : ndarray of shape (n,), float32
    f : float
        The factor, a finite non-zero float32 (a power of two in the 16-bit allreduce, which
        makes the product exact).
    out : ndarray of shape (n,), float16 or uint16 (float16 bits), writeable

    Returns
    -------
    ndarray
        ``out``.

    Raises
    ------
    TypeError
        x not float32, out neither float16 nor uint16, f not a real number.
    ValueError
        x or out not 1-D, out read-only or of another length, f zero or not finite in float32.

    Notes
    -----
    The bits of NumPy's ``np.multiply(x, float32(f), out=out, casting="same_kind")`` for every
    number: the float32 product, rounded once to nearest float16 (ties to even), ±inf from
    65520 up; a NaN becomes float16's quiet NaN of its sign (its payload is not kept). Where
    ``x`` and ``out`` overlap, ``x`` is copied first. The 16-bit dense allreduce's step before
    MPI's sum (:mod:`spardl.algorithms.dense`), where NumPy's own conversion runs element by
    element.
    """
    x, out, f32 = _half_pass_args(x, "x", out, "out", f, src_half=False)
    _scale_to_half_bits(x, f32, out.view(np.uint16))
    return out


def scale_from_half(h, f, out):
    """``out[i] = float32(h[i]) · f``: float16 values widened (exactly) and scaled in one pass.

    Parameters
    ----------
    h : ndarray of shape (n,), float16 or uint16 (float16 bits)
    f : float
        The factor, a finite non-zero float32.
    out : ndarray of shape (n,), float32, writeable

    Returns
    -------
    ndarray
        ``out``.

    Raises
    ------
    TypeError
        h neither float16 nor uint16, out not float32, f not a real number.
    ValueError
        h or out not 1-D, out read-only or of another length, f zero or not finite in float32.

    Notes
    -----
    The bits of NumPy's ``np.multiply(h, float32(f), out=out)`` for every number (one float32
    multiplication of the exact value); a NaN stays a NaN. Where ``h`` and ``out`` overlap,
    ``h`` is copied first. The 16-bit dense allreduce's step after MPI's sum.
    """
    h, out, f32 = _half_pass_args(h, "h", out, "out", f, src_half=True)
    _scale_from_half_bits(h.view(np.uint16), f32, out)
    return out
