"""A slow, obviously correct single-process reference of one SparDL step (docs/design.md §4).

All P ranks are simulated in one loop with the NumPy references of ``tests/naive.py``. The
reduce-scatter tree is written here straight from the DESIGN text (not from ``spardl.schedules``),
so the MPI implementation is checked against an independent reading; the all-gathers are replaced
by what they must deliver (every item, in team / block order).
The float operations are the same as the fast path's, in the same order (received pairs added
into the partial sums round by round; the d owners' selections coalesced in team order), so the
comparison is bitwise.
"""

from __future__ import annotations

import math

import naive
import numpy as np


def _rounds(m):
    """R = ⌈log₂m⌉, by doubling."""
    R = 0
    while (1 << R) < m:
        R += 1
    return R


def spardl_step(X, density, teams=1, h=None, residual="global"):
    """One SparDL step of every rank.

    Parameters
    ----------
    X : list of P arrays of shape (n,)
        X_r = g_r + E_r,old of every rank, in the work dtype.
    density : float
        ρ.
    teams : int
        d; divides P.
    h : int or list of int, optional
        The owners' pre-SAG budget per block position (d > 1). Defaults to the initial
        max(1, ⌊ρC/d⌋) clamped to [max(1, ⌊k_b/d⌋), k_b], or k_b where k_b is the whole block.
    residual : {"global", "local", "none"}

    Returns
    -------
    indices : int64 array, ascending
    values : array, the sum over ranks (work dtype)
    residuals : list of P arrays of shape (n,)
    unions : list of int, per block position the SAG union size (d > 1; else empty)
    """
    P, d = len(X), teams
    m = P // d
    n = len(X[0])
    bounds = naive.uniform_bounds(n, m)
    C = math.ceil(n / m)
    k_all = min(C, max(1, math.floor(density * C * (1 + 1e-9))))
    kb = [min(int(bounds[q + 1] - bounds[q]), k_all) for q in range(m)]
    if h is None:
        h = [
            kb[q]
            if kb[q] == bounds[q + 1] - bounds[q]
            else max(
                min(kb[q], max(1, kb[q] // d)),
                min(kb[q], max(1, math.floor(density * C / d * (1 + 1e-9)))),
            )
            for q in range(m)
        ]
    elif isinstance(h, int):
        h = [h] * m

    S = [x.copy() for x in X]
    sent = [[] for _ in range(P)]

    def team_rank(w, q):  # the rank at position q of w's team
        return (w // m) * m + q % m

    # Spar-Reduce-Scatter, every team at once: round sizes P−2^(R−1), then 2^(R−1−j).
    R = _rounds(m)
    for j in range(R):
        gap = 2 ** (R - 1 - j)
        size = m - gap if j == 0 else gap
        mail = []
        for w in range(P):
            q = w % m
            for i in range(size):
                b = (q + gap + i) % m
                lo, hi = bounds[b], bounds[b + 1]
                rel, vals = naive.topk_abs(S[w][lo:hi], kb[b])
                idx = rel.astype(np.int64) + lo
                mail.append((team_rank(w, q + gap), idx, vals.copy()))
                S[w][idx] = 0
                sent[w].append(idx)
        for dest, idx, vals in mail:  # delivered after every rank has sent
            # indices of one block are unique, so this is naive.scatter_add, without its
            # per-element Python loop (the same one float addition per received pair)
            assert len(np.unique(idx)) == len(idx)
            S[dest][idx] += vals

    # The owner of block q in team t is rank t·m + q.
    final = []
    unions = []
    for q in range(m):
        lo, hi = bounds[q], bounds[q + 1]
        k_own = kb[q] if d == 1 else h[q]
        picks = []
        for t in range(d):
            w = t * m + q
            rel, vals = naive.topk_abs(S[w][lo:hi], k_own)
            idx = rel.astype(np.int64) + lo
            picks.append((idx, vals.copy()))
            S[w][idx] = 0
            sent[w].append(idx)
        if d == 1:
            final.append(picks[0])
        else:
            ui, uv = naive.coalesce(
                np.concatenate([p[0] for p in picks]), np.concatenate([p[1] for p in picks])
            )
            unions.append(len(ui))
            rel, top = naive.topk_abs(uv, min(kb[q], len(ui)))
            final.append((ui[rel], top))
    indices = np.concatenate([f[0] for f in final]).astype(np.int64)
    values = np.concatenate([f[1] for f in final])

    residuals = []
    for w in range(P):
        E = X[w].copy()
        if residual == "global":
            E[indices] = S[w][indices]
        elif residual == "local":
            E[np.concatenate(sent[w])] = 0
        residuals.append(E)
    return indices, values, residuals, unions
