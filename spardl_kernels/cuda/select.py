"""Selection kernels on the GPU: top-k by magnitude, thresholds and their estimates.

CUDA twins of :mod:`spardl_kernels.cpu.select`, with the same keys (the bits of |x| with the
sign bit cleared, NaN clamped just above +inf), so they order entries by the contract's total
order (docs/design.md §3) and give the CPU's results bit for bit.

* Radix select (``topk_abs``, ``kth_largest_abs``, ``estimate_threshold``): one pass over x per
  digit of ``config.CUDA_RADIX_BITS`` bits, from the most significant down. A pass builds the
  histogram of the current digit over the keys that share the digits chosen so far
  (shared-memory histogram per block, integer atomics, then one global atomic per non-empty
  bin); a single-thread kernel walks the histogram down to the digit that holds the k-th key
  and updates the device-side state ``[prefix, need]``. No host round trip until the end.
* Compaction (``select_above``, the output of ``topk_abs``): a count pass writes per-tile counts,
  an exclusive scan turns them into output offsets, and a write pass scans the tile's flags
  block-wide and writes every selected index at its offset, so indices come out ascending
  without a sort. Ties at the threshold key are taken lowest index first by ranking them with
  the same scan.
"""

import functools
import math

import numpy as np
from numba import cuda, int8, int32, int64

from .. import _validate, config
from .._contract import KEY_BITS, key_info, key_to_value, threshold_key
from . import _common as C
from ._device import _gpu_block_exclusive_scan, _gpu_key, _gpu_splitmix64

_M32 = 0xFFFFFFFF


