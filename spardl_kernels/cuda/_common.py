"""Host-side helpers of the CUDA kernels: coercion to device arrays, launch sizes, and the small
kernels every family uses (casts, exact float16 <-> float32 conversions, the canonical NaN,
arange, min/max and order checks, the device exclusive scan).

Launch parameters are read from :mod:`spardl_kernels.config` at call time; kernels that need
them at compile time (shared-memory sizes) are built by cached factories keyed on those values,
so a test can patch ``config.CUDA_THREADS_PER_BLOCK = 32`` and get small blocks.
"""

import functools

import numpy as np
from numba import cuda, int64

from .. import _contract, _validate, config
from .._contract import numba_device_array_types
from ._device import _gpu_block_exclusive_scan

INT64_MAX = int(np.iinfo(np.int64).max)
INT64_MIN = int(np.iinfo(np.int64).min)
# Values are moved as the integers of the same width (-0.0 and NaN payloads kept).
BITS = _contract.BITS
_DEVICE_TYPES = numba_device_array_types()


def is_numba_device_array(x):
    """True for Numba device arrays (real or the simulator's)."""
    return isinstance(x, _DEVICE_TYPES)


def to_device(x):
    """``x`` as a Numba device array, without copying device memory.

    Numba device arrays are returned as they are; objects exposing
    ``__cuda_array_interface__`` (torch CUDA tensors, CuPy) are wrapped by
    ``cuda.as_cuda_array`` (zero copy, same memory); anything else is a host array and is copied
    to the device (this happens only for the host arguments of a mixed call such as
    ``block_offsets(gpu_indices, host_bounds)``).
    """
    if is_numba_device_array(x):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return cuda.as_cuda_array(x)
    return cuda.to_device(np.ascontiguousarray(np.asarray(x)))


def to_host(x):
    """A host copy of a device array; host arrays are returned as they are."""
    if is_numba_device_array(x):
        return x.copy_to_host()
    if hasattr(x, "__cuda_array_interface__"):
        return cuda.as_cuda_array(x).copy_to_host()
    return x


def as_values(name, x):
    """Coerce and check a value array (1-D, float16/32/64) on the device."""
    a = to_device(x)
    _validate.check_values(name, a.ndim, a.dtype)
    return a


def as_indices(name, x):
    """Coerce and check an index array (1-D, int32/int64) on the device.

    An empty array of a non-index dtype (e.g. float64) is taken as empty int64, as on the CPU.
    """
    a = to_device(x)
    if a.ndim == 1 and a.shape[0] == 0 and np.dtype(a.dtype) not in _validate.INDEX_DTYPES:
        a = cuda.device_array(0, np.int64)
    _validate.check_indices(name, a.ndim, a.dtype)
    return a


def contiguous(a):
    """``a`` itself when C-contiguous, else a contiguous device copy (needed for bit views)."""
    if a.is_c_contiguous():
        return a
    out = cuda.device_array(a.shape[0], a.dtype)
    if a.shape[0]:
        launch(_copy, a.shape[0])(a, out)
    return out


def bits_of(a):
    """The bit pattern of a contiguous value array, as a signed integer array of its width."""
    return contiguous(a).view(BITS[np.dtype(a.dtype).name])


def empty(m, dtype):
    return cuda.device_array(int(m), np.dtype(dtype))


def read(a, i):
    """One element of a device array, on the host (a device -> host copy of one number)."""
    return a[i : i + 1].copy_to_host()[0]


# ---------------------------------------------------------------------------------------------
# launch sizes
# ---------------------------------------------------------------------------------------------


def tpb():
    return int(config.CUDA_THREADS_PER_BLOCK)


def items():
    return int(config.CUDA_ITEMS_PER_THREAD)


