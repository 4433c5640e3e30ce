"""``accumulate_topk`` and ``accumulate_above`` on the GPU: X = g + E, then the top-k of each
chosen block of X, or every entry of X above a threshold.

The twin of :mod:`spardl_kernels.cpu.accumulate` with the same signature and the same result bit
for bit. On the GPU the sum is one elementwise kernel (memory bound, a read of g and E and a
write of X) and each block's selection is :func:`spardl_kernels.cuda.select.topk_abs` on a
zero-copy slice of X; the CPU's reason to fuse them (one pass through the cache) matters less
where the sum runs at device bandwidth.
"""

import numpy as np
from numba import cuda, int64

from .. import _validate
from . import _common as C
from .select import select_above, topk_abs


@cuda.jit
def _sum_into(g, e, x, nan):
    # x[i] = g[i] + e[i], one IEEE rounding (g already in e's dtype); a NaN sum is written as
    # `nan` (the canonical NaN of x's dtype)
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        r = g[i] + e[i]
        if r != r:
            x[i] = nan
        else:
            x[i] = r


@cuda.jit
def _place(idx, vals, lo, out_idx, out_vals):
    # out[j] = (idx[j] + lo, vals[j]): a block's selection made absolute, into its output slot
    for j in range(cuda.grid(1), idx.shape[0], cuda.gridsize(1)):
        out_idx[j] = int64(idx[j]) + lo
        out_vals[j] = vals[j]


def _address(a):
    """Device address of a's first element (the simulator's arrays wrap host memory)."""
    cai = getattr(a, "__cuda_array_interface__", None)
    return cai["data"][0] if cai is not None else a.ctypes.data


def _overlaps(a, b):
    """Whether two device arrays' memory ranges intersect."""
    na = a.shape[0] * np.dtype(a.dtype).itemsize
    nb = b.shape[0] * np.dtype(b.dtype).itemsize
    if na == 0 or nb == 0:
        return False
    pa, pb = _address(a), _address(b)
    return pa < pb + nb and pb < pa + na


def accumulate_topk(g, e, ks, bounds, *, out=None):
    """X = g + E, and the top-k of chosen blocks of X, on the GPU.

    Parameters
    ----------
    g : device array of shape (n,), float16, float32 or float64
        The gradient (``__cuda_array_interface__``: torch CUDA tensor, CuPy, Numba device array).
    e : device array of shape (n,)
        The residual, in g's work dtype: float32 for a float16 g, else g's dtype.
    ks : int array of shape (B,)
        ks[b] entries are selected from block b = [bounds[b], bounds[b+1]); 0 selects nothing.
    bounds : int array of shape (B + 1,)
        Block boundaries, rising from 0 to n (host arrays; they are parameters, not data).
    out : device array of shape (n,), e.dtype, optional
        Where X is written (sharing no memory with g or e); a new array when None.

    Returns
    -------
    x : Numba device array of shape (n,), e.dtype
    indices : Numba device array of int64, shape (sum(ks),)
        Absolute positions, ascending.
    values : Numba device array of shape (sum(ks),), e.dtype
        ``x[indices]``, bit for bit.

    Raises
    ------
    TypeError, ValueError
        As :func:`spardl_kernels.cpu.accumulate_topk`, with the same messages.

    Notes
    -----
    docs/design.md §3: the same result as the CPU kernel, bit for bit (a NaN in x is the
    canonical NaN, §3.4).
    """
    g = C.as_values("g", g)
    e = C.as_values("e", e)
    n = g.shape[0]
    gdt = np.dtype(g.dtype)
    work, ks, bounds = _validate.check_accumulate(gdt, e.dtype, e.shape[0], n, ks, bounds)
    if out is None:
        x = C.empty(n, work)
    else:
        x = C.as_values("out", out)
        overlaps = _overlaps(x, g) or _overlaps(x, e)
        _validate.check_accumulate_out(x.shape, x.dtype, n, work, True, overlaps)
    if n:
        gw = g if gdt == work else C.cast(g, work)  # float16 -> float32 is exact
        C.launch(_sum_into, n)(gw, e, x, C.canonical_nan(work))
    total = int(ks.sum())
    indices = C.empty(total, np.int64)
    values = C.empty(total, work)
    o = 0
    for b in range(ks.shape[0]):
        lo, hi, k = int(bounds[b]), int(bounds[b + 1]), int(ks[b])
        if k == 0:
            continue
        idx, vals = topk_abs(x[lo:hi], k)
        C.launch(_place, k)(idx, vals, int64(lo), indices[o : o + k], values[o : o + k])
        o += k
    return x, indices, values


def accumulate_above(g, e, threshold, *, out=None):
    """X = g + E, and every entry of X with |x_i| >= threshold, on the GPU.

    The twin of :func:`spardl_kernels.cpu.accumulate_above` (the same arguments, errors and
    bits): the summing kernel of :func:`accumulate_topk`, then
    :func:`spardl_kernels.cuda.select.select_above` of X (two kernels, where the CPU fuses them
    to read X once through its cache).

    Parameters
    ----------
    g : device array of shape (n,), float16, float32 or float64
    e : device array of shape (n,), g's work dtype
    threshold : float
    out : device array of shape (n,), e.dtype, optional

    Returns
    -------
    x : Numba device array of shape (n,), e.dtype
    indices : Numba device array of int64, ascending
    values : Numba device array, e.dtype
        ``x[indices]``, bit for bit.

    Raises
    ------
    TypeError, ValueError
        As the CPU function, with the same messages.
    """
    g = C.as_values("g", g)
    e = C.as_values("e", e)
    n = g.shape[0]
    t = _validate.check_threshold(threshold)
    x, _, _ = accumulate_topk(g, e, np.zeros(1, np.int64), np.array([0, n], np.int64), out=out)
    idx, vals = select_above(x, t)
    return x, idx, vals