def _digit_widths(key_bits, radix_bits):
    """Digit widths from the most significant key bit down; only the first may be narrower."""
    passes = -(-key_bits // radix_bits)
    return [key_bits - radix_bits * (passes - 1)] + [radix_bits] * (passes - 1)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------


@functools.cache
def _radix_kernels(TPB, BINS):
    @cuda.jit
    def histogram(bits, mask, nan_key, state, shift, width, hist):
        # hist[d] += #{i : key_i >> (shift + width) == state[0], digit (key_i >> shift) == d}
        sh = cuda.shared.array(BINS, int32)
        tid = cuda.threadIdx.x
        for b in range(tid, BINS, TPB):
            sh[b] = 0
        cuda.syncthreads()
        prefix = state[0]
        high = shift + width
        nb = int64(1) << width
        for i in range(cuda.grid(1), bits.shape[0], cuda.gridsize(1)):
            key = _gpu_key(bits[i], mask, nan_key)
            if (key >> high) == prefix:
                cuda.atomic.add(sh, (key >> shift) & (nb - 1), 1)
        cuda.syncthreads()
        for b in range(tid, BINS, TPB):
            c = sh[b]
            if c != 0:
                cuda.atomic.add(hist, b, int64(c))

    @cuda.jit
    def pick(hist, width, state):
        # One thread: the highest digit d with sum(hist[d:]) >= need (need = state[1] of the
        # keys sharing the prefix are still to be selected); append d to the prefix, subtract
        # what lies above it, and clear the histogram for the next pass.
        if cuda.grid(1) == 0:
            nb = int64(1) << width
            need = state[1]
            above = int64(0)
            d = nb - 1
            while d > 0 and above + hist[d] < need:
                above += hist[d]
                d -= 1
            state[1] = need - above
            state[0] = (state[0] << width) | d
            for j in range(nb):
                hist[j] = 0

    return histogram, pick


@functools.cache
def _count_tiles_kernel(TPB, ITEMS):
    """The first compaction kernel for blocks of TPB threads and tiles of TPB * ITEMS keys."""
    TILE = TPB * ITEMS

    @cuda.jit
    def count_tiles(bits, mask, nan_key, state, cnt_gt, cnt_eq):
        # per tile: how many keys > T and == T (T = state[0]); coalesced reads
        sh = cuda.shared.array(2, int32)
        tid = cuda.threadIdx.x
        n = bits.shape[0]
        T = state[0]
        for tile in range(cuda.blockIdx.x, cnt_gt.shape[0], cuda.gridDim.x):
            if tid == 0:
                sh[0] = 0
                sh[1] = 0
            cuda.syncthreads()
            g = 0
            e = 0
            for j in range(ITEMS):
                i = tile * TILE + j * TPB + tid
                if i < n:
                    key = _gpu_key(bits[i], mask, nan_key)
                    g += key > T
                    e += key == T
            if g != 0:
                cuda.atomic.add(sh, 0, g)
            if e != 0:
                cuda.atomic.add(sh, 1, e)
            cuda.syncthreads()
            if tid == 0:
                cnt_gt[tile] = sh[0]
                cnt_eq[tile] = sh[1]
            cuda.syncthreads()

    return count_tiles


@cuda.jit(device=True)
def _gpu_write_run(flags, first, items, start, bits, gr, er, ties, out_idx, out_bits):
    """Write one thread's run flags[first:first + items] of a tile that starts at index
    ``start``: a key > T (flag 1) goes to gr + min(er, ties), a key == T (flag 2) to gr + er
    while er < ties; gr and er are the counts of each kind before the run."""
    for j in range(items):
        local = first + j
        f = flags[local]
        i = start + local
        if f == 1:
            pos = gr + min(er, ties)
            out_idx[pos] = i
            out_bits[pos] = bits[i]
            gr += 1
        elif f == 2:
            if er < ties:
                pos = gr + er
                out_idx[pos] = i
                out_bits[pos] = bits[i]
            er += 1


@functools.cache
def _write_tiles_kernel(TPB, ITEMS):
    """The second compaction kernel (same TPB and ITEMS as :func:`_count_tiles_kernel`)."""
    TILE = TPB * ITEMS

    @cuda.jit
    def write_tiles(bits, mask, nan_key, state, off_gt, off_eq, out_idx, out_bits):
        # Take every key > T and the first `ties` = state[1] keys == T, in index order.
        # An entry's output position is (#keys > T before it) + min(#keys == T before it, ties).
        flags = cuda.shared.array(TILE, int8)
        sh = cuda.shared.array(TPB, int64)
        tid = cuda.threadIdx.x
        n = bits.shape[0]
        T = state[0]
        ties = state[1]
        ntiles = off_gt.shape[0] - 1
        for tile in range(cuda.blockIdx.x, ntiles, cuda.gridDim.x):
            start = tile * TILE
            # flags in a coalesced layout: 1 = key > T, 2 = key == T, 0 = neither (or past n)
            for j in range(ITEMS):
                local = j * TPB + tid
                i = start + local
                f = 0
                if i < n:
                    key = _gpu_key(bits[i], mask, nan_key)
                    if key > T:
                        f = 1
                    elif key == T:
                        f = 2
                flags[local] = f
            cuda.syncthreads()
            # thread tid owns the ITEMS consecutive entries tid*ITEMS ...; both counts are
            # scanned at once, packed as (gt << 32) | eq (a tile holds far fewer than 2**32)
            g = int64(0)
            e = int64(0)
            for j in range(ITEMS):
                f = flags[tid * ITEMS + j]
                g += f == 1
                e += f == 2
            before, _ = _gpu_block_exclusive_scan(sh, tid, TPB, (g << 32) | e)
            gr = off_gt[tile] + (before >> 32)
            er = off_eq[tile] + (before & _M32)
            _gpu_write_run(flags, tid * ITEMS, ITEMS, start, bits, gr, er, ties, out_idx, out_bits)
            cuda.syncthreads()

    return write_tiles


def _compact_kernels(TPB, ITEMS):
    """(count_tiles, write_tiles, TILE) of the count/scan/write compaction for blocks of TPB
    threads and tiles of TILE = TPB * ITEMS keys (each kernel cached per launch shape)."""
    return _count_tiles_kernel(TPB, ITEMS), _write_tiles_kernel(TPB, ITEMS), TPB * ITEMS


@cuda.jit
def _count_ge(bits, K, mask, res):
    # res[0] += #{i : key_i >= K}; a NaN key (above nan_key) needs no clamp to pass K <= nan_key
    sh = cuda.shared.array(1, int64)
    if cuda.threadIdx.x == 0:
        sh[0] = 0
    cuda.syncthreads()
    c = int64(0)
    for i in range(cuda.grid(1), bits.shape[0], cuda.gridsize(1)):
        c += (int64(bits[i]) & mask) >= K
    if c != 0:
        cuda.atomic.add(sh, 0, c)
    cuda.syncthreads()
    if cuda.threadIdx.x == 0 and sh[0] != 0:
        cuda.atomic.add(res, 0, sh[0])


@cuda.jit
def _sample(bits, seed, out):
    # out[j] = bits[SplitMix64(seed + (j + 1) * golden) mod n], as cpu.select._sample_bits
    n = np.uint64(bits.shape[0])
    for j in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        out[j] = bits[int64(_gpu_splitmix64(seed, j) % n)]


# ---------------------------------------------------------------------------------------------
# host drivers
# ---------------------------------------------------------------------------------------------


def _radix_state(bits, k, dtype):
    """Device state ``[T, ties]`` after the radix passes: T = the k-th largest key
    (1 <= k <= n), ties = how many keys == T belong to the top k (the lowest-index ones)."""
    _, mask, _, nan_key = key_info(dtype)
    radix_bits = int(config.CUDA_RADIX_BITS)
    threads = int(config.CUDA_HIST_THREADS_PER_BLOCK)
    histogram, pick = _radix_kernels(threads, 1 << radix_bits)
    state = cuda.to_device(np.array([0, k], np.int64))
    hist = cuda.to_device(np.zeros(1 << radix_bits, np.int64))
    blocks = C.blocks_for(bits.shape[0], threads)
    shift = KEY_BITS[np.dtype(dtype).name]
    for width in _digit_widths(shift, radix_bits):
        shift -= width
        histogram[blocks, threads](bits, mask, nan_key, state, shift, width, hist)
        pick[1, 1](hist, width, state)
    return state


def _compact(bits, dtype, state, index_dtype, m=None):
    """Every index with key > state[0] plus the first state[1] with key == state[0], ascending,
    and their bits. ``m`` is the output length when known (top-k); otherwise it is read back."""
    _, mask, _, nan_key = key_info(dtype)
    count_tiles, write_tiles, TILE = _compact_kernels(C.tpb(), C.items())
    n = bits.shape[0]
    ntiles = max(1, -(-n // TILE))
    cnt_gt = C.empty(ntiles, np.int64)
    cnt_eq = C.empty(ntiles, np.int64)
    grid = C.blocks_for(ntiles, 1)
    count_tiles[grid, C.tpb()](bits, mask, nan_key, state, cnt_gt, cnt_eq)
    off_gt = C.exclusive_scan(cnt_gt)
    off_eq = C.exclusive_scan(cnt_eq)
    if m is None:
        m = int(C.read(off_gt, ntiles))
    out_idx = C.empty(m, index_dtype)
    out_bits = C.empty(m, bits.dtype)
    if m > 0:
        write_tiles[grid, C.tpb()](bits, mask, nan_key, state, off_gt, off_eq, out_idx, out_bits)
    return out_idx, out_bits.view(dtype)


def _kth_key(bits, k, dtype):
    return int(C.read(_radix_state(bits, k, dtype), 0))


# ---------------------------------------------------------------------------------------------
# public functions
# ---------------------------------------------------------------------------------------------


def topk_abs(x, k, *, index_dtype=np.int64):
    """The k entries of largest magnitude on the GPU, by an exact radix select (no sort).

    Parameters
    ----------
    x : device array of shape (n,), float16, float32 or float64
        Anything exposing ``__cuda_array_interface__`` (torch CUDA tensor, CuPy, Numba device
        array), used in place without a copy.
    k : int
        Number of entries to select, 0 <= k <= n.
    index_dtype : {np.int64, np.int32}, optional
        Dtype of the returned indices. int32 needs n <= 2**31.

    Returns
    -------
    indices : Numba device array of shape (k,), index_dtype
        Positions of the selected entries, ascending.
    values : Numba device array of shape (k,), x.dtype
        ``x[indices]`` bit for bit (sign, -0.0 and NaN payloads kept).

    Raises
    ------
    ValueError
        x not 1-D; k < 0 or k > n; int32 requested but n > 2**31.
    TypeError
        x's dtype is not float16/32/64; k not an integer; index_dtype not int32/int64.

    Notes
    -----
    docs/design.md §3 kernel contract (larger |x| first, NaN above +inf, ties to the lower index,
    -0.0 == 0.0): the same result as ``spardl_kernels.cpu.topk_abs``, bit for bit.
    Cost: ceil(key bits / ``config.CUDA_RADIX_BITS``) histogram passes over x (4 for float32),
    then a count pass and a write pass (module docstring). No host synchronisation: the output
    length is k.
    """
    x = C.as_values("x", x)
    n = x.shape[0]
    k = _validate.check_k(k, n)
    idt = _validate.check_index_dtype(index_dtype, n)
    bits = C.bits_of(x)
    if k == 0:
        return C.empty(0, idt), C.empty(0, x.dtype)
    if k == n:
        idx = C.arange(n) if idt == np.int64 else C.cast(C.arange(n), idt)
        return idx, C.cast(bits, bits.dtype).view(x.dtype)
    state = _radix_state(bits, k, x.dtype)
    return _compact(bits, x.dtype, state, idt, m=k)


def kth_largest_abs(x, k):
    """The exact k-th largest |x| on the GPU: the threshold that selects the top k.

    Parameters
    ----------
    x : device array of shape (n,), float16, float32 or float64
    k : int
        1 <= k <= n.

    Returns
    -------
    threshold : NumPy scalar of x.dtype (on the host)
        Non-negative (``-0.0`` is returned as ``0.0``), ``inf``, or ``nan`` when at least k
        entries of x are NaN.

    Raises
    ------
    ValueError
        x not 1-D; k < 1 or k > n.
    TypeError
        x's dtype is not float16/32/64; k not an integer.

    Notes
    -----
    docs/design.md §3 kernel contract; the radix passes of :func:`topk_abs` without the output pass.
    """
    x = C.as_values("x", x)
    n = x.shape[0]
    k = _validate.check_k_positive(k, n)
    T = _kth_key(C.bits_of(x), k, x.dtype)
    return key_to_value(T, x.dtype)


def select_above(x, threshold, *, index_dtype=np.int64):
    """Every entry with |x_i| >= threshold, on the GPU, indices ascending.

    Parameters
    ----------
    x : device array of shape (n,), float16, float32 or float64
    threshold : float
        Compared with |x_i| as a float64 number; NaN entries count as above every threshold; a
        NaN threshold selects the NaN entries only; threshold <= 0 selects all.
    index_dtype : {np.int64, np.int32}, optional
        Dtype of the returned indices. int32 needs n <= 2**31.

    Returns
    -------
    indices : Numba device array of shape (m,), index_dtype
        Ascending positions of the selected entries.
    values : Numba device array of shape (m,), x.dtype
        ``x[indices]``, bit for bit.

    Raises
    ------
    ValueError
        x not 1-D; int32 requested but n > 2**31.
    TypeError
        x's dtype is not float16/32/64; threshold not a real number; bad index_dtype.

    Notes
    -----
    docs/design.md §3 kernel contract. The threshold becomes the smallest key K of x's dtype with
    value >= threshold (``_contract.threshold_key``, exact), and the compaction takes every
    key > K - 1. Two reads of x (count, write) plus a scan of per-tile counts; one device ->
    host copy of the output length.
    """
    x = C.as_values("x", x)
    n = x.shape[0]
    t = _validate.check_threshold(threshold)
    idt = _validate.check_index_dtype(index_dtype, n)
    K = threshold_key(t, x.dtype)
    if n == 0:
        return C.empty(0, idt), C.empty(0, x.dtype)
    state = cuda.to_device(np.array([K - 1, 0], np.int64))
    return _compact(C.bits_of(x), x.dtype, state, idt)


def count_above(x, threshold):
    """How many entries have |x_i| >= threshold, on the GPU (same comparison as
    :func:`select_above`).

    Parameters
    ----------
    x : device array of shape (n,), float16, float32 or float64
    threshold : float
        Compared as float64; NaN entries count as above every threshold.

    Returns
    -------
    count : int

    Raises
    ------
    ValueError
        x not 1-D.
    TypeError
        x's dtype is not float16/32/64; threshold not a real number.

    Notes
    -----
    docs/design.md §3 kernel contract. One pass of integer comparisons, a block reduction in shared
    memory and one integer atomic per block.
    """
    x = C.as_values("x", x)
    t = _validate.check_threshold(threshold)
    _, mask, _, _ = key_info(x.dtype)
    K = threshold_key(t, x.dtype)
    n = x.shape[0]
    if n == 0:
        return 0
    res = cuda.to_device(np.zeros(1, np.int64))
    C.launch(_count_ge, n)(C.bits_of(x), K, mask, res)
    return int(res.copy_to_host()[0])


def estimate_threshold(x, k, *, sample_size=None, seed=0):
    """A sampled estimate of ``kth_largest_abs(x, k)`` on the GPU, as in Deep Gradient
    Compression; equal to the CPU estimate for the same arguments.

    Parameters
    ----------
    x : device array of shape (n,), float16, float32 or float64
    k : int
        0 <= k <= n.
    sample_size : int, optional
        Number of sampled entries s >= 1; default
        ``max(config.THRESHOLD_SAMPLE_MIN, ceil(config.THRESHOLD_SAMPLE_FRACTION * n))``.
        When s >= n the exact ``kth_largest_abs(x, k)`` is returned.
    seed : int, optional
        The same (x, k, sample_size, seed) gives the same estimate, on CPU and GPU.

    Returns
    -------
    threshold : float
        ``+inf`` for k = 0; otherwise a non-negative float (or NaN).

    Raises
    ------
    ValueError
        x not 1-D; k < 0 or k > n; sample_size < 1.
    TypeError
        x's dtype is not float16/32/64; k, sample_size or seed not an integer.

    Notes
    -----
    DGC (Lin et al., arXiv 1712.01887, Sec. 3). Positions j = SplitMix64(seed + (j + 1) *
    0x9E3779B97F4A7C15) mod n are drawn in parallel (counter based, so identical to the CPU's
    sequential draw); the k_s-th largest of the sample, k_s = ceil(k s / n), is found by the
    radix select of :func:`topk_abs`. Error: see ``spardl_kernels.cpu.estimate_threshold``.
    """
    x = C.as_values("x", x)
    n = x.shape[0]
    k = _validate.check_k(k, n)
    s = _validate.check_sample_size(sample_size)
    seed = _validate.check_seed(seed)
    if k == 0:
        return math.inf
    if s is None:
        s = max(int(config.THRESHOLD_SAMPLE_MIN), math.ceil(config.THRESHOLD_SAMPLE_FRACTION * n))
    bits = C.bits_of(x)
    if s >= n:
        T = _kth_key(bits, k, x.dtype)
    else:
        sample = C.empty(s, bits.dtype)
        C.launch(_sample, s)(bits, np.uint64(seed), sample)
        k_s = min(s, max(1, -((-k * s) // n)))  # ceil(k * s / n)
        T = _kth_key(sample, k_s, x.dtype)
    return float(key_to_value(T, x.dtype))
