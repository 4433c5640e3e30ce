"""`spardl`: Spar-Reduce-Scatter, Spar-All-Gather with teams, Global Residual Collection.

Zhao et al., "SparDL: Distributed Deep Learning Training with Efficient Sparse Communication",
arXiv 2304.00737 (Sec. 4: SRS and SAG; Sec. 5: GRC); docs/design.md §4 states it as implemented
here.
"""

from __future__ import annotations

import numpy as np

import spardl_kernels as K

from .. import _arrays as A
from .._checks import check_int, type_name
from ..comm import signature_field, wire_index_dtype
from ..cost_model import density_floor
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

    1. **Spar-Reduce-Scatter** (:meth:`_spar_reduce_scatter`, phase ``"srs"``), inside each
       team, ⌈log₂m⌉ rounds (:func:`spardl.schedules.srs_schedule`): just before a block is
       sent, the rank re-selects the top-k_b of its current partial sum of that block; all
       blocks of a round travel in one packed message; received pairs are added into the
       partial sum. Team position p ends owning block p.
    2. **Spar-All-Gather across teams** (:meth:`_spar_all_gather_across_teams`, phase
       ``"sag_teams"``, only for d > 1; with d = 1 the owner keeps the top-k_b of its block):
       the owner selects the top-h of its block; the d owners of block p exchange their
       selections by a Bruck all-gather (⌈log₂d⌉ rounds), coalesce them in team order
       0 … d−1 and keep the top-k_b of the union. h starts at max(1, ⌊ρC/d⌋) and adapts
       between steps (:func:`next_h`); where k_b is the whole block (ρ·C ≥ block length)
       h = k_b, since nothing is to be dropped.
    3. **Spar-All-Gather inside the team** (:meth:`_spar_all_gather_within_team`, phase
       ``"sag_allgather"``): a Bruck all-gather (⌈log₂m⌉ rounds) gives every rank every block.
    4. **Global Residual Collection** (:meth:`_global_residual_collection`,
       ``residual="global"``): each rank's partial sums, with what it sent (or selected as
       owner) zeroed, are its step-2 residual; with I the final indices, E_new = O (= X)
       outside I and the step-2 value on I (:class:`_PartialSums` keeps the bookkeeping).
       Nothing is lost: Σ_r X_r = P·out + Σ_r E_r,new (op="mean").
       ``residual="local"`` (plain error feedback, an ablation): E_new = X with every position
       this rank sent (or selected as owner) zeroed. Mass a rank forwarded for others and that
       was dropped downstream, and its own entries dropped after it sent them, are lost.

    Parameters
    ----------
    comm, n, density, op, residual, nonfinite, check, wire
        As :class:`spardl.algorithms.base.Allreducer`.
    teams : int, default 1
        d, the number of teams; must divide P. 1 is bandwidth-optimal (≈ 4k(P−1)/P words,
        2⌈log₂P⌉ messages per rank); P is all-gather-like (⌈log₂P⌉ messages).
    selector : {"exact", "threshold"}, default "exact"
        How blocks are sparsified (:mod:`spardl.selection`).
    threshold_interval : int, default 32
        τ' of the threshold selector (steps between exact recomputations), ≥ 1. Given with
        ``selector="exact"``, which has no threshold to reuse, it is a ``ValueError``.

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
        self._team = self.comm if d == 1 else self._split(self.rank // m, self.rank % m)
        if d == 1:
            self._cross = None
        elif m == 1:
            self._cross = self.comm
        else:
            self._cross = self._split(self.rank % m, self.rank // m)

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
        if not isinstance(kind, str):
            raise TypeError(f"selector must be a string, got {type_name(kind)}")
        if kind == "exact" and "threshold_interval" in self.given_options:
            raise ValueError(
                "threshold_interval applies to selector='threshold' only; "
                "selector='exact' computes the exact top-k every step"
            )
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
        h0 = max(1, density_floor(self.density, self.C, self.d))
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

    def _bruck(self, comm, rounds, me, item, start_of, cap_of, vdt):
        """Bruck all-gather of packed sparse items; returns {item id: (indices, values)}.

        Every rank holds each item as every rank decoded it (its own too: ``wire="compact"``
        rounds the values once, and relays send them on unchanged)."""
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
        return held

    # -- the step: the paper's procedures -----------------------------------------------------
    def _reduce(self, x: np.ndarray) -> Reduced:
        vdt = np.dtype(x.dtype)
        sums = _PartialSums(x, self.residual_mode)
        with self.comm.phase("srs"):
            self._spar_reduce_scatter(sums, vdt)
        if self.d == 1:
            own = self._select(sums.S, self.p, self.k_b[self.p])
            # Block p's part of I: it keeps its step-2 value (0), so no log entry is needed.
            sums.send(*own, logged=False)
        else:
            with self.comm.phase("sag_teams"):
                own = self._spar_all_gather_across_teams(sums, vdt)
        with self.comm.phase("sag_allgather"):
            indices, values = self._spar_all_gather_within_team(sums, own, vdt)
        if self.residual_mode == "global":
            residual = self._global_residual_collection(sums, indices)
        elif self.residual_mode == "local":
            residual = sums.forget_sent()
        else:
            residual = sums.S  # "none": the base class does not keep it
        return Reduced(indices, values, residual)

    def _spar_reduce_scatter(self, sums, vdt) -> None:
        """Spar-Reduce-Scatter (paper Sec. 4; docs/design.md §4.2) inside the team: ⌈log₂m⌉
        rounds; each block is re-selected (top-k_b of the current partial sum) just before it is
        sent, and received pairs are added into the partial sums. Position p ends holding block
        p summed over the team."""
        mc = self.selector.max_count
        for rnd in self._srs:
            blocks = [self._select(sums.S, b, self.k_b[b]) for b in rnd.send]
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
            # A sent block is never received again (the tree): its partial sum with the sent
            # positions zeroed is final and is this rank's step-2 residual there (GRC).
            for (idx, vals), q in zip(blocks, delivered, strict=True):
                sums.send(idx, vals, q)
            for idx, vals in got:
                sums.receive(idx, vals)

    def _spar_all_gather_across_teams(self, sums, vdt):
        """Spar-All-Gather across teams (paper Sec. 4, d > 1; docs/design.md §4.3): the owner
        gives up the top-h of its block, the d owners of block p all-gather their selections,
        and each keeps the top-k_b of the union (coalesced in team order 0 … d−1: the same sums
        in the same order on all d owners). Returns the block's (indices, values); updates h."""
        p, kb, h = self.p, self.k_b[self.p], self.h
        dev = A.is_device(sums.S)
        mine = self._select(sums.S, p, h)
        sums.send(*mine)
        sel = self._bruck(
            self._cross,
            self._cross_ag,
            self.team_id,
            mine,
            lambda t: self._starts[p],
            lambda t: self.selector.max_count(h),
            vdt,
        )
        # mine is logged already: the wire's rounding of it needs no entry of its own.
        sums.keep_rounding(*mine, sel[self.team_id][1], logged=False)
        ui, uv = K.coalesce(
            A.concat([sel[t][0] for t in range(self.d)], np.int64, dev),
            A.concat([sel[t][1] for t in range(self.d)], vdt, dev),
        )
        u = int(ui.shape[0])
        self.stats["h"] = h
        self.h = next_h(h, u, kb, self.d)
        if u <= kb:  # the whole union is its own top-k_b (coalesce's arrays are fresh)
            return ui, uv
        rel, top = K.topk_abs(uv, kb)
        return A.take(ui, rel), top

    def _spar_all_gather_within_team(self, sums, own, vdt):
        """Spar-All-Gather within the team (paper Sec. 4; docs/design.md §4.3): a Bruck
        all-gather over the m positions gives every rank every block; returns the output's
        (int64 indices, values), in block order."""
        # Receive capacities: with d = 1 a block is the selector's choice, which the threshold
        # selector may let exceed k_b (up to max_count(k_b)); with d > 1 it is the exact top-k_b
        # of the union, never more than k_b entries.
        if self.d == 1:
            cap = lambda q: self.selector.max_count(self.k_b[q])  # noqa: E731
        else:
            cap = lambda q: self.k_b[q]  # noqa: E731
        p = self.p
        blocks = self._bruck(self._team, self._team_ag, p, own, lambda q: self._starts[q], cap, vdt)
        if self.team_id == 0:
            # The d owners of block p hold the same own: one of them keeps its rounding. With
            # d > 1 its positions may lie outside what this rank sent, so "local" must undo it.
            sums.keep_rounding(*own, blocks[p][1], logged=self.d > 1)
        i, v = blocks[p]
        if self.m == 1 and self.d > 1 and i.dtype == np.int64 and v.dtype == vdt:
            # One block, the union's top-k_b in fresh arrays: the output as they are.
            return i, v
        dev = A.is_device(sums.S)
        indices = A.concat([blocks[q][0] for q in range(self.m)], np.int64, dev)
        values = A.concat([blocks[q][1] for q in range(self.m)], vdt, dev)
        return indices, values

    def _global_residual_collection(self, sums, indices):
        """Global Residual Collection (paper Sec. 5; docs/design.md §4.4) with I = ``indices``:
        E_new = O (= X) outside I, and on I the step-2 residual, the partial sums with what this
        rank gave up zeroed. Returns E_new, in X's buffer (:meth:`_PartialSums.restore_outside`
        says why that equals the paper's bookkeeping on O and E)."""
        return sums.restore_outside(indices)

    # -- state ------------------------------------------------------------------------------
    def _extra_state(self) -> dict:
        return {"h": self.h, "selector": self.selector.state_dict()}

    @classmethod
    def _state_fields(cls, comm, extra: dict, opts: dict) -> list[int]:
        d = opts["teams"]
        if d == 1 or not extra:
            return []
        return [owners_h_field(comm, extra.get("h"), comm.size // d)]

    def _state_words(self) -> dict:
        return {} if self.d == 1 else {"state's h": self.h}

    def _load_extra_state(self, state: dict) -> None:
        if not state:
            return
        h = int(check_int("state h", state["h"]))  # 3.5 or "3" was truncated or parsed
        if not self.h_min <= h <= self.k_b[self.p]:
            raise ValueError(
                f"state has h={h}, outside [{self.h_min}, {self.k_b[self.p]}], the range at its "
                f"density {self.density!r} (did the state's density change without its h?)"
            )
        self.selector.load_state_dict(state["selector"])
        self.h = h


def owners_h_field(comm, h, m: int) -> int:
    """The loaded-state field by which SparDL's ranks agree on h (collective over ``comm``).

    With d > 1 teams of m = P/d ranks, the d owners of a block (the ranks r with the same
    r mod m) exchange top-h selections sized by their own h (docs/design.md §4.3), so they must
    hold the same h; owners of different blocks need not.

    Parameters
    ----------
    comm : spardl.comm.Comm
        The allreducer's communicator (P ranks, rank r owns block r mod m).
    h : int
        This rank's h (any other value is compared by its digest).
    m : int
        Ranks per team, P/d.

    Returns
    -------
    int
        h minus the h of this block's team-0 owner (rank r mod m): 0 on every rank exactly when
        every block's owners agree.
    """
    v = signature_field(h)  # a loaded h that is no integer still takes part in the exchange
    hs = comm.allgather_object(v, control=True)
    return v - hs[comm.rank % m]


class _PartialSums:
    """What a rank holds of the sum being reduced during one SparDL step, and GRC's bookkeeping.

    The partial sums S live in the buffer of X = g + E_old itself: at large n a second length-n
    buffer (the paper's separate O) costs as much as a selection. Every change to S that GRC
    must be able to undo is logged with the values it overwrote.

    **Why replaying the log gives the paper's O and E** (:meth:`restore_outside`). Let I be the
    final output indices. (1) Replaying the log newest first, writing back each entry's old
    values, leaves every logged position with the old value of its *earliest* entry. (2) The
    first change at any position outside I is logged: SRS sends and receives are always
    logged, the owner's top-h (d > 1) is logged before its rounding remainder is kept, and the
    unlogged changes (a team of one's own selection and its rounding) touch only the owned
    block's output indices, which are in I. Before its first change a position holds X, so by
    (1) every position outside I ends with X = O, and positions outside I never changed hold X
    anyway. (3) Positions in I are skipped by the replay and keep what S holds after the final
    all-gather: the partial sum with what this rank sent (or gave up as owner) zeroed, plus
    what the wire rounded off its own values; that is the paper's step-2 residual. So
    E_new = O outside I and the step-2 value on I, exactly GRC's bookkeeping, bit for bit.

    Parameters
    ----------
    x : ndarray or device array of shape (n,), the work dtype
        X = g + E_old; **consumed** (it becomes the partial sums, then E_new).
    mode : {"global", "local", "none"}
        The residual mode (for the wire's rounding remainders, :func:`keep_remainder`).
    """

    def __init__(self, x, mode: str):
        self.S = x
        self.mode = mode
        self._log = []  # (indices, values overwritten), oldest first
        self._sent = []  # indices this rank gave up, for residual="local"

    def send(self, idx, vals, delivered=None, logged=True) -> None:
        """This rank gives up S[idx] = vals (sent, or kept as the owner's selection): zeroed
        here, plus what the wire rounded off (``delivered``: the values as decoded)."""
        if logged:
            self._log.append((idx, vals))  # vals = S[idx] as it was
        A.zero_at(self.S, idx)
        if delivered is not None:
            keep_remainder(self.S, idx, vals, delivered, self.mode)  # compact: the rounding
        self._sent.append(idx)

    def receive(self, idx, vals) -> None:
        """Received pairs are added into the partial sums: S[idx] += vals."""
        self._log.append((idx, K.gather(self.S, idx)))
        K.scatter_add(self.S, idx, vals)

    def keep_rounding(self, idx, vals, delivered, logged) -> None:
        """Keep what the wire rounded off values this rank sent on (nothing for "coo")."""
        if delivered is vals:
            return
        if logged:
            self._log.append((idx, K.gather(self.S, idx)))
        keep_remainder(self.S, idx, vals, delivered, self.mode)

    def restore_outside(self, members):
        """GRC's step 3: replay the log newest first at the positions not in the ascending
        ``members`` (I); returns S, now E_new (see the class docstring)."""
        return A.set_outside_log(self.S, self._log, members)

    def forget_sent(self):
        """``residual="local"``: S back to X everywhere, then every position given up zeroed."""
        for idx, old in reversed(self._log):
            A.set_at(self.S, idx, old)
        return A.zero_at(self.S, A.concat(self._sent, np.int64, A.is_device(self.S)))
