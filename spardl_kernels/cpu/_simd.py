"""Hit masks of 64 consecutive entries as one vector compare (LLVM IR through Numba intrinsics).

Every selection scan asks, 64 entries at a time, which of them pass a test (key >= K, or
``not (|v| < t)``), as the bits of one 64-bit word. Written as a loop
(``m |= uint64(test(l)) << l``), LLVM's loop vectoriser widens each lane's bit to 64 bits and
shifts it into place: on AVX2 about ten instructions per 8 entries, so the scans ran at about
half the speed of a copy. Here the 64 entries are one ``<64 x T>`` load, one vector compare, and
a ``bitcast <64 x i1> to i64``, which the x86 backend lowers to vector compares, packs and
``vpmovmskb`` (8 float32 compares and 2 ``vpmovmskb`` per 64 entries with AVX2); other targets
get their own lowering of the same IR. ``select_above`` at n = 2**20 took 0.6–0.7 of its earlier
time (docs/performance.md, "Vector masks, and no page faults per call").

The functions read ``a[s : s + 64]``; callers pass only full blocks (s + 64 <= len(a)), which
is checked when Numba's bounds checking is on (``NUMBA_BOUNDSCHECK=1``). Arrays that are not
C-contiguous are read element by element (same result).
"""

import warnings

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.core.errors import NumbaIRAssumptionWarning
from numba.extending import intrinsic, overload

from .. import _contract
from ._common import canonical

# Numba's SSA check reports the mask of sum_mask's per-entry loop (below), once inlined into
# a scan, as "not in scope" (NumbaIRAssumptionWarning, "an internal pedantic check"); the
# compiled code is right (the kernel tests compare it with NumPy bit for bit), and the
# variants without the warning either run the streamed scans at a sixth of their speed (a
# called helper's reference counts between the non-temporal stores) or keep the warning.
warnings.filterwarnings(
    "ignore", message=r"variable '_sum_mask__locals__", category=NumbaIRAssumptionWarning
)

_LANES = 64


def _check_block(context, builder, ary, s):
    """With Numba's bounds checking on, the check that a[s : s + 64] lies inside the array."""
    if context.enable_boundscheck:
        length = cgutils.unpack_tuple(builder, ary.shape, 1)[0]
        cgutils.do_boundscheck(context, builder, s, length, 0)
        last = builder.add(s, ir.Constant(context.get_value_type(types.intp), _LANES - 1))
        cgutils.do_boundscheck(context, builder, last, length, 0)


def _block(context, builder, aryty, ary_v, s):
    """The 64 entries a[s : s + 64] as an LLVM vector (one load for a C-contiguous array)."""
    ary = context.make_array(aryty)(context, builder, ary_v)
    elem = context.get_data_type(aryty.dtype)
    vecty = ir.VectorType(elem, _LANES)
    intp = context.get_value_type(types.intp)
    _check_block(context, builder, ary, s)
    if aryty.layout == "C":
        ptr = builder.bitcast(builder.gep(ary.data, [s]), vecty.as_pointer())
        return builder.load(ptr, align=aryty.dtype.bitwidth // 8)
    vec = ir.Constant(vecty, ir.Undefined)
    for lane in range(_LANES):
        i = builder.add(s, ir.Constant(intp, lane))
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [i])
        vec = builder.insert_element(vec, builder.load(ptr), ir.Constant(ir.IntType(32), lane))
    return vec


def _splat(builder, value, vecty):
    undef = ir.Constant(vecty, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(ir.IntType(32), _LANES), 0))


def _mask_word(builder, cmp):
    return builder.bitcast(cmp, ir.IntType(_LANES))


@intrinsic
def mask64_key_ge(typingctx, a, s, K, mask):
    """Bit l of the result (uint64) is set iff ``(a[s + l] & mask) >= K`` (signed), l < 64.

    ``a``: an integer array (the key view of float16/32/64 values); ``K`` and ``mask`` are cast
    to a's integer type, as ``a.dtype.type(K)`` does.
    """
    if not (
        isinstance(a, types.Array)
        and a.ndim == 1
        and isinstance(a.dtype, types.Integer)
        and isinstance(s, types.Integer)
        and isinstance(K, types.Integer)
        and isinstance(mask, types.Integer)
    ):
        return None
    sig = types.uint64(a, types.intp, a.dtype, a.dtype)

    def codegen(context, builder, signature, args):
        a_v, s_v, K_v, mask_v = args
        vec = _block(context, builder, signature.args[0], a_v, s_v)
        keys = builder.and_(vec, _splat(builder, mask_v, vec.type))
        return _mask_word(builder, builder.icmp_signed(">=", keys, _splat(builder, K_v, vec.type)))

    return sig, codegen


