"""A stable LSD radix sort of non-negative int64 keys with their positions, on the GPU.

Used by ``coalesce``, ``scatter_add`` and ``balanced_bounds``: sorting (index, position) pairs
stably keeps equal indices in position order, which fixes the summation order of duplicates.

Each pass sorts by one digit of ``config.CUDA_SORT_RADIX_BITS`` bits, least significant first,
over tiles of ``CUDA_THREADS_PER_BLOCK`` entries (one per thread):

1. per tile, a shared-memory histogram of the digit, stored digit-major
   (``counts[d * ntiles + tile]``);
2. an exclusive scan of ``counts``: where digit d of tile t starts in the output;
3. per tile, each entry's rank among the earlier entries of its tile with the same digit (a loop
   over the tile in shared memory), so the scatter is stable.

Only ``ceil(bit_length(max key) / bits)`` passes run (indices below 2**24 need three 8-bit
passes).
"""

import functools

import numpy as np
from numba import cuda, int32

from .. import config
from . import _common as C


@functools.cache
def _sort_kernels(TPB, BINS):
    @cuda.jit
    def digit_counts(keys, shift, counts):
        sh = cuda.shared.array(BINS, int32)
        tid = cuda.threadIdx.x
        m = keys.shape[0]
        ntiles = counts.shape[0] // BINS
        for tile in range(cuda.blockIdx.x, ntiles, cuda.gridDim.x):
            for b in range(tid, BINS, TPB):
                sh[b] = 0
            cuda.syncthreads()
            i = tile * TPB + tid
            if i < m:
                cuda.atomic.add(sh, (keys[i] >> shift) & (BINS - 1), 1)
            cuda.syncthreads()
            for b in range(tid, BINS, TPB):
                counts[b * ntiles + tile] = sh[b]
            cuda.syncthreads()

    @cuda.jit
    def scatter(keys, pos, shift, offsets, keys_out, pos_out):
        digits = cuda.shared.array(TPB, int32)
        tid = cuda.threadIdx.x
        m = keys.shape[0]
        ntiles = (offsets.shape[0] - 1) // BINS
        for tile in range(cuda.blockIdx.x, ntiles, cuda.gridDim.x):
            i = tile * TPB + tid
            d = -1
            if i < m:
                d = (keys[i] >> shift) & (BINS - 1)
            digits[tid] = d
            cuda.syncthreads()
            if i < m:
                # rank = #{j < tid : digits[j] == d}: stable within the tile
                rank = 0
                for j in range(tid):
                    rank += digits[j] == d
                dst = offsets[d * ntiles + tile] + rank
                keys_out[dst] = keys[i]
                pos_out[dst] = pos[i]
            cuda.syncthreads()

    return digit_counts, scatter


def stable_sort(keys, max_key):
    """Sort non-negative int64 device ``keys`` stably; returns (sorted keys, positions).

    Parameters
    ----------
    keys : int64 device array of shape (m,), values in [0, max_key]
    max_key : int
        The largest key (bounds the number of passes).

    Returns
    -------
    sorted_keys : int64 device array of shape (m,)
    positions : int64 device array of shape (m,)
        ``sorted_keys[j] == keys[positions[j]]``; equal keys keep ascending positions.
    """
    m = keys.shape[0]
    pos = C.arange(m)
    if m <= 1:
        return keys, pos
    radix_bits = int(config.CUDA_SORT_RADIX_BITS)
    BINS = 1 << radix_bits
    T = C.tpb()
    digit_counts, scatter = _sort_kernels(T, BINS)
    ntiles = -(-m // T)
    grid = C.blocks_for(ntiles, 1)
    counts = C.empty(BINS * ntiles, np.int64)
    keys_tmp = C.empty(m, np.int64)
    pos_tmp = C.empty(m, np.int64)
    bits = max(1, int(max_key).bit_length())
    for shift in range(0, bits, radix_bits):
        digit_counts[grid, T](keys, shift, counts)
        offsets = C.exclusive_scan(counts)
        scatter[grid, T](keys, pos, shift, offsets, keys_tmp, pos_tmp)
        keys, keys_tmp = keys_tmp, keys
        pos, pos_tmp = pos_tmp, pos
    return keys, pos


def sort_with_positions(indices, max_index):
    """(sorted int64 indices, their original positions), stable. Skips the sort when
    ``indices`` is already nondecreasing."""
    keys = C.cast(indices, np.int64)
    if C.first_violation(keys, strict=False) < 0:
        return keys, C.arange(keys.shape[0])
    return stable_sort(keys, max_index)
