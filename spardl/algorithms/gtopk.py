"""`gtopk`: global top-k by a tree of pairwise merges, each re-selecting top-k, then a broadcast.

Shi, Wang, Chu, Li & Cheung, "A Distributed Synchronous SGD Algorithm with Global Top-k
Sparsification for Low Bandwidth Networks", arXiv 1901.04359 (ICDCS 2019), §III (Algorithm 2,
gTopKAllReduce). Messages stay at k pairs however many ranks contribute, at the price of the SGA
dilemma: every re-selection drops partial sums. Here the dropped mass is measured, not hidden.
"""

from __future__ import annotations

import numpy as np

from spardl_kernels import merge_add, topk_abs

from .. import _arrays as A
from ..comm import (
    pack_blocks,
    pack_wire,
    packed_capacity,
    unpack_blocks,
    unpack_wire,
    wire_capacity,
    wire_index_dtype,
)
from .base import Allreducer, Reduced
from .common import error_feedback, keep_remainder

_MASS = np.dtype(np.float64)  # the dropped-mass word that prefixes every message


def tree_rounds(P: int) -> int:
    """⌈log₂P⌉: the number of merge rounds for P ranks (0 for P = 1)."""
    return (P - 1).bit_length()


class GTopk(Allreducer):
    """gTop-k: local top-k, ⌈log₂P⌉ rounds of pairwise merge + top-k, broadcast from rank 0.

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
    Steps (arXiv 1901.04359, §III, Algorithm 2):

    1. ``select``: (I_r, V_r) = top-k of |X_r|.
    2. ``reduce``: in round j = 0 … ⌈log₂P⌉−1, with d = 2^j, a rank r with r mod 2d = d sends its
       current k pairs to r − d and leaves the tree; a rank with r mod 2d = 0 receives from r + d
       when r + d < P (otherwise it passes the round through), merges (``merge_add``, its own
       pairs first) and keeps the top-k of the merged vector. Works for any P: the tree is a
       binomial tree rooted at 0, with missing partners skipped.
    3. ``bcast``: rank 0 broadcasts the final k pairs (always exactly k, so the buffer size is
       known everywhere and one broadcast suffices).

    Cost: ⌈log₂P⌉ receives at most per rank and one send, k pairs each, then a broadcast of k
    pairs: about 2·log₂P·α + 4k·log₂P·β (pairs as 2 words), independent of how the indices spread.

    **Dropped mass.** Each re-selection discards up to k partial sums. Their magnitudes
    Σ |dropped values| (in units of the summed gradient, before ``op="mean"`` divides by P) travel
    up the tree in an 8-byte word of every message and come back with the broadcast; the
    cumulative global total is ``stats["dropped_mass"]``, the same float on every rank.

    **Residual (the paper's rule):** E_r = X_r − (r's sent values on the final output's
    coordinates): a locally selected value whose coordinate did not survive stays with r. A
    partial sum dropped at an inner node is nobody's, so the method does **not** conserve
    (``conserves = False``): Σ_r X_r − P·out − Σ_r E_r is exactly the mass lost by the
    re-selections at coordinates that still made the output.

    GPU gradients stay on the device; only the dropped-mass statistic is summed on the host,
    from an O(k) copy of each merged vector, so that it is the same float as on the CPU path.
    """

    name = "gtopk"
    conserves = False
    options: dict = {}

    def _setup(self) -> None:
        self.wire_index = wire_index_dtype(self.n)
        self.stats.setdefault("dropped_mass", 0.0)

    def _pack(self, mass, idx, val, sent=None):
        """The message (mass word, then the pairs); ``sent`` gets the values as decoded."""
        head = np.array([mass], dtype=_MASS).view(np.uint8)
        if self.wire == "coo":
            body = pack_blocks(
                [(idx, val)], [0], self.wire_index, val.dtype, device_range_check=False
            )
            delivered = [val]
        else:
            body, delivered = pack_wire(
                [(idx, val)],
                [0],
                self.wire_index,
                val.dtype,
                self.wire,
                quantise=self.comm.quantise,
            )
        if sent is not None:
            sent.append((idx, val, delivered[0]))
        return A.concat([head, body], np.uint8, A.is_device(body))

    def _unpack(self, buf, vdt, dev=False):
        mass = float(A.to_host(buf[: _MASS.itemsize]).view(_MASS)[0])
        if self.wire == "coo":
            idx, val = unpack_blocks(buf[_MASS.itemsize :], 1, [0], self.wire_index, vdt)[0]
        else:
            body = buf[_MASS.itemsize :]
            idx, val = unpack_wire(body, 1, [0], self.wire_index, vdt, self.wire, dev)[0]
        return mass, idx, val

    def _first_selection(self):
        return np.array([self.k]), np.array([0, self.n])

    def _reduce(self, x: np.ndarray) -> Reduced:
        P, r, k = self.P, self.rank, self.k
        dev = A.is_device(x)
        with self.comm.phase("select"):
            sent_i, sent_v = self._preselected(0, k) or topk_abs(x, k)
        idx, val, mass = sent_i, sent_v, 0.0
        coo = self.wire == "coo"
        cap = _MASS.itemsize + wire_capacity(1, k, self.wire_index, x.dtype, self.wire)
        mine = []  # (indices, values, delivered) of this rank's one send
        with self.comm.phase("reduce"):
            for j in range(tree_rounds(P)):
                d = 1 << j
                if r % (2 * d) == d:
                    self.comm.send_bytes(self._pack(mass, idx, val, mine), r - d)
                    break
                if r + d >= P:
                    continue  # no partner this round: pass through
                got = self.comm.recv_bytes(r + d, cap, device=dev and coo)
                got_mass, got_i, got_v = self._unpack(got, x.dtype, dev)
                mi, mv = merge_add(idx, val, got_i, got_v)
                pos, val = topk_abs(mv, k)
                idx = A.take(mi, pos)
                mv_h = A.to_host(mv)  # O(k): the statistic below, summed as on the CPU path
                keep = np.zeros(mv_h.shape[0], dtype=bool)
                keep[A.to_host(pos)] = True
                mass += got_mass + float(np.sum(np.abs(mv_h[~keep]), dtype=np.float64))
        if P > 1:
            with self.comm.phase("bcast"):
                if not coo:  # sizes vary: the size first (bcast_bytes, 2 messages)
                    buf = self._pack(mass, idx, val, mine) if r == 0 else None
                    got = self.comm.bcast_bytes(buf, 0)
                elif r == 0:
                    got = self.comm.bcast(self._pack(mass, idx, val), 0)
                else:
                    size = _MASS.itemsize + packed_capacity(1, k, self.wire_index, x.dtype)
                    got = self.comm.bcast(A.empty(size, np.uint8, dev), 0)
                mass, idx, val = self._unpack(got, x.dtype, dev)
        self.stats["dropped_mass"] += mass
        res = error_feedback(x, sent_i, self.residual_mode, out_indices=idx)
        for i, v, q in mine:  # what the wire rounded, where it reached the output
            keep_remainder(res, i, v, q, self.residual_mode, members=idx)
        return Reduced(idx, val, res)