@intrinsic
def mask64_not_below(typingctx, x, s, t):
    """Bit l of the result (uint64) is set iff ``not (|x[s + l]| < t)``, l < 64: |x| >= t, or
    x is NaN (an unordered compare).

    ``x``: a float32 or float64 array; ``t`` is cast to its dtype.
    """
    if not (
        isinstance(x, types.Array)
        and x.ndim == 1
        and isinstance(x.dtype, types.Float)
        and isinstance(s, types.Integer)
        and isinstance(t, (types.Float, types.Integer))
    ):
        return None
    sig = types.uint64(x, types.intp, x.dtype)

    def codegen(context, builder, signature, args):
        x_v, s_v, t_v = args
        vec = _block(context, builder, signature.args[0], x_v, s_v)
        fabs = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(vec.type, [vec.type]),
            f"llvm.fabs.v{_LANES}f{signature.args[0].dtype.bitwidth}",
        )
        mag = builder.call(fabs, [vec])
        # "uge": true when unordered (NaN) or >=, i.e. not (|x| < t)
        uge = builder.fcmp_unordered(">=", mag, _splat(builder, t_v, vec.type))
        return _mask_word(builder, uge)

    return sig, codegen


@intrinsic
def popcount64(typingctx, m):
    """The number of set bits of the uint64 ``m`` (``llvm.ctpop``: one ``popcnt``)."""
    if not isinstance(m, types.Integer):
        return None
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        word = context.cast(builder, args[0], signature.args[0], types.uint64)
        ctpop = builder.module.declare_intrinsic("llvm.ctpop", [ir.IntType(64)])
        return builder.call(ctpop, [word])

    return sig, codegen


@intrinsic
def lowest_set_bit(typingctx, m):
    """(position of the lowest set bit of the non-zero uint64 ``m``, m with that bit cleared):
    ``llvm.cttz`` and ``m & (m - 1)``, one ``tzcnt`` and one ``blsr`` with BMI.

    ``m`` must be non-zero (cttz of zero is declared poison, which lets LLVM drop the test).
    """
    if not isinstance(m, types.Integer):
        return None
    sig = types.Tuple((types.int64, types.uint64))(types.uint64)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        word = context.cast(builder, args[0], signature.args[0], types.uint64)
        cttz = builder.module.declare_intrinsic("llvm.cttz", [i64, ir.IntType(1)])
        pos = builder.call(cttz, [word, ir.Constant(ir.IntType(1), 1)])
        rest = builder.and_(word, builder.sub(word, ir.Constant(i64, 1)))
        return context.make_tuple(builder, signature.return_type, [pos, rest])

    return sig, codegen


# ---------------------------------------------------------------------------------------------
# the masks of a block that may be short (the last block of a scan)
# ---------------------------------------------------------------------------------------------
# A short last block [s, stop) is read as the 64 entries that end at stop, shifted down by the
# overlap, so a scan's loop has one code path for every block (with a branch to a per-entry
# loop for the last block, a select scan at n = 2**20 took about 1.5x as long in a
# micro-benchmark). Only arrays of fewer than 64 entries take the per-entry loop (a test that
# does not change within a scan).


@njit(inline="always", cache=True, nogil=True)
def _shift_down(m, shift):
    """m >> shift for 0 <= shift <= 64 (64: an empty block, zero; a shift by the word's width
    is undefined in LLVM and returns m unchanged on x86)."""
    return m >> np.uint64(shift) if shift < _LANES else np.uint64(0)


@njit(inline="always", cache=True, nogil=True)
def hit_mask(a, s, stop, K_t, mask_t):
    """Bit l set iff key(a[s + l]) >= K, i.e. ``(a[s + l] & mask) >= K``, for s + l in
    [s, min(s + 64, stop)), stop <= len(a) (zero when s >= stop). No NaN clamp is needed: a
    NaN's key is above every K <= nan_key."""
    if stop >= _LANES:
        r = min(s, stop - _LANES)
        return _shift_down(mask64_key_ge(a, r, K_t, mask_t), s - r)
    m = np.uint64(0)
    for l in range(stop - s):
        m |= np.uint64((a[s + l] & mask_t) >= K_t) << np.uint64(l)
    return m


def not_below_mask(x, s, stop, t):
    """Bit l set iff ``not (|x[s + l]| < t)``, for s + l in [s, min(s + 64, stop)),
    stop <= len(x) (zero when s >= stop).

    Compiled code only. ``x`` is a float array, or for float16 values (no float type in
    Numba's CPU target) their integer view, which the callers never reach this with (their
    ``usable`` is False) but which must still compile.
    """
    raise NotImplementedError("not_below_mask is called from compiled code only")


