"""`topkdsa`: SparCML's dynamic sparse allreduce (split, reduce, all-gather, dense switch).

Renggli, Ashkboos, Aghagolzadeh, Alistarh & Hoefler, "SparCML: High-Performance Sparse
Communication for Machine Learning", arXiv 1802.08021 (SC'19), §5 (DSAR_Split_AllGather):
[0, n) is split into P regions; every rank sends each region's part of its sparse vector to the
region's owner, which sums what it receives; the reduced regions are then all-gathered. The sum
fills in as contributions arrive, so a region whose entry count passes the break-even density is
switched to a dense representation (the "dynamic" in dynamic sparse), and travels dense in the
all-gather. Nothing selected is dropped.
"""

from __future__ import annotations

import numpy as np

from spardl_kernels import block_offsets, merge_add, scatter_add, topk_abs, uniform_bounds

from .. import _arrays as A
from ..comm import pack_blocks, pack_wire, unpack_blocks, unpack_wire, wire_index_dtype
from .base import Allreducer, Reduced
from .common import error_feedback, keep_remainder

_SPARSE, _DENSE = 0, 1


def sparse_is_smaller(nnz: int, length: int, isz: int, vsz: int) -> bool:
    """The break-even rule: is a region of ``length`` with ``nnz`` pairs cheaper sent sparse?

    Parameters
    ----------
    nnz : int
        Entries held.
    length : int
        Region length.
    isz, vsz : int
        Bytes per wire index (4 for int32 region-relative indices) and per value.

    Returns
    -------
    bool
        ``nnz·(isz + vsz) < length·vsz``: a sparse pair costs an index and a value, a dense
        entry costs a value. At equality the dense form wins (no index decoding). With int32
        indices this switches at density 1/3 (float64) or 1/2 (float32). The few header bytes of
        either form are left out: they are the same order for both.
    """
    return nnz * (isz + vsz) < length * vsz


