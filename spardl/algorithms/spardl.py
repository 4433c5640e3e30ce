"""`spardl`: Spar-Reduce-Scatter, Spar-All-Gather with teams, Global Residual Collection.

Zhao et al., "SparDL: Distributed Deep Learning Training with Efficient Sparse Communication",
arXiv 2304.00737 (Sec. 4: SRS and SAG; Sec. 5: GRC); docs/design.md §4 states it as implemented
here.
"""

from __future__ import annotations

import math

import numpy as np

import spardl_kernels as K

from .. import _arrays as A
from .._checks import check_int
from ..comm import wire_index_dtype
from ..schedules import bruck_schedule, srs_schedule
from ..selection import make_selector
from .base import Allreducer, Reduced, budget
from .common import keep_remainder

__all__ = ["SparDL", "next_h"]


def next_h(h: int, u: int, k_b: int, d: int) -> int:
    """The owner's pre-SAG budget for the next step (this project's rule).

    If d owners each sent h pairs and their union held u distinct indices, the fraction of
    distinct indices is u/(d·h), and the budget that would make the union just fill k_b is
    h* = ⌈h·k_b/u⌉ (k_b when u = 0). h moves half-way towards h* (truncated towards h, but at
    least one step when h* ≠ h), then is clamped to [max(1, ⌊k_b/d⌋), k_b]. Only integers
    that all d owners of a block position see identically (h, u, k_b, d) enter, so their
    capacities always match.

    Parameters
    ----------
    h : int
        The budget used this step.
    u : int
        Size of this step's union (distinct indices over the d selections).
    k_b : int
        The per-block budget, ≥ 0.
    d : int
        Teams.

    Returns
    -------
    int
        The next h, in [min(k_b, max(1, ⌊k_b/d⌋)), k_b].
    """
    lo = min(k_b, max(1, k_b // d))
    target = k_b if u <= 0 else -(-h * k_b // u)
    delta = int((target - h) / 2)
    if delta == 0 and target != h:
        delta = 1 if target > h else -1
    return max(lo, min(k_b, h + delta))


class SparDL(Allreducer):
    """SparDL sparse allreduce: SRS inside d teams, SAG across and inside teams, and GRC.

    A team of m = P/d contiguous ranks splits [0, n) into m blocks by ``uniform_bounds(n, m)``;
    C = ⌈n/m⌉ and the per-block budget is k_b = min(block length, max(1, ⌊ρ·C⌋)).

    1. **Spar-Reduce-Scatter** (``phase "srs"``), inside each team, ⌈log₂m⌉ rounds
       (:func:`spardl.schedules.srs_schedule`): just before a block is sent, the rank re-selects
       the top-k_b of its current partial sum of that block; all blocks of a round travel in one
       packed message; received pairs are added into the partial sum. Team position p ends
       owning block p.
    2. **Spar-All-Gather across teams** (``"sag_teams"``, only for d > 1): the owner selects the
       top-h of its block; the d owners of block p exchange their selections by a Bruck
       all-gather (⌈log₂d⌉ rounds), coalesce them in team order 0 … d−1 and keep the top-k_b of
       the union. h starts at max(1, ⌊ρC/d⌋) and adapts between steps (:func:`next_h`); where
       k_b is the whole block (ρ·C ≥ block length) h = k_b, since nothing is to be dropped.
    3. **Spar-All-Gather inside the team** (``"sag_allgather"``): a Bruck all-gather
       (⌈log₂m⌉ rounds) gives every rank every block.
    4. **Global Residual Collection** (``residual="global"``): each rank's partial sums, with
       what it sent (or selected as owner) zeroed, are its step-2 residual; with I the final
       indices, E_new = O (= X) outside I and the step-2 value on I. Nothing is lost:
       Σ_r X_r = P·out + Σ_r E_r,new (op="mean").
       ``residual="local"`` (plain error feedback, an ablation): E_new = X with every position
       this rank sent (or selected as owner) zeroed. Mass a rank forwarded for others and that
       was dropped downstream, and its own entries dropped after it sent them, are lost.

    Parameters
    ----------
    comm, n, density, op, residual, nonfinite, check
        As :class:`spardl.algorithms.base.Allreducer`.
    teams : int, default 1
        d, the number of teams; must divide P. 1 is bandwidth-optimal (≈ 4k(P−1)/P words,
        2⌈log₂P⌉ messages per rank); P is all-gather-like (⌈log₂P⌉ messages).
    selector : {"exact", "threshold"}, default "exact"
        How blocks are sparsified (:mod:`spardl.selection`).
    threshold_interval : int, default 32
        τ' of the threshold selector (steps between exact recomputations), ≥ 1.

    Raises
    ------
    ValueError, TypeError
        On every rank, naming ``teams``, ``selector`` or ``threshold_interval`` if invalid.

    Notes
    -----
    Output indices are int64 ascending; values are sums over ranks in the work dtype (float32
    for float16 gradients), bit-identical on every rank (every rank receives the owners' bytes).
    ``stats["h"]`` is the pre-SAG budget used in the last step (d > 1 only).
    """

    name = "spardl"
    options = {"teams": 1, "selector": "exact", "threshold_interval": 32}

    def __init__(self, comm, n, **kwargs):
        super().__init__(comm, n, **kwargs)
        # Splitting is collective: only after the base's cross-rank check passed on every rank.
        d, m = self.d, self.m
        self._team = self.comm if d == 1 else self.comm.split(self.rank // m, self.rank % m)
        if d == 1:
            self._cross = None
        elif m == 1:
            self._cross = self.comm
        else:
            self._cross = self.comm.split(self.rank % m, self.rank // m)

    # -- setup ------------------------------------------------------------------------------
    def _setup(self) -> None:
        d = self.opts["teams"]
        check_int("teams", d)
        if d < 1 or self.P % d:
            raise ValueError(f"teams must be a positive divisor of P={self.P}, got {d}")
        tau = self.opts["threshold_interval"]
        check_int("threshold_interval", tau)
        if tau < 1:
            raise ValueError(f"threshold_interval must be >= 1, got {tau}")
        kind = self.opts["selector"]
        self.selector = (
            make_selector(kind, interval=int(tau)) if kind == "threshold" else make_selector(kind)
        )
        self.d = int(d)
        self.m = self.P // self.d
        self.team_id = self.rank // self.m
        self.p = self.rank % self.m  # position in the team = the block this rank owns
        self.bounds = K.uniform_bounds(self.n, self.m)
        lengths = np.diff(self.bounds)
        self.C = -(-self.n // self.m)
        self._starts = [int(b) for b in self.bounds[:-1]]
        self._idt = wire_index_dtype(int(lengths.max()))
        self._budgets()
        self._srs = srs_schedule(self.m, self.p)
        self._team_ag = bruck_schedule(self.m, self.p)
        self._cross_ag = bruck_schedule(self.d, self.team_id)

    def _budgets(self) -> None:
        """What depends on ρ: the block budgets k_b, the pre-SAG budget h and its floor."""
        lengths = np.diff(self.bounds)
        kb = budget(self.density, self.C)  # max(1, ⌊ρ·C⌋), at most C
        self.k_b = [int(min(length, kb)) for length in lengths]
        kb_own = self.k_b[self.p]
        h0 = max(1, math.floor(self.density * self.C / self.d * (1 + 1e-9)))
        self.h_min = min(kb_own, max(1, kb_own // self.d))
        if kb_own == lengths[self.p]:
            # ρ·C covers the whole block: nothing is to be dropped, so the owners send it all
            # (the union cannot exceed k_b) and density 1 stays the exact mean for every d.
            self.h_min = kb_own
        self.h = max(self.h_min, min(kb_own, h0))

    def _density_changed(self) -> None:
        # New k_b and h (h restarts from its initial value ρ·C/d for the new ρ); the selector
        # restarts a block's threshold itself when that block's k changes.
        self._budgets()

    # -- pieces -----------------------------------------------------------------------------
    def _first_selection(self):
        # The first selections read X unchanged: the blocks sent in SRS's first round, or, in a
        # team of one, the owner's own block (k_b, or h before SAG across teams).
        if self.selector.kind != "exact":
            return None
        ks = np.zeros(self.m, np.int64)
        if self._srs:
            for b in self._srs[0].send:
                ks[b] = self.k_b[b]
        else:
            ks[self.p] = self.k_b[self.p] if self.d == 1 else self.h
        return ks, self.bounds

    def _select(self, S, b, k):
        """Top-k of the partial sum of block b: absolute int64 indices and values."""
        pre = self._preselected(b, k)
        if pre is not None:
            return pre
        lo, hi = self._starts[b], int(self.bounds[b + 1])
        rel, vals = self.selector.select(S[lo:hi], k, key=b)
        return A.shift(rel, lo), vals

    def _bruck(self, comm, rounds, me, item, start_of, cap_of, vdt, keep=None):
        """Bruck all-gather of packed sparse items; returns {item id: (indices, values)}.

        Every rank holds each item as every rank decoded it (its own too: ``wire="compact"``
        rounds the values once, and relays send them on unchanged). With ``keep=(S, log)``
        what the wire rounded off this rank's own item is added into S (first logged in the
        undo list ``log`` unless it is None)."""
        held = {me: item}
        for rnd in rounds:
            delivered = []
            got = comm.exchange_blocks(
                rnd.dest,
                [held[q] for q in rnd.send],
                [start_of(q) for q in rnd.send],
                rnd.source,
                [start_of(q) for q in rnd.recv],
                sum(cap_of(q) for q in rnd.recv),
                self._idt,
                vdt,
                wire=self.wire,
                sent=delivered,
            )
            for q, v in zip(rnd.send, delivered, strict=True):
                if v is not held[q][1]:
                    held[q] = (held[q][0], v)
            held.update(zip(rnd.recv, got, strict=True))
        if keep is not None and held[me][1] is not item[1]:
            S, log = keep
            if log is not None:
                log.append((item[0], K.gather(S, item[0])))
            keep_remainder(S, item[0], item[1], held[me][1], self.residual_mode)
        return held

    # -- the step ---------------------------------------------------------------------------
    def _reduce(self, x: np.ndarray) -> Reduced:
        vdt = np.dtype(x.dtype)
        dev = A.is_device(x)  # GPU gradients: every buffer below stays on the device
        mc = self.selector.max_count
        # The partial sums live in x itself (no second length-n buffer: at large n a copy costs
        # as much as a selection). Every change is logged with the values it overwrote, and
        # replaying the log backwards restores O = X exactly (bit for bit) in step 3.
        S = x
        undo = []
        sent = []
        with self.comm.phase("srs"):
            for rnd in self._srs:
                blocks = [self._select(S, b, self.k_b[b]) for b in rnd.send]
                delivered = []
                got = self._team.exchange_blocks(
                    rnd.dest,
                    blocks,
                    [self._starts[b] for b in rnd.send],
                    rnd.source,
                    [self._starts[b] for b in rnd.recv],
                    sum(mc(self.k_b[b]) for b in rnd.recv),
                    self._idt,
                    vdt,
                    wire=self.wire,
                    sent=delivered,
                )
                # A sent block is never received again (the tree): its partial sum with the
                # sent positions zeroed is final and is this rank's step-2 residual (GRC).
                for (idx, vals), q in zip(blocks, delivered, strict=True):
                    undo.append((idx, vals))  # vals = S[idx] at send time
                    A.zero_at(S, idx)
                    keep_remainder(S, idx, vals, q, self.residual_mode)  # compact: the rounding
                    sent.append(idx)
                for idx, vals in got:
                    undo.append((idx, K.gather(S, idx)))
                    K.scatter_add(S, idx, vals)

        p, kb = self.p, self.k_b[self.p]
        if self.d == 1:
            own = self._select(S, p, kb)
            # No undo entry: own is block p's part of I (GRC keeps its step-2 value, 0) and it
            # is sent (local error feedback zeroes it too).
            A.zero_at(S, own[0])
            sent.append(own[0])
            cap_team = lambda q: mc(self.k_b[q])  # noqa: E731
        else:
            h = self.h
            mine = self._select(S, p, h)
            undo.append(mine)
            A.zero_at(S, mine[0])
            sent.append(mine[0])
            with self.comm.phase("sag_teams"):
                sel = self._bruck(
                    self._cross,
                    self._cross_ag,
                    self.team_id,
                    mine,
                    lambda t: self._starts[p],
                    lambda t: mc(h),
                    vdt,
                    keep=(S, None),  # mine is logged
                )
            # Team order 0 … d−1: the same sums in the same order on all d owners.
            ui, uv = K.coalesce(
                A.concat([sel[t][0] for t in range(self.d)], np.int64, dev),
                A.concat([sel[t][1] for t in range(self.d)], vdt, dev),
            )
            u = int(ui.shape[0])
            rel, top = K.topk_abs(uv, min(kb, u))
            own = (A.take(ui, rel), top)
            self.stats["h"] = h
            self.h = next_h(h, u, kb, self.d)
            cap_team = lambda q: self.k_b[q]  # noqa: E731

        with self.comm.phase("sag_allgather"):
            # The d owners of block p hold the same own: one of them keeps its rounding.
            keep = (S, None if self.d == 1 else undo) if self.team_id == 0 else None
            blocks = self._bruck(
                self._team, self._team_ag, p, own, lambda q: self._starts[q], cap_team, vdt, keep
            )
        indices = A.concat([blocks[q][0] for q in range(self.m)], np.int64, dev)
        values = A.concat([blocks[q][1] for q in range(self.m)], vdt, dev)

        if self.residual_mode == "global":
            # GRC step 3: on I, E is the step-2 value (S as it is now); outside I, E = O. Every
            # change logged outside I is undone, newest first, so each position ends with the
            # value it had before its first change: O = X.
            for idx, old in reversed(undo):
                A.set_outside(S, idx, old, indices)
        elif self.residual_mode == "local":
            for idx, old in reversed(undo):
                A.set_at(S, idx, old)  # now S is O = X again
            A.zero_at(S, A.concat(sent, np.int64, dev))
        return Reduced(indices, values, S)

    # -- state ------------------------------------------------------------------------------
    def _extra_state(self) -> dict:
        return {"h": self.h, "selector": self.selector.state_dict()}

    def _load_extra_state(self, state: dict) -> None:
        if not state:
            return
        h = int(state["h"])
        if not self.h_min <= h <= self.k_b[self.p]:
            raise ValueError(f"state has h={h}, outside [{self.h_min}, {self.k_b[self.p]}]")
        self.selector.load_state_dict(state["selector"])
        self.h = h
