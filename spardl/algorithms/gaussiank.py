"""`gaussiank`: a threshold from a normal fit of the gradient, corrected towards k, then as TopkA.

Shi, Chu, Cheung & See, "Understanding Top-k Sparsification in Distributed Deep Learning",
arXiv 1911.08772, §5 (Gaussian-k). Exact top-k needs a selection over all n entries; the paper
observes that gradients are close to normal, so the threshold that keeps about k entries can be
read off a normal fit (its mean and standard deviation: two cheap reductions), then corrected in a
few passes that only count (``count_above``).
"""

from __future__ import annotations

import math

import numpy as np

from spardl_kernels import count_above, select_above, topk_abs

from .._checks import check_density, check_float, check_int
from .base import Allreducer, Reduced
from .common import allgather_sum, error_feedback, keep_remainder

#: The band of accepted counts, as fractions of k: a count in [LOW·k, HIGH·k] stops the correction.
LOW, HIGH = 2.0 / 3.0, 4.0 / 3.0
#: Above CAP·k selected entries after the corrections, the exact top-k is sent instead.
CAP = 2.0
#: Below FLOOR·k selected entries after the corrections, the exact top-k is sent instead.
FLOOR = 1.0 / 3.0


def folded_normal_tail_quantile(q: float, mu: float, sigma: float) -> float:
    """The t ≥ 0 with P(|Y| ≥ t) = q for Y ~ N(μ, σ²): the (1 − q) quantile of |Y|.

    Parameters
    ----------
    q : float
        Tail probability in (0, 1]; for Gaussian-k, q = k/n.
    mu, sigma : float
        Mean and standard deviation of the fit (finite, σ ≥ 0).

    Returns
    -------
    float
        The threshold t. q = 1 gives 0; σ = 0 gives |μ| (every entry ties there).

    Raises
    ------
    TypeError
        If ``q``, ``mu`` or ``sigma`` is not a real number.
    ValueError
        If ``q`` is outside (0, 1], ``mu`` not finite, or ``sigma`` negative or not finite.

    Notes
    -----
    P(|Y| ≥ t) = ½·erfc((t − μ)/(σ√2)) + ½·erfc((t + μ)/(σ√2)) decreases in t ≥ 0; it is solved by
    bisection with :func:`math.erfc` (accurate far into the tail, where 1 − Φ loses digits), so no
    SciPy is needed. 200 halvings of [0, |μ| + 40σ] reach float64 resolution.
    """
    q = check_density("q", q)
    mu, sigma = float(check_float("mu", mu)), float(check_float("sigma", sigma))
    if not math.isfinite(mu):
        raise ValueError(f"mu must be finite, got {mu}")
    if not (math.isfinite(sigma) and sigma >= 0.0):
        raise ValueError(f"sigma must be finite and ≥ 0, got {sigma}")
    if q >= 1.0 or sigma == 0.0:
        return 0.0 if q >= 1.0 else abs(mu)
    s = sigma * math.sqrt(2.0)

    def tail(t):
        return 0.5 * math.erfc((t - mu) / s) + 0.5 * math.erfc((t + mu) / s)

    lo, hi = 0.0, abs(mu) + 40.0 * sigma
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if tail(mid) > q:
            lo = mid
        else:
            hi = mid
    return hi


class Gaussiank(Allreducer):
    """Gaussian-k: select |X_i| ≥ t with t from a normal fit of X, corrected towards k; then TopkA.

    Parameters
    ----------
    comm, n, density, op, residual, nonfinite, check, wire
        See :class:`spardl.algorithms.base.Allreducer`.
    corrections : int, default 4
        The most correction passes (each one ``count_above``), ≥ 0.

    Raises
    ------
    ValueError, TypeError
        On every rank, naming the argument, if any rank's arguments (``corrections`` included)
        are invalid or the ranks disagree.

    Notes
    -----
    Selection on each rank (Shi et al., arXiv 1911.08772, §5):

    1. Fit N(μ, σ²) to X (mean and standard deviation in float64) and take t as the (1 − k/n)
       quantile of |N(μ, σ²)| (:func:`folded_normal_tail_quantile`).
    2. Correction: while the count c = #{|X_i| ≥ t} lies outside [⅔k, ⁴⁄₃k] and passes remain,
       move t: halve it when too few, multiply it by 1.5 when too many; once a threshold that
       gives too few and one that gives too many are both known, take their geometric mean
       (a bisection in log t), which converges on k instead of oscillating.
    3. Send every |X_i| ≥ t (``select_above``). If c is still above 2k (a distribution the normal
       fit describes badly, a constant or all-zero vector where every entry ties, or a non-finite
       fit because X holds NaN or Inf), or below k/3 (ties at the threshold: a constant vector
       selects all or nothing), send the exact top-k instead: a bounded message that never
       starves, and NaN is always selected so the base class reports it.

    **Counts vary per rank** (each rank fits its own X), so the all-gather is an all-gatherv:
    2 messages (sizes, then data). The sum is in rank order, bit-identical on every rank.

    Residual: everything sent reaches the output (as in TopkA), so E_new = X with the sent
    coordinates zeroed and the conservation invariant holds.

    **GPU gradients are staged through the host** (``device_resident = False``): X is copied to
    the host once per step and the result and residual are copied back once. The normal fit
    (NumPy's pairwise float64 mean and standard deviation) decides which entries are selected,
    and a device reduction in another order could move t by an ulp and change the selection;
    staging keeps the result bit-identical to the CPU path.
    """

    name = "gaussiank"
    options: dict = {"corrections": 4}
    device_resident = False

    def _setup(self) -> None:
        c = self.opts["corrections"]
        check_int("corrections", c)
        if c < 0:
            raise ValueError(f"corrections must be >= 0, got {c}")
        self.stats.setdefault("selected", 0)

    def threshold(self, x: np.ndarray) -> float | None:
        """The corrected threshold t for X, or None when the normal fit is not finite."""
        k, n = self.k, self.n
        with np.errstate(invalid="ignore", over="ignore"):  # Inf in X: a NaN fit, handled below
            mu = float(np.mean(x, dtype=np.float64))
            sigma = float(np.std(x, dtype=np.float64))
        if not (math.isfinite(mu) and math.isfinite(sigma)):
            return None
        t = folded_normal_tail_quantile(k / n, mu, sigma)
        too_few = too_many = None  # thresholds known to select < ⅔k / > ⁴⁄₃k
        for _ in range(int(self.opts["corrections"])):
            c = count_above(x, t)
            if c < LOW * k:
                too_few = t
                t = math.sqrt(t * too_many) if too_many is not None else 0.5 * t
            elif c > HIGH * k:
                too_many = t
                t = math.sqrt(t * too_few) if too_few is not None else 1.5 * t
            else:
                break
        return t

    def _reduce(self, x: np.ndarray) -> Reduced:
        with self.comm.phase("select"):
            t = self.threshold(x)
            c = -1 if t is None else count_above(x, t)
            if t is None or not FLOOR * self.k <= c <= CAP * self.k:
                idx, val = topk_abs(x, self.k)
            else:
                idx, val = select_above(x, t)
            self.stats["selected"] += len(idx)
        sent = []
        with self.comm.phase("allgather"):
            out_i, out_v = allgather_sum(
                self.comm, idx, val, self.n, equal_counts=False, wire=self.wire, sent=sent
            )
        res = error_feedback(x, idx, self.residual_mode)
        return Reduced(out_i, out_v, keep_remainder(res, idx, val, sent[0], self.residual_mode))