@njit(inline="always", cache=True, nogil=True)
def _not_below_loop(x, s, stop, t):
    m = np.uint64(0)
    for l in range(stop - s):
        m |= np.uint64(not (abs(x[s + l]) < t)) << np.uint64(l)
    return m


@overload(not_below_mask, inline="always")
def _not_below_mask(x, s, stop, t):
    if isinstance(x.dtype, types.Float):

        def impl(x, s, stop, t):
            if stop >= _LANES:
                r = min(s, stop - _LANES)
                return _shift_down(mask64_not_below(x, r, t), s - r)
            return _not_below_loop(x, s, stop, t)

        return impl

    def loop(x, s, stop, t):
        return _not_below_loop(x, s, stop, t)

    return loop


# ---------------------------------------------------------------------------------------------
# X = g + e written 64 sums at a time, with the hit mask of the sums (the summing scans)
# ---------------------------------------------------------------------------------------------
# The summing scans (accumulate_topk's window pass, accumulate_above) write X = g + e and test
# the sums in the same loop. With ``stream``, a block of sums whose address is 64-byte aligned
# is written with non-temporal stores: X then goes to memory without first being read into the
# cache (a normal store reads each line before writing it), one stream of the pass's four
# fewer. The scans never read X back while they run (a hit's bits are those of the sum in
# registers, recomputed from g and e), and end with a fence, so later reads of X see every
# sum. Worth it only when X is far larger than the caches: a small X read again soon after
# would come back from memory instead of the cache (``config.STREAM_STORE_MIN_BYTES``).

_STREAM_ALIGN = 64


def _sum_block(context, builder, signature, args):
    """The canonical sums g[s:s+64] + e[s:s+64] as a vector, stored into out[s:s+64]."""
    g_v, e_v, out_v, s_v, stream_v = args[:5]
    gty, ety, outty = signature.args[:3]
    z = builder.fadd(
        _block(context, builder, gty, g_v, s_v), _block(context, builder, ety, e_v, s_v)
    )
    bitwidth = gty.dtype.bitwidth
    ivec = ir.VectorType(ir.IntType(bitwidth), _LANES)
    nan_bits = int(_contract.CANONICAL_NAN_BITS[f"float{bitwidth}"])
    nan = builder.bitcast(ir.Constant(ivec, [nan_bits] * _LANES), z.type)
    z = builder.select(builder.fcmp_unordered("uno", z, z), nan, z)
    out = context.make_array(outty)(context, builder, out_v)
    intp = context.get_value_type(types.intp)
    _check_block(context, builder, out, s_v)
    if outty.layout != "C":
        for lane in range(_LANES):
            i = builder.add(s_v, ir.Constant(intp, lane))
            ptr = cgutils.get_item_pointer(context, builder, outty, out, [i])
            builder.store(builder.extract_element(z, ir.Constant(ir.IntType(32), lane)), ptr)
        return z
    ptr = builder.bitcast(builder.gep(out.data, [s_v]), z.type.as_pointer())
    addr = builder.ptrtoint(ptr, intp)
    aligned = builder.icmp_unsigned(
        "==", builder.and_(addr, ir.Constant(intp, _STREAM_ALIGN - 1)), ir.Constant(intp, 0)
    )
    with builder.if_else(builder.and_(_as_bit(builder, stream_v), aligned)) as (
        streamed,
        cached,
    ):
        with streamed:
            st = builder.store(z, ptr, align=_STREAM_ALIGN)
            st.set_metadata(
                "nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
            )
        with cached:
            builder.store(z, ptr, align=bitwidth // 8)
    return z


def _as_bit(builder, flag):
    """A boolean argument as an i1 (Numba passes booleans as i1 or i8)."""
    if flag.type.width == 1:
        return flag
    return builder.icmp_unsigned("!=", flag, ir.Constant(flag.type, 0))


def _float_arrays(*arrays):
    return (
        all(
            isinstance(a, types.Array) and a.ndim == 1 and isinstance(a.dtype, types.Float)
            for a in arrays
        )
        and len({a.dtype for a in arrays}) == 1
    )


@intrinsic
def sum64_not_below(typingctx, g, e, out, s, stream, t):
    """out[s:s+64] = g + e (a NaN sum canonical; streamed when ``stream`` and the block is
    64-byte aligned); bit l of the result (uint64) is set iff ``not (|sum_l| < t)``."""
    if not (_float_arrays(g, e, out) and isinstance(s, types.Integer)):
        return None
    sig = types.uint64(g, e, out, types.intp, types.boolean, g.dtype)

    def codegen(context, builder, signature, args):
        z = _sum_block(context, builder, signature, args)
        fabs = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(z.type, [z.type]),
            f"llvm.fabs.v{_LANES}f{signature.args[0].dtype.bitwidth}",
        )
        uge = builder.fcmp_unordered(
            ">=", builder.call(fabs, [z]), _splat(builder, args[5], z.type)
        )
        return _mask_word(builder, uge)

    return sig, codegen


