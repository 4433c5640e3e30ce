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
from fractions import Fraction

import naive
import numpy as np


def _rounds(m):
    """R = ⌈log₂m⌉, by doubling."""
    R = 0
    while (1 << R) < m:
        R += 1
    return R


def _floor(density, count, divisor=1):
    """⌊ρ·count/divisor⌋ with ρ as the decimal Python prints for it (exact), or one more
    where that ratio, (⌊…⌋ + 1)·divisor/count, rounds to ρ itself."""
    x = Fraction(repr(float(density))) * count / divisor
    k = math.floor(x)
    if k < x and float(Fraction((k + 1) * divisor, count)) == float(density):
        return k + 1
    return k


def _budgets(n, m, d, density, h):
    """The blocks' bounds, their budgets k_b and the owners' pre-SAG budgets h (see
    :func:`spardl_step`)."""
    bounds = naive.uniform_bounds(n, m)
    C = math.ceil(n / m)
    k_all = min(C, max(1, _floor(density, C)))
    kb = [min(int(bounds[q + 1] - bounds[q]), k_all) for q in range(m)]
    if h is None:
        h = [
            kb[q]
            if kb[q] == bounds[q + 1] - bounds[q]
            else max(
                min(kb[q], max(1, kb[q] // d)),
                min(kb[q], max(1, _floor(density, C, d))),
            )
            for q in range(m)
        ]
    elif isinstance(h, int):
        h = [h] * m
    return bounds, kb, h


def _select(S_w, sent_w, lo, hi, k):
    """The top-k of block [lo, hi) of S_w: (indices, values); zeroed in S_w, noted in sent_w."""
    rel, vals = naive.topk_abs(S_w[lo:hi], k)
    idx = rel.astype(np.int64) + lo
    vals = vals.copy()
    S_w[idx] = 0
    sent_w.append(idx)
    return idx, vals


def spar_reduce_scatter(S, sent, bounds, kb, m):
    """Spar-Reduce-Scatter, every team (m consecutive ranks) at once, in place: round sizes
    m−2^(R−1), then 2^(R−1−j); each round every rank sends the top-k_b of each block it passes
    on (zeroed in its S and noted in its ``sent``), delivered after every rank has sent."""
    P = len(S)

    def team_rank(w, q):  # the rank at position q of w's team
        return (w // m) * m + q % m

    R = _rounds(m)
    for j in range(R):
        gap = 2 ** (R - 1 - j)
        size = m - gap if j == 0 else gap
        mail = []
        for w in range(P):
            q = w % m
            for i in range(size):
                b = (q + gap + i) % m
                idx, vals = _select(S[w], sent[w], bounds[b], bounds[b + 1], kb[b])
                mail.append((team_rank(w, q + gap), idx, vals))
        for dest, idx, vals in mail:
            # indices of one block are unique, so this is naive.scatter_add, without its
            # per-element Python loop (the same one float addition per received pair)
            assert len(np.unique(idx)) == len(idx)
            S[dest][idx] += vals


def spar_all_gather(S, sent, bounds, kb, h, m, d):
    """The owners' selections and what Spar-All-Gather delivers: the owner of block q in team t
    (rank t·m + q) selects its top-k_b (d = 1) or top-h_q (d > 1; the d selections coalesced in
    team order, then the top-k_b of the union). Returns (indices, values, unions)."""
    final = []
    unions = []
    for q in range(m):
        lo, hi = bounds[q], bounds[q + 1]
        k_own = kb[q] if d == 1 else h[q]
        picks = [_select(S[t * m + q], sent[t * m + q], lo, hi, k_own) for t in range(d)]
        if d == 1:
            final.append(picks[0])
            continue
        ui, uv = naive.coalesce(
            np.concatenate([p[0] for p in picks]), np.concatenate([p[1] for p in picks])
        )
        unions.append(len(ui))
        rel, top = naive.topk_abs(uv, min(kb[q], len(ui)))
        final.append((ui[rel], top))
    indices = np.concatenate([f[0] for f in final]).astype(np.int64)
    values = np.concatenate([f[1] for f in final])
    return indices, values, unions


def global_residual_collection(X, S, sent, indices, residual):
    """Every rank's new residual: X_w, with the selected ``indices`` replaced by what rank w
    still holds there ("global"), or every index rank w sent zeroed ("local"), or as it is
    ("none")."""
    residuals = []
    for w in range(len(X)):
        E = X[w].copy()
        if residual == "global":
            E[indices] = S[w][indices]
        elif residual == "local":
            E[np.concatenate(sent[w])] = 0
        residuals.append(E)
    return residuals


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
    bounds, kb, h = _budgets(len(X[0]), m, d, density, h)
    S = [x.copy() for x in X]
    sent = [[] for _ in range(P)]
    spar_reduce_scatter(S, sent, bounds, kb, m)
    indices, values, unions = spar_all_gather(S, sent, bounds, kb, h, m, d)
    residuals = global_residual_collection(X, S, sent, indices, residual)
    return indices, values, residuals, unions
