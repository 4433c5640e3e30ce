"""``@cuda.jit(device=True)`` helpers shared by the CUDA kernels (all prefixed ``_gpu_``).

The same code runs on a GPU and on the Numba CUDA simulator. Under the simulator device code is
plain Python on NumPy scalars, which warn on integer wrap-around; the 64-bit hash arithmetic is
therefore written in 32-bit limbs that never overflow, and gives the same bits on both.
"""

import numpy as np
from numba import cuda, float32, int64, uint64

from .._contract import SPLITMIX64_GOLDEN as _GOLDEN
from .._contract import SPLITMIX64_MIX1 as _MIX1
from .._contract import SPLITMIX64_MIX2 as _MIX2

_M32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_U1 = np.uint64(1)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


@cuda.jit(device=True)
def _gpu_key(b, mask, nan_key):
    """Key of |x| from the bits b of x: sign bit cleared, every NaN clamped to nan_key.

    Positive IEEE floats order like their bit patterns, so keys order like |x| under the
    contract's total order (NaN above +inf, -0.0 == 0.0), as in ``_contract.KEY_INFO``.
    """
    return min(int64(b) & mask, nan_key)


@cuda.jit(device=True)
def _gpu_add_u64(a, b):
    """(a + b) mod 2**64 without a wrapping NumPy add (the simulator warns on those)."""
    lo = (a & _M32) + (b & _M32)
    hi = (a >> _S32) + (b >> _S32) + (lo >> _S32)
    return ((hi & _M32) << _S32) | (lo & _M32)


@cuda.jit(device=True)
def _gpu_mul_u64(a, b):
    """(a * b) mod 2**64 from 32-bit limbs: every partial product fits in 64 bits."""
    alo = a & _M32
    ahi = a >> _S32
    blo = b & _M32
    bhi = b >> _S32
    cross = ((ahi * blo) & _M32) + ((alo * bhi) & _M32)
    return _gpu_add_u64(alo * blo, (cross & _M32) << _S32)


@cuda.jit(device=True)
def _gpu_splitmix64(seed, j):
    """SplitMix64(seed + (j + 1) * golden): the counter-based generator of
    ``cpu.select._sample_bits`` (sample j depends only on (seed, j))."""
    z = _gpu_add_u64(seed, _gpu_mul_u64(uint64(j) + _U1, _GOLDEN))
    z = _gpu_mul_u64(z ^ (z >> _S30), _MIX1)
    z = _gpu_mul_u64(z ^ (z >> _S27), _MIX2)
    return z ^ (z >> _S31)


@cuda.jit(device=True)
def _gpu_to_f32(v):
    """float16 -> float32 (exact): float16 sums accumulate in float32 (docs/design.md §3)."""
    return float32(v)


@cuda.jit(device=True)
def _gpu_same(v):
    """float32/float64 values are summed in their own dtype."""
    return v


@cuda.jit(device=True)
def _gpu_block_exclusive_scan(sh, tid, tpb, v):
    """Block-wide exclusive prefix sum of one int64 per thread (Hillis-Steele in shared memory).

    ``sh`` is an int64 shared array of length >= tpb. Every thread of the block must call this.
    Returns (sum of v over threads < tid, sum over the whole block). The caller syncs before it
    writes ``sh`` again.
    """
    sh[tid] = v
    cuda.syncthreads()
    off = 1
    while off < tpb:
        t = sh[tid - off] if tid >= off else 0
        cuda.syncthreads()
        sh[tid] += t
        cuda.syncthreads()
        off *= 2
    return sh[tid] - v, sh[tpb - 1]