@intrinsic
def sum64_key_ge(typingctx, g, e, out, s, stream, K, mask):
    """out[s:s+64] = g + e as :func:`sum64_not_below` writes it; bit l of the result (uint64)
    is set iff ``(bits(sum_l) & mask) >= K`` (signed, in the sums' integer width)."""
    if not (_float_arrays(g, e, out) and isinstance(s, types.Integer)):
        return None
    ity = types.int32 if g.dtype.bitwidth == 32 else types.int64
    sig = types.uint64(g, e, out, types.intp, types.boolean, ity, ity)

    def codegen(context, builder, signature, args):
        z = _sum_block(context, builder, signature, args)
        ivec = ir.VectorType(ir.IntType(signature.args[0].dtype.bitwidth), _LANES)
        keys = builder.and_(builder.bitcast(z, ivec), _splat(builder, args[6], ivec))
        return _mask_word(builder, builder.icmp_signed(">=", keys, _splat(builder, args[5], ivec)))

    return sig, codegen


@intrinsic
def float_bits(typingctx, v):
    """The bits of a float32/float64 as int32/int64 (an integer is returned as it is)."""
    if isinstance(v, types.Integer):
        return v(v), lambda context, builder, signature, args: args[0]
    if not isinstance(v, types.Float):
        return None
    ity = types.int32 if v.bitwidth == 32 else types.int64

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(v.bitwidth))

    return ity(v), codegen


@intrinsic
def bits_float32(typingctx, b):
    """The float32 whose bits are the 32-bit integer ``b`` (the inverse of :func:`float_bits`)."""
    if not isinstance(b, types.Integer) or b.bitwidth != 32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(b), codegen


@intrinsic
def store_fence(typingctx):
    """A full memory fence (``mfence`` on x86): orders the non-temporal stores before it with
    every later load and store."""

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@njit(inline="always", cache=True, nogil=True)
def stream_head(out, n, stream):
    """How many leading entries of ``out`` (at most n) come before its first 64-byte aligned
    address, where a summing scan starts its blocks so that they can be streamed; 0 without
    ``stream``."""
    if not stream:
        return 0
    item = out.itemsize
    return min(n, ((_STREAM_ALIGN - out.ctypes.data % _STREAM_ALIGN) % _STREAM_ALIGN) // item)


def sum_mask(g, e, out, s, stop, stream, usable, t, K_t, mask_t):
    """out[i] = g[i] + e[i] (a NaN sum canonical) for i in [s, min(s + 64, stop)), and the hit
    mask of those sums: ``not (|sum| < t)`` with ``usable``, else ``(bits(sum) & mask) >= K``.

    Compiled code only; stop <= len(g). A short last block is summed as the 64 entries that end
    at stop (rewriting earlier sums with the same values) and shifted, as :func:`hit_mask`
    reads it; arrays of fewer than 64 entries are summed and tested entry by entry. Integer
    arrays (the bit views a non-summing scan is typed with) compile to the per-entry loop.
    """
    raise NotImplementedError("sum_mask is called from compiled code only")


@njit(inline="always", cache=True, nogil=True)
def _sum_mask_loop(g, e, out, s, stop, usable, t, K_t, mask_t):
    m = np.uint64(0)
    for l in range(stop - s):
        v = canonical(g[s + l] + e[s + l])
        out[s + l] = v
        # bitwise, not `and`/`or`: no branches in a loop that is inlined into the scans
        hit = (usable & (not (abs(v) < t))) | ((not usable) & ((float_bits(v) & mask_t) >= K_t))
        m |= np.uint64(hit) << np.uint64(l)
    return m


@overload(sum_mask, inline="always")
def _sum_mask(g, e, out, s, stop, stream, usable, t, K_t, mask_t):
    if _float_arrays(g, e, out):

        def impl(g, e, out, s, stop, stream, usable, t, K_t, mask_t):
            if stop >= _LANES:
                r = min(s, stop - _LANES)
                if usable:
                    return _shift_down(sum64_not_below(g, e, out, r, stream, t), s - r)
                return _shift_down(sum64_key_ge(g, e, out, r, stream, K_t, mask_t), s - r)
            return _sum_mask_loop(g, e, out, s, stop, usable, t, K_t, mask_t)

        return impl

    def loop(g, e, out, s, stop, stream, usable, t, K_t, mask_t):
        return _sum_mask_loop(g, e, out, s, stop, usable, t, K_t, mask_t)

    return loop