class TopkDSA(Allreducer):
    """SparCML's DSA: local top-k, split-reduce over P uniform regions, all-gather(v).

    Parameters
    ----------
    comm, n, density, op, residual, nonfinite, check, wire
        See :class:`spardl.algorithms.base.Allreducer`.

    Raises
    ------
    ValueError, TypeError
        On every rank, naming the argument, if any rank's arguments are invalid or the ranks
        disagree (:class:`spardl.algorithms.base.Allreducer`).

    Notes
    -----
    Steps (SparCML, arXiv 1802.08021, §5, Algorithm "DSAR_Split_AllGather"):

    1. ``select``: (I_r, V_r) = top-k of |X_r|.
    2. ``reduce_scatter``: regions b = 0 … P−1 are ``uniform_bounds(n, P)`` (the first n mod P
       one longer). In exchange s = 1 … P−1 (the direct, rotated schedule) rank r sends its
       pairs in region (r+s) mod P to that region's owner and receives the pairs of its own
       region r from rank (r−s) mod P: one packed message each way. The owner sums as the
       contributions arrive, in the order r, r−1, …, r−P+1 (mod P): sparse with ``merge_add``
       while :func:`sparse_is_smaller` holds, then, once the count passes the break-even density,
       as a dense region with ``scatter_add`` for the rest.
    3. ``allgather``: every owner all-gathers its reduced region, sparse or dense (one flag word
       and the payload, ``allgatherv_bytes``: 2 messages). A dense region is output with all its
       coordinates (zeros included), exactly as it travelled.

    Cost: P−1 messages of at most min(k, region) pairs each, then 2. Every rank's output is the
    owners' sums, so it is bit-identical everywhere.

    Residual: nothing selected is dropped, so E_new = X with the selected coordinates zeroed
    (``residual="global"`` and ``"local"`` coincide) and the conservation invariant holds.
    """

    name = "topkdsa"
    options: dict = {}

    def _setup(self) -> None:
        self.bounds = np.asarray(uniform_bounds(self.n, self.P), dtype=np.int64)
        lengths = np.diff(self.bounds)
        self.wire_index = wire_index_dtype(int(lengths.max()))
        self.stats.setdefault("dense_regions", 0)

    def _reduce(self, x: np.ndarray) -> Reduced:
        with self.comm.phase("select"):
            idx, val = topk_abs(x, self.k)
        # pairs of region b: offs[b] … offs[b+1]−1 (P+1 host integers, also for device idx)
        offs = A.to_host(block_offsets(idx, self.bounds))
        kept = []  # (indices, values, decoded) of every message sent: their rounding stays here
        with self.comm.phase("reduce_scatter"):
            region = self._reduce_region(idx, val, offs, kept)
        with self.comm.phase("allgather"):
            out_i, out_v = self._allgather_regions(region, np.dtype(x.dtype), A.is_device(x), kept)
        res = error_feedback(x, idx, self.residual_mode)
        for i, v, q in kept:
            keep_remainder(res, i, v, q, self.residual_mode)
        return Reduced(out_i, out_v, res)

    def _reduce_region(self, idx, val, offs, kept=None):
        """This rank's region r summed over all ranks: ("sparse", idx, val) or ("dense", values).
        ``kept`` gets (indices, values, decoded values) of every piece sent."""
        P, r, bounds = self.P, self.rank, self.bounds
        start, stop = int(bounds[r]), int(bounds[r + 1])
        length = stop - start
        isz, vsz = self.wire_index.itemsize, val.dtype.itemsize
        dev = A.is_device(val)
        acc_i, acc_v = idx[offs[r] : offs[r + 1]], val[offs[r] : offs[r + 1]]
        dense = None
        for s in range(1, P + 1):
            if dense is None and not sparse_is_smaller(acc_i.shape[0], length, isz, vsz):
                dense = A.zeros(length, val.dtype, dev)
                scatter_add(dense, A.shift(acc_i, -start), acc_v)
            if s == P:
                break
            dest, source = (r + s) % P, (r - s) % P
            piece = (idx[offs[dest] : offs[dest + 1]], val[offs[dest] : offs[dest + 1]])
            sent = []
            got_i, got_v = self.comm.exchange_blocks(
                dest,
                [piece],
                [int(bounds[dest])],
                source,
                [start],
                min(self.k, length),
                self.wire_index,
                val.dtype,
                wire=self.wire,
                sent=sent,
            )[0]
            if kept is not None:
                kept.append((*piece, sent[0]))
            if dense is not None:
                scatter_add(dense, A.shift(got_i, -start), got_v)
            else:
                acc_i, acc_v = merge_add(acc_i, acc_v, got_i, got_v)
        if dense is not None:
            self.stats["dense_regions"] += 1
            return (_DENSE, dense)
        return (_SPARSE, acc_i, acc_v)

    def _allgather_regions(self, region, vdt, dev=False, kept=None):
        """All-gather the reduced regions; returns the concatenated (indices, values).
        ``kept`` gets (indices, values, decoded values) of this rank's region."""
        P, bounds, idt = self.P, self.bounds, self.wire_index
        r = self.rank
        wire = self.wire if P > 1 else "coo"  # nothing is sent at P = 1: nothing to round
        if wire != "coo":
            # A dense region is the block of all its coordinates (the compact format sends no
            # index bytes for it); both forms come back as (indices, values).
            start, stop = int(bounds[r]), int(bounds[r + 1])
            if region[0] == _DENSE:
                pair = (A.shift(A.arange(stop - start, dev), start), region[1])
            else:
                pair = (region[1], region[2])
            payload, delivered = pack_wire(
                [pair], [start], idt, vdt, wire, quantise=self.comm.quantise
            )
            if kept is not None:
                kept.append((*pair, delivered[0]))
            dev_payload = False
        elif region[0] == _DENSE:
            payload = region[1].view(np.uint8)
            dev_payload = dev
        else:
            payload = pack_blocks(
                [(region[1], region[2])], [int(bounds[r])], idt, vdt, device_range_check=False
            )
            dev_payload = dev
        flag = np.array([region[0]], dtype=np.int64).view(np.uint8)
        buf = A.concat([flag, payload], np.uint8, dev_payload)
        rows = self.comm.allgatherv_bytes(buf, pad=wire != "coo") if P > 1 else [buf]
        parts_i, parts_v = [], []
        for b, row in enumerate(rows):
            start, stop = int(bounds[b]), int(bounds[b + 1])
            kind = int(A.to_host(row[:8]).view(np.int64)[0])
            body = A.aligned(row[8:])
            if wire != "coo":
                bi, bv = unpack_wire(body, 1, [start], idt, vdt, wire, dev)[0]
                parts_i.append(bi)
                parts_v.append(bv)
            elif kind == _DENSE:
                parts_i.append(A.shift(A.arange(stop - start, dev), start))
                parts_v.append(A.copy(body.view(vdt)))
            else:
                bi, bv = unpack_blocks(body, 1, [start], idt, vdt)[0]
                parts_i.append(bi)
                parts_v.append(bv)
        return A.concat(parts_i, np.int64, dev), A.concat(parts_v, vdt, dev)
