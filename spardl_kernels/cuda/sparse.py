"""Sparse-vector kernels on the GPU: merge, coalesce, scatter-add and gather.

CUDA twins of :mod:`spardl_kernels.cpu.sparse`. Sums follow the CPU's fixed order (a before b
in ``merge_add``, earlier position first in ``coalesce`` and ``scatter_add``) and dtype (float16
values are widened to float32 exactly, summed, and rounded once), so results agree bit for bit.
A sum that is NaN is written as the canonical NaN, passed in as a scalar of the output dtype and
stored without a conversion (a GPU's own NaN differs from x86's). No float atomics anywhere:
every output value is summed by one thread in the fixed order; only integer counts use atomics.
"""

import functools

import numpy as np
from numba import cuda, int64

from .. import _validate
from . import _common as C
from ._device import _gpu_same, _gpu_to_f32
from ._sort import sort_with_positions

# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------


@functools.cache
def _merge_kernel(ITEMS):
    @cuda.jit
    def merge_path(ia, ib, mi, msrc):
        # Thread t writes merged slots [t*ITEMS, (t+1)*ITEMS). It finds where its first slot p
        # cuts the two lists by a binary search on the diagonal i + j = p (merge path), then
        # merges sequentially. At equal indices a comes first, so a duplicate pair is adjacent
        # (a then b). msrc = i for a[i], -(j + 1) for b[j].
        na = ia.shape[0]
        nb = ib.shape[0]
        N = na + nb
        for t in range(cuda.grid(1), -(-N // ITEMS), cuda.gridsize(1)):
            p = t * ITEMS
            lo = max(0, p - nb)
            hi = min(p, na)
            while lo < hi:
                mid = (lo + hi) >> 1
                # is a[mid] among the first p merged slots (before b[p - 1 - mid])?
                if int64(ia[mid]) <= int64(ib[p - 1 - mid]):
                    lo = mid + 1
                else:
                    hi = mid
            i = lo
            j = p - lo
            for q in range(p, min(p + ITEMS, N)):
                if j >= nb or (i < na and int64(ia[i]) <= int64(ib[j])):
                    mi[q] = ia[i]
                    msrc[q] = i
                    i += 1
                else:
                    mi[q] = ib[j]
                    msrc[q] = -(j + 1)
                    j += 1

    return merge_path


@cuda.jit
def _heads(sorted_idx, head):
    # head[p] = 1 where a run of equal indices starts
    m = sorted_idx.shape[0]
    for p in range(cuda.grid(1), m, cuda.gridsize(1)):
        head[p] = 1 if p == 0 or sorted_idx[p] != sorted_idx[p - 1] else 0


@cuda.jit
def _merge_write(mi, msrc, va, vb, pos, out_i, out_v, nan):
    # out_v = va[i] + vb[j] (in that order; a NaN sum written as `nan`) where a pair meets,
    # else the entry's own value
    N = mi.shape[0]
    for p in range(cuda.grid(1), N, cuda.gridsize(1)):
        if p == 0 or mi[p] != mi[p - 1]:
            o = pos[p]
            s = msrc[p]
            out_i[o] = mi[p]
            if p + 1 < N and mi[p + 1] == mi[p]:
                r = va[s] + vb[-msrc[p + 1] - 1]
                if r != r:
                    out_v[o] = nan
                else:
                    out_v[o] = r
            elif s >= 0:
                out_v[o] = va[s]
            else:
                out_v[o] = vb[-s - 1]


@cuda.jit
def _segment_sums(sidx, spos, values, pos, out_i, out_v, nan):
    # One thread per run of equal indices: out_v = ((v_1 + v_2) + v_3) ... in position order; a
    # NaN sum is written as `nan`, a lone value is copied
    m = sidx.shape[0]
    for p in range(cuda.grid(1), m, cuda.gridsize(1)):
        i = sidx[p]
        if p == 0 or sidx[p - 1] != i:
            acc = values[spos[p]]
            q = p + 1
            while q < m and sidx[q] == i:
                acc += values[spos[q]]
                q += 1
            o = pos[p]
            out_i[o] = i
            if q > p + 1 and acc != acc:
                out_v[o] = nan
            else:
                out_v[o] = acc


@functools.cache
def _scatter_kernel(half):
    widen = _gpu_to_f32 if half else _gpu_same

    @cuda.jit
    def scatter_runs(dense, sidx, spos, values, nan):
        # One thread per run of equal indices i: dense[i] = ((dense[i] + v_1) + v_2) ... in
        # position order (float16: the chain in float32, rounded once on the store); a NaN sum
        # is written as `nan`, of dense's dtype, so no conversion touches it
        m = sidx.shape[0]
        for p in range(cuda.grid(1), m, cuda.gridsize(1)):
            i = sidx[p]
            if p == 0 or sidx[p - 1] != i:
                acc = widen(dense[i])
                q = p
                while q < m and sidx[q] == i:
                    acc += values[spos[q]]
                    q += 1
                if acc != acc:
                    dense[i] = nan
                else:
                    dense[i] = acc

    return scatter_runs


@cuda.jit
def _gather(dense_bits, indices, out):
    for j in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        out[j] = dense_bits[indices[j]]


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _sum_values(v):
    """float16 values are summed in float32 (docs/design.md §3), widened exactly; others in their
    own dtype."""
    return C.widen_half(v) if v.dtype == np.float16 else v


def _back(v, dtype):
    """Sums back in the value dtype: float16 rounded once, NaN bits as the CPU's narrow_half."""
    return C.narrow_half(v) if v.dtype != dtype else v


# ---------------------------------------------------------------------------------------------
# public functions
# ---------------------------------------------------------------------------------------------


def merge_add(ia, va, ib, vb):
    """Union of two sorted unique sparse vectors on the GPU, values summed where indices meet.

    Parameters
    ----------
    ia : device array of shape (na,), int32 or int64
        Strictly increasing, non-negative.
    va : device array of shape (na,), float16, float32 or float64
    ib : device array of shape (nb,), int32 or int64
        Strictly increasing, non-negative.
    vb : device array of shape (nb,), same dtype as va

    Returns
    -------
    indices : Numba device array of shape (m,), int64 (int32 if both ia and ib are int32)
        The sorted union, max(na, nb) <= m <= na + nb.
    values : Numba device array of shape (m,), va.dtype
        ``va + vb`` (in that order) where the indices meet, else the entry's own value, bit for
        bit. float16 sums are computed in float32 and rounded once. A NaN sum is the canonical
        NaN (docs/design.md §3.4), as on the CPU.

    Raises
    ------
    ValueError
        An argument not 1-D; mismatched lengths; ia or ib unsorted, duplicated or negative.
    TypeError
        Index arrays not int32/int64, value arrays not float16/32/64, or va, vb dtypes differ.

    Notes
    -----
    docs/design.md §3 kernel contract. Merge path (Green, McColl & Bader, "GPU merge path", ICS
    2012): each thread binary-searches its diagonal of the merge grid and merges a few slots;
    equal indices land side by side and are combined, and an exclusive scan of the run heads
    gives each output position. Host synchronisation: the order check and the output length.
    """
    ia = C.as_indices("ia", ia)
    va = C.as_values("va", va)
    ib = C.as_indices("ib", ib)
    vb = C.as_values("vb", vb)
    _validate.check_same_length("va", va.shape[0], "ia", ia.shape[0])
    _validate.check_same_length("vb", vb.shape[0], "ib", ib.shape[0])
    _validate.check_same_dtype("vb", vb.dtype, "va", va.dtype)
    for name, idx in (("ia", ia), ("ib", ib)):
        pos = C.first_violation(idx, strict=True)
        _validate.require(
            pos < 0,
            name,
            f"indices must be non-negative, sorted and unique (violated at position {pos})",
        )
    idt = np.result_type(ia.dtype, ib.dtype)
    N = ia.shape[0] + ib.shape[0]
    if N == 0:
        return C.empty(0, idt), C.empty(0, va.dtype)
    items = C.items()
    mi = C.empty(N, np.int64)
    msrc = C.empty(N, np.int64)
    C.launch(_merge_kernel(items), -(-N // items))(ia, ib, mi, msrc)
    head = C.empty(N, np.int64)
    C.launch(_heads, N)(mi, head)
    pos = C.exclusive_scan(head)
    m = int(C.read(pos, N))
    wa, wb = _sum_values(va), _sum_values(vb)
    out_i = C.empty(m, idt)
    out_v = C.empty(m, wa.dtype)
    C.launch(_merge_write, N)(mi, msrc, wa, wb, pos, out_i, out_v, C.canonical_nan(wa.dtype))
    return out_i, _back(out_v, va.dtype)


def coalesce(indices, values):
    """Sort by index and sum duplicates on the GPU: a sorted unique sparse vector.

    Parameters
    ----------
    indices : device array of shape (m,), int32 or int64
        Non-negative, any order, duplicates allowed.
    values : device array of shape (m,), float16, float32 or float64

    Returns
    -------
    indices : Numba device array of shape (u,), indices.dtype
        The distinct indices, ascending.
    values : Numba device array of shape (u,), values.dtype
        Per distinct index, its values summed sequentially in order of original position
        (float16 in float32, rounded once; a NaN sum is the canonical NaN); a single occurrence
        is copied bit for bit.

    Raises
    ------
    ValueError
        An argument not 1-D; lengths differ; a negative index.
    TypeError
        indices not int32/int64; values not float16/32/64.

    Notes
    -----
    docs/design.md §3 kernel contract (float32 [1e8, 1, -1e8] at one index sums to exactly 0.0).
    A stable radix sort of (index, position) (:mod:`spardl_kernels.cuda._sort`, skipped when
    the input is nondecreasing), an exclusive scan of the run heads for the output positions,
    and one thread per distinct index summing its run in position order.
    """
    indices = C.as_indices("indices", indices)
    values = C.as_values("values", values)
    _validate.check_same_length("values", values.shape[0], "indices", indices.shape[0])
    m = indices.shape[0]
    if m == 0:
        return C.empty(0, indices.dtype), C.empty(0, values.dtype)
    lo, hi = C.min_max(indices)
    _validate.require(lo >= 0, "indices", "must be non-negative")
    sidx, spos = sort_with_positions(indices, hi)
    head = C.empty(m, np.int64)
    C.launch(_heads, m)(sidx, head)
    pos = C.exclusive_scan(head)
    u = int(C.read(pos, m))
    w = _sum_values(values)
    out_i = C.empty(u, indices.dtype)
    out_v = C.empty(u, w.dtype)
    C.launch(_segment_sums, m)(sidx, spos, w, pos, out_i, out_v, C.canonical_nan(w.dtype))
    return out_i, _back(out_v, values.dtype)


def scatter_add(dense, indices, values):
    """In place ``dense[indices] += values`` on the GPU, duplicates accumulating in position
    order.

    Parameters
    ----------
    dense : device array of shape (n,), float16, float32 or float64
        Updated in place (a torch CUDA tensor is updated through its own memory). A host
        ``dense`` with device ``indices``/``values`` is handled by the CPU kernel after copying
        indices and values to the host.
    indices : device array of shape (m,), int32 or int64, each in [0, n)
    values : device array of shape (m,), dense.dtype

    Returns
    -------
    dense : the object passed in, updated in place

    Raises
    ------
    ValueError
        An argument not 1-D; lengths differ; an index outside [0, n). Nothing is written when
        an error is raised.
    TypeError
        Bad dtypes, or values' dtype differs from dense's.

    Notes
    -----
    docs/design.md §3 kernel contract: ``dense[i] = ((dense[i] + v_1) + v_2) ...`` in position
    order, float16 chains in float32 rounded once; a NaN result is the canonical NaN (§3.4).
    Deterministic without float atomics: a stable sort of (index, position) groups each index's
    values in order, and one thread per distinct index runs its chain.
    """
    if not (C.is_numba_device_array(dense) or hasattr(dense, "__cuda_array_interface__")):
        from .. import cpu

        host = [C.to_host(a) for a in (indices, values)]
        return cpu.scatter_add(dense, *host)
    target = dense
    dense = C.as_values("dense", dense)
    indices = C.as_indices("indices", indices)
    values = C.as_values("values", values)
    _validate.check_same_length("values", values.shape[0], "indices", indices.shape[0])
    _validate.check_same_dtype("values", values.dtype, "dense", dense.dtype)
    n = dense.shape[0]
    C.check_range(indices, n)
    m = indices.shape[0]
    if m == 0:
        return target
    sidx, spos = sort_with_positions(indices, n - 1)
    half = dense.dtype == np.float16
    C.launch(_scatter_kernel(bool(half)), m)(
        dense, sidx, spos, _sum_values(values), C.canonical_nan(dense.dtype)
    )
    return target


def gather(dense, indices):
    """``dense[indices]`` on the GPU, bit for bit.

    Parameters
    ----------
    dense : device array of shape (n,), float16, float32 or float64
    indices : device array of shape (m,), int32 or int64, each in [0, n)

    Returns
    -------
    values : Numba device array of shape (m,), dense.dtype

    Raises
    ------
    ValueError
        An argument not 1-D; an index outside [0, n).
    TypeError
        Bad dtypes.

    Notes
    -----
    docs/design.md §3 kernel contract. One thread per output; values move as bit patterns.
    """
    dense = C.as_values("dense", dense)
    indices = C.as_indices("indices", indices)
    n = dense.shape[0]
    C.check_range(indices, n)
    m = indices.shape[0]
    bits = C.bits_of(dense)
    out = C.empty(m, bits.dtype)
    if m:
        C.launch(_gather, m)(bits, indices, out)
    return out.view(dense.dtype)