def blocks_for(work, threads):
    """Blocks for ``work`` units of ``threads`` each, capped by ``config.CUDA_MAX_BLOCKS``
    (kernels loop grid-stride over what a capped grid does not cover)."""
    b = max(1, -(-int(work) // threads))
    cap = int(config.CUDA_MAX_BLOCKS)
    return min(b, cap) if cap > 0 else b


def launch(kernel, work, threads=None):
    """``kernel[blocks, threads]`` for ``work`` elements handled one per thread, grid-stride."""
    t = tpb() if threads is None else threads
    return kernel[blocks_for(work, t), t]


# ---------------------------------------------------------------------------------------------
# small elementwise and reduction kernels
# ---------------------------------------------------------------------------------------------


@cuda.jit
def _copy(src, dst):
    # dst[i] = src[i] (a cast when the dtypes differ: float16 <-> float32, int32 -> int64)
    for i in range(cuda.grid(1), dst.shape[0], cuda.gridsize(1)):
        dst[i] = src[i]


@cuda.jit
def _arange(out):
    for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        out[i] = i


@cuda.jit
def _minmax(idx, res):
    # res = [min(idx), max(idx)]: a local reduction per thread, then one integer atomic each
    lo = INT64_MAX
    hi = INT64_MIN
    for i in range(cuda.grid(1), idx.shape[0], cuda.gridsize(1)):
        v = int64(idx[i])
        lo = min(lo, v)
        hi = max(hi, v)
    if lo != INT64_MAX:
        cuda.atomic.min(res, 0, lo)
        cuda.atomic.max(res, 1, hi)


@cuda.jit
def _first_violation(idx, strict, res):
    # res[0] = first i where the order breaks: strict -> idx[0] < 0 or idx[i-1] >= idx[i];
    # not strict -> idx[i-1] > idx[i]. An integer atomic min gives the first one whatever the
    # thread order.
    m = idx.shape[0]
    for i in range(cuda.grid(1), m, cuda.gridsize(1)):
        bad = False
        if i == 0:
            bad = strict and idx[0] < 0
        elif strict:
            bad = idx[i - 1] >= idx[i]
        else:
            bad = idx[i - 1] > idx[i]
        if bad:
            cuda.atomic.min(res, 0, int64(i))


@cuda.jit
def _half_to_single_bits(h, out):
    # out[i] = the float32 bits of the float16 with bits h[i], exactly, NaN payloads and
    # signalling NaNs kept (the CPU's cpu._common._half_to_single_bits, in integers only)
    for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        b = int64(h[i]) & 0xFFFF
        sign = (b & 0x8000) << 16
        e = (b >> 10) & 0x1F
        m = b & 0x3FF
        if e == 0x1F:
            r = sign | 0x7F800000 | (m << 13)
        elif e != 0:
            r = sign | ((e + 112) << 23) | (m << 13)
        elif m == 0:
            r = sign
        else:
            shift = 0
            while (m & 0x400) == 0:
                m <<= 1
                shift += 1
            r = sign | ((113 - shift) << 23) | ((m & 0x3FF) << 13)
        out[i] = r


@cuda.jit
def _single_to_half(w, wbits, out, out_bits):
    # out[i] = w[i] rounded to float16 (to nearest, ties to even); a NaN keeps its sign and the
    # top 10 bits of its payload, written as bits (cpu._common.narrow_half)
    for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        b = int64(wbits[i]) & 0xFFFFFFFF
        if (b & 0x7FFFFFFF) > 0x7F800000:
            m = (b >> 13) & 0x3FF
            if m == 0:
                m = 0x200
            out_bits[i] = ((b >> 16) & 0x8000) | 0x7C00 | m
        else:
            out[i] = w[i]


def widen_half(a):
    """float16 device values as a new float32 device array, exactly (NaN bits included)."""
    m = a.shape[0]
    out = empty(m, np.float32)
    if m:
        launch(_half_to_single_bits, m)(bits_of(a), out.view(np.uint32))
    return out


def narrow_half(w):
    """float32 device values rounded once to float16, NaN bits as :func:`widen_half`'s inverse
    (the canonical float32 NaN becomes the canonical float16 one): a new device array."""
    m = w.shape[0]
    out = empty(m, np.float16)
    if m:
        launch(_single_to_half, m)(w, bits_of(w), out, out.view(np.uint16))
    return out


def canonical_nan(dtype):
    """The canonical NaN of ``dtype`` as a NumPy scalar of that dtype (its bits are
    ``_contract.CANONICAL_NAN_BITS``): passed to the kernels that write it, so that it reaches
    memory as bits, never through a conversion."""
    return _contract.canonical_nan_bits(dtype).view(np.dtype(dtype))


def cast(a, dtype):
    """A device copy of ``a`` in ``dtype`` (float16 -> float32 is exact)."""
    out = empty(a.shape[0], dtype)
    if a.shape[0]:
        launch(_copy, a.shape[0])(a, out)
    return out


def arange(m):
    out = empty(m, np.int64)
    if m:
        launch(_arange, m)(out)
    return out


def min_max(idx):
    """(min, max) of a non-empty device index array, as Python ints (one small copy back)."""
    res = cuda.to_device(np.array([INT64_MAX, INT64_MIN], np.int64))
    launch(_minmax, idx.shape[0])(idx, res)
    lo, hi = res.copy_to_host()
    return int(lo), int(hi)


def first_violation(idx, strict):
    """First position where ``idx`` is not sorted (strict: not sorted unique non-negative),
    or -1. See ``_first_violation``."""
    m = idx.shape[0]
    if m == 0:
        return -1
    res = cuda.to_device(np.array([INT64_MAX], np.int64))
    launch(_first_violation, m)(idx, bool(strict), res)
    pos = int(res.copy_to_host()[0])
    return -1 if pos == INT64_MAX else pos


def ends(a):
    """``(a[0], a[-1])`` of a non-empty device array as Python ints (each copied back)."""
    return int(a[0]), int(a[a.shape[0] - 1])


def check_range(idx, n):
    """ValueError unless every index lies in [0, n) (the CPU kernels' message)."""
    if idx.shape[0] == 0:
        return
    lo, hi = min_max(idx) if n > 0 else (-1, -1)
    _validate.require(0 <= lo and hi < n, "indices", f"every index must lie in [0, n = {n})")


# ---------------------------------------------------------------------------------------------
# exclusive scan of an int64 device array
# ---------------------------------------------------------------------------------------------


@functools.cache
def _scan_kernels(TPB, ITEMS):
    TILE = TPB * ITEMS

    @cuda.jit
    def scan_tiles(a, out, sums):
        # Each block scans tiles of TILE elements: thread t sums its ITEMS consecutive ones,
        # a block-wide scan of those sums gives its starting offset, then it writes its run.
        sh = cuda.shared.array(TPB, int64)
        tid = cuda.threadIdx.x
        m = a.shape[0]
        ntiles = sums.shape[0]
        for tile in range(cuda.blockIdx.x, ntiles, cuda.gridDim.x):
            base = tile * TILE + tid * ITEMS
            s = int64(0)
            for j in range(ITEMS):
                if base + j < m:
                    s += a[base + j]
            run, total = _gpu_block_exclusive_scan(sh, tid, TPB, s)
            for j in range(ITEMS):
                if base + j < m:
                    v = a[base + j]
                    out[base + j] = run
                    run += v
            if tid == 0:
                sums[tile] = total
                if ntiles == 1:
                    out[m] = total
            cuda.syncthreads()

    @cuda.jit
    def add_offsets(out, offs):
        # out[i] += offs[tile of i]; out[m] = grand total
        m = out.shape[0] - 1
        for i in range(cuda.grid(1), m + 1, cuda.gridsize(1)):
            if i < m:
                out[i] += offs[i // TILE]
            else:
                out[m] = offs[offs.shape[0] - 1]

    return scan_tiles, add_offsets, TILE


def exclusive_scan(a):
    """Exclusive prefix sums of an int64 device array ``a`` of length m.

    Returns an int64 device array of length m + 1: ``out[i] = a[0] + ... + a[i-1]``, ``out[m]``
    the total. Tiles of ``CUDA_THREADS_PER_BLOCK * CUDA_ITEMS_PER_THREAD`` are scanned per block,
    their totals scanned recursively and added back. Integer sums: exact, order-free.
    """
    m = a.shape[0]
    out = empty(m + 1, np.int64)
    if m == 0:
        launch(_arange, 1)(out)  # out = [0]
        return out
    T = tpb()
    scan_tiles, add_offsets, TILE = _scan_kernels(T, items())
    ntiles = -(-m // TILE)
    sums = empty(ntiles, np.int64)
    scan_tiles[blocks_for(ntiles, 1), T](a, out, sums)
    if ntiles > 1:
        offs = exclusive_scan(sums)
        launch(add_offsets, m + 1)(out, offs)
    return out
