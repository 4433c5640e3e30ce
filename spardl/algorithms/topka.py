"""`topka`: local top-k, all-gather of (indices, values), sum.

The TopkA baseline of the Ok-Topk (Li & Hoefler, arXiv 2201.07598, §2 and §5) and SparDL
(Zhao et al., arXiv 2304.00737, §6) evaluations: every rank selects its k entries of largest
magnitude and all-gathers them; every rank then sums the P·k pairs itself. Nothing selected is
dropped, so the output fills in to as many as P·k coordinates.
"""

from __future__ import annotations

import numpy as np

from spardl_kernels import topk_abs

from .base import Allreducer, Reduced
from .common import allgather_sum, error_feedback, keep_remainder


class TopkA(Allreducer):
    """TopkA: local top-k of X = g + E, all-gather, sum in rank order.

    Parameters
    ----------
    comm, n, density, op, residual, nonfinite, check, wire
        See :class:`spardl.algorithms.base.Allreducer`. k = max(1, ⌊ρ·n⌋), the same on every rank.

    Raises
    ------
    ValueError, TypeError
        On every rank, naming the argument, if any rank's arguments are invalid or the ranks
        disagree (:class:`spardl.algorithms.base.Allreducer`).

    Notes
    -----
    Steps (Ok-Topk paper, arXiv 2201.07598, §2.2 "TopkA"):

    1. ``select``: (I_r, V_r) = top-k of |X_r| (``topk_abs``).
    2. ``allgather``: every rank receives every (I_r, V_r). All counts equal k, so the packed
       buffers have one size and a single all-gather suffices (no size exchange).
    3. out = Σ_r V_r at ∪_r I_r, summed in rank order 0 … P−1 (``coalesce`` of the
       concatenation), so the result is bit-identical on every rank.

    Cost: 1 message; received k(P−1)·(isz + vsz) bytes, isz = 4 (int32 indices below 2^31),
    vsz = the work dtype's size (float32 for float16 gradients). With ``wire="compact"`` the
    buffers differ in size: their sizes are all-gathered first (2 messages).

    Residual: everything sent reaches the output, so ``residual="global"`` and ``"local"`` both
    give E_new = X with the selected coordinates zeroed, and the conservation invariant holds.
    """

    name = "topka"
    options: dict = {}

    def _first_selection(self):
        return np.array([self.k]), np.array([0, self.n])

    def _reduce(self, x: np.ndarray) -> Reduced:
        with self.comm.phase("select"):
            idx, val = self._preselected(0, self.k) or topk_abs(x, self.k)
        sent = []
        with self.comm.phase("allgather"):
            out_i, out_v = allgather_sum(
                self.comm, idx, val, self.n, equal_counts=True, wire=self.wire, sent=sent
            )
        res = error_feedback(x, idx, self.residual_mode)
        return Reduced(out_i, out_v, keep_remainder(res, idx, val, sent[0], self.residual_mode))
