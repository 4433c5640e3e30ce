"""Slow, obviously correct single-process reference of Ok-Topk with exact thresholds.

All P ranks are simulated in one loop with plain NumPy and the kernel references of
``tests/naive.py``. It covers a step whose local and global thresholds are both computed exactly
(step 0 of every run, and every step of a run with ``selector="exact"``,
``threshold_interval=1``): local top-k, regions from the averaged P-quantiles (given or
recomputed), the sums of each region in rank order, the global top-k of the reduced sums (plus
ties), and the new residuals.

Li & Hoefler, PPoPP 2022, arXiv 2201.07598, Algorithms 1 and 2.
"""

from __future__ import annotations

import naive
import numpy as np


def ref_regions(selected, n, P):
    """Integer mean (floor) of every rank's P-quantile boundaries of its selected indices."""
    total = sum(naive.balanced_bounds(s, n, P).astype(np.int64) for s in selected)
    return total // P


def ref_oktopk_step(xs, k, bounds=None, residual="global"):
    """One exact Ok-Topk step over P simulated ranks.

    Parameters
    ----------
    xs : list of P arrays of shape (n,)
        Every rank's X_r = g_r + E_r,old, in the work dtype (float32 or float64).
    k : int
        The budget.
    bounds : int64 array of shape (P+1,), optional
        Region boundaries to reuse; recomputed from the selections when omitted.
    residual : {"global", "local"}
        The residual rule.

    Returns
    -------
    indices : int64 array, ascending
    sums : array
        The SUM over ranks at ``indices`` (the allreducer divides by P for op="mean").
    residuals : list of P arrays of shape (n,)
    bounds : int64 array of shape (P+1,)
    """
    P, n = len(xs), len(xs[0])
    sel = [naive.topk_abs(x, k) for x in xs]
    if bounds is None:
        bounds = ref_regions([s[0] for s in sel], n, P)
    # Each region's sum, contributions added in rank order.
    red_idx, red_val = [], []
    for j in range(P):
        lo, hi = bounds[j], bounds[j + 1]
        parts = [(i[(i >= lo) & (i < hi)], v[(i >= lo) & (i < hi)]) for i, v in sel]
        ij, vj = naive.coalesce(
            np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        )
        red_idx.append(ij)
        red_val.append(vj)
    all_idx, all_val = np.concatenate(red_idx), np.concatenate(red_val)
    # The exact global threshold: the k-th largest reduced magnitude (0 if fewer than k).
    th = float(naive.kth_largest_abs(all_val, k)) if len(all_val) >= k else 0.0
    keep = np.isnan(all_val) | (np.abs(all_val.astype(np.float64)) >= th)
    out_idx, out_val = all_idx[keep], all_val[keep]
    residuals = []
    for x, (i, v) in zip(xs, sel, strict=True):
        e = np.array(x, copy=True)
        if residual == "local":
            e[i] = 0
        else:
            counted = np.isin(i, out_idx)
            e[i[counted]] = x[i[counted]] - v[counted]
        residuals.append(e)
    return out_idx, out_val, residuals, bounds
