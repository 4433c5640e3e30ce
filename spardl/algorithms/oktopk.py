"""`oktopk`: Ok-Topk's O(k) sparse allreduce (Li & Hoefler, PPoPP 2022, arXiv 2201.07598).

:meth:`OkTopk._reduce` is the paper's Algorithm 1, one method per step:

1. lines 1-3, local top-k with a threshold re-evaluated every τ' steps (:meth:`_local_topk`);
2. lines 4-6, space repartition every τ steps: P contiguous regions at the averaged
   P-quantiles of the ranks' selected indices (:meth:`_space_repartition`);
3. line 7, split and reduce: region j's selected entries go to rank j, destinations rotated
   (:meth:`_split_and_reduce`);
4. lines 8-10, the global threshold re-evaluated every τ' steps on the reduced regions
   (:meth:`_global_threshold_of_step`, :meth:`_global_threshold`);
5. line 11, balance and allgatherv: owners keep what passes the global threshold, redistribute
   it so every rank holds the same number of entries, and all-gather (:meth:`_balance`,
   :meth:`_allgather`);
6. line 12 and Algorithm 2, the residual: zeroed where this rank's local top-k meets the
   output (:meth:`_residual_after`).
"""

from __future__ import annotations

import math

import numpy as np

import spardl_kernels as K

from .. import _arrays as A
from .._checks import check_float, check_int, type_name
from ..comm import (
    pack_blocks,
    pack_wire,
    signature_digest,
    unpack_blocks,
    unpack_wire,
    wire_index_dtype,
)
from ..selection import make_selector
from .base import Above, Allreducer, Reduced, _float_bits
from .common import keep_remainder

__all__ = ["OkTopk"]

#: Exponent γ of the global threshold's nudge between re-evaluations (the same rule as the
#: local :class:`spardl.selection.ThresholdSelector`): t ← t·clip(((M+1)/(k+1))^γ, 1/2, 2).
GLOBAL_NUDGE = 0.1


def _positive_int(name, v):
    check_int(name, v)
    if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    return int(v)


def region_fields(bounds, global_threshold) -> list[int]:
    """The loaded-state fields every rank of Ok-Topk must share: a digest of the region bounds
    and the bits of the reused global threshold (every rank reduces over the same regions and
    selects with the same threshold, and its messages are sized by both).

    Parameters
    ----------
    bounds : array_like of int, shape (P + 1,), or None
        The regions' boundaries (None before the first step).
    global_threshold : float
        The reused global threshold (NaN before it is first estimated).

    Returns
    -------
    list of int
        Two signature fields; bounds that are not integers give a field of their own (so that
        the comparison, not this function, reports them).
    """
    try:
        b = -1 if bounds is None else signature_digest(np.asarray(bounds, np.int64).tobytes())
    except (TypeError, ValueError, OverflowError):
        b = signature_digest(repr(bounds))
    try:
        t = _float_bits(float(global_threshold))
    except (TypeError, ValueError, OverflowError):
        t = signature_digest(repr(global_threshold))
    return [b, t]


class OkTopk(Allreducer):
    """Ok-Topk sparse allreduce on the project's kernels.

    Per step and rank, with k = ⌊ρn⌋ and M the number of entries in the output:

    * "split_reduce": P−1 point-to-point messages (one packed message per destination), plus
      one allreduce of the P+1 boundaries on region steps;
    * "global_threshold": on re-evaluation steps, one all-gather of each owner's top-k reduced
      magnitudes (k values, zero padded);
    * "balance": one all-gather of the P owner counts and P−1 point-to-point messages;
    * "allgather": one all-gather of the balanced chunks (⌈M/P⌉ pairs each, padded).

    That is 2P messages per step, 2P + 2 on steps that also re-evaluate the regions and the
    threshold: within the paper's (2P + 2 log₂P)·α for every P ≥ 2 (Eq. 3), since this project
    counts a collective call as one message. Nothing is sent when P = 1.

    Residual: with ``residual="global"``, E_r = X_r except on the coordinates of the output,
    where E_r[i] = X_r[i] − (what rank r contributed to i): entries that were selected locally but
    fell below the global threshold stay with the rank that selected them, so
    Σ_r X_r = P·out + Σ_r E_r holds (op="mean"). With ``residual="local"``, E_r = X_r with every
    locally selected entry zeroed, as in plain error feedback (the dropped ones are lost).

    Parameters
    ----------
    comm, n, density, op, residual, nonfinite, check, wire
        See :class:`spardl.algorithms.base.Allreducer`.
    threshold_interval : int, default 32
        τ': the local and the global thresholds are computed exactly every τ' steps (step 0
        included) and reused, nudged towards k selected entries, in between. ≥ 1.
    region_interval : int, default 64
        τ: the region boundaries are recomputed every τ steps (step 0 included). ≥ 1.
    selector : {"threshold", "exact"}, default "threshold"
        Local selection: Ok-Topk's threshold reuse, or the exact top-k every step.

    Raises
    ------
    ValueError, TypeError
        On every rank, naming the option, if an option is out of range or of the wrong type.

    Notes
    -----
    Li & Hoefler, "Near-Optimal Sparse Allreduce for Distributed Deep Learning", PPoPP 2022,
    arXiv 2201.07598: Algorithm 1, Sec. 3.1.1 (split and reduce, space repartition, threshold
    reuse), Sec. 3.1.2 (balance and allgatherv), Eq. 1-3 (cost ≤ (2P + 2 log P)α + 6k(P−1)/P β),
    Algorithm 2 (residuals zeroed on local ∩ global top-k indices).

    Deviations from the paper, each with its reason:

    * **thresholds move between re-evaluations.** The paper reuses the local and the global
      threshold unchanged for τ' steps. Here both are nudged towards k survivors,
      t ← t·clip(((c+1)/(k+1))^γ, 1/2, 2) with c the count that passed it: the local one
      after each call that reused it, γ = 0.5 (:class:`~spardl.selection.ThresholdSelector`),
      the global one after every step (re-evaluation steps included) for the next, with
      c = M, the output size, and γ = :data:`GLOBAL_NUDGE` = 0.1. A gradient whose scale
      drifts would otherwise select far more or far fewer than k entries until the next
      re-evaluation, and message sizes would grow with it;
    * **exact fallbacks.** A local threshold that would pass more than ⌈1.25·k⌉ entries is
      replaced by the exact top-k that step (receive buffers are sized for that many); a
      threshold that is not finite and positive (all-zero or non-finite data) is never reused;
      and at density 1 (k = n) every entry is selected and the global threshold is 0, so the
      output is the exact mean whatever the thresholds guessed before;
    * **global re-evaluation by one fixed-size all-gather.** Each owner contributes the
      magnitudes of its top-k reduced entries (zero padded to k); the k-th largest of those
      is the exact k-th largest reduced magnitude overall, so re-evaluation steps output
      exactly the global top-k of the reduced sums (plus ties), in one message of known size.
      The authors' code all-gathers every reduced (index, value) pair instead. A NaN
      threshold (NaN data) becomes 0: every reduced entry is kept and the non-finite policy
      of the base class decides. The global threshold is also re-evaluated whenever none is
      known (the first step, after a density change or after loading a state without one);
    * **regions.** The boundaries are the integer mean (floor) of the ranks' P-quantiles of
      their selected indices, summed exactly in int64 so every rank gets the same integers;
      a rank that selected nothing contributes uniform boundaries. They are also computed
      when none are known (after loading a state without them);
    * **fixed reduction order.** Owners sum the received entries in rank order 0 … P−1, not
      in arrival (rotation) order, so results are bit-identical run to run and on every rank;
    * **the allgatherv is an all-gather** ("coo"): chunks differ by at most one entry after
      balancing, so each is padded to ⌈M/P⌉ pairs and one fixed-size all-gather replaces the
      size exchange and the allgatherv. "compact" messages differ in size and use the
      allgatherv;
    * **the residual keeps the wire's rounding.** Algorithm 2 zeroes the residual on
      local ∩ global indices; here it is zeroed there and then gets what the wire rounded off
      ("compact" messages' 16-bit rounding; nothing for "coo"), so the conservation invariant
      holds for both wires. (Zeroed, not X − sent: a NaN or ±inf that was sent leaves the
      residual, as in every other algorithm.) ``residual="local"`` (an ablation) zeroes
      every locally selected entry, as plain error feedback does.

    GPU gradients keep X, the selections, the reduced regions and the residual on the device;
    region boundaries, counts and thresholds are host scalars.
    """

    name = "oktopk"
    options = {"threshold_interval": 32, "region_interval": 64, "selector": "threshold"}

    def _setup(self) -> None:
        o = self.opts
        self.tau_prime = _positive_int("threshold_interval", o["threshold_interval"])
        self.tau = _positive_int("region_interval", o["region_interval"])
        kind = o["selector"]
        if not isinstance(kind, str):
            raise TypeError(f"selector must be a string, got {type_name(kind)}")
        if kind == "threshold":
            self.selector = make_selector("threshold", interval=self.tau_prime)
        elif kind == "exact":
            self.selector = make_selector("exact")
        else:
            raise ValueError(f"selector must be 'threshold' or 'exact', got {kind!r}")
        self.bounds = None  # region boundaries: int64 array of shape (P+1,)
        self.global_threshold = math.nan

    def _density_changed(self) -> None:
        # The reused global threshold estimated the k-th largest reduced magnitude of the old
        # k: the next step computes it afresh. The regions (balanced by selected counts) stay
        # until their next repartition; the selector restarts its threshold when k changes.
        self.global_threshold = math.nan

    # -- Algorithm 1 ------------------------------------------------------------------------
    def _first_selection(self):
        # The local top-k rides on the X = g + E pass: exactly with the exact selector; with
        # the threshold selector, the entries above the threshold it will reuse this step.
        if self.k == self.n:
            return None
        if self.selector.kind == "exact":
            return np.array([self.k]), np.array([0, self.n])
        t = self.selector.planned(self.n, self.k)
        return None if t is None else Above(t)

    def _reduce(self, x: np.ndarray) -> Reduced:
        """One step of Algorithm 1, its lines in order (the method of each says which)."""
        with self.comm.phase("select"):
            sel_idx, sel_val = self._local_topk(x)
        with self.comm.phase("split_reduce"):
            bounds = self.bounds
            if bounds is None or self.step % self.tau == 0:
                bounds = self._space_repartition(sel_idx)
            sent = []  # (indices, values, decoded) of the pieces sent to the owners
            red_idx, red_val = self._split_and_reduce(sel_idx, sel_val, bounds, sent)
        with self.comm.phase("global_threshold"):
            th = self._global_threshold_of_step(red_val)
            keep_idx, keep_val = K.select_above(red_val, th)
            keep_idx = A.take(red_idx, keep_idx)
        forwarded = []  # the same, of the reduced entries this rank sends on
        with self.comm.phase("balance"):
            counts, bal_idx, bal_val = self._balance(keep_idx, keep_val, forwarded)
        with self.comm.phase("allgather"):
            out_idx, out_val = self._allgather(bal_idx, bal_val, counts, forwarded)
        residual = self._residual_after(x, sel_idx, sel_val, out_idx, sent, forwarded)
        # State for the next step, only now: a step the base class does not apply (non-finite
        # output) is rolled back there from its snapshot.
        self.bounds = bounds
        self.global_threshold = self._nudge(th, int(counts.sum()))
        return Reduced(out_idx, out_val, residual)

    def _local_topk(self, x):
        """Algorithm 1, lines 1-3: this rank's local top-k of X, by the local threshold reused
        between exact re-evaluations every τ' steps (:class:`~spardl.selection.ThresholdSelector`)
        or exactly (``selector="exact"``). Returns int64 indices (ascending) and X's values."""
        if self.k == self.n:
            # Density 1 drops nothing: no reused threshold may leave an entry out.
            return A.arange(self.n, A.is_device(x)), A.copy(x)
        pre = self._preselected(0, self.k)  # the exact top-k made while accumulating X
        if pre is not None:
            return pre
        t = self.selector.planned(self.n, self.k)
        above = None if t is None else self._preselected_above(t)  # made while accumulating
        return self.selector.select(x, self.k, above=above)

    def _global_threshold_of_step(self, red_val) -> float:
        """Algorithm 1, lines 8-10: the global threshold, re-evaluated on the reduced regions
        every τ' steps (and whenever none is known: the first step, after a density change or
        a load), else the one carried over (nudged by :meth:`_nudge`)."""
        th = self.global_threshold
        if self.k == self.n:
            th = 0.0  # keep every reduced entry; the schedule of messages stays the same
        if self.step % self.tau_prime == 0 or not math.isfinite(th):
            th = self._global_threshold(red_val)
        return th

    def _space_repartition(self, sel_idx):
        """P+1 region boundaries: the mean of every rank's P-quantiles of its selected indices."""
        mine = A.to_host(K.balanced_bounds(sel_idx, self.n, self.P))
        if self.P == 1:
            return mine
        # An exact int64 sum, then floor division: the same integers on every rank, 0 and n at
        # the ends, and monotone because each rank's boundaries are.
        total = self.comm.allreduce(mine.astype(np.int64), "sum")
        return total // self.P

    def _split_and_reduce(self, sel_idx, sel_val, bounds, sent=None):
        """Send region j's selected entries to rank j; return this rank's reduced region.
        ``sent`` gets (indices, values, decoded values) of every piece sent."""
        P, r = self.P, self.rank
        offs = A.to_host(K.block_offsets(sel_idx, bounds))

        def region(j):
            return sel_idx[offs[j] : offs[j + 1]], sel_val[offs[j] : offs[j + 1]]

        parts = [None] * P
        parts[r] = region(r)
        lengths = np.diff(bounds)
        wire = wire_index_dtype(int(lengths.max(initial=0)))
        cap = min(self.selector.max_count(self.k), int(lengths[r]))
        for i in range(1, P):
            dest, src = (r + i) % P, (r - i) % P
            delivered = []
            (parts[src],) = self.comm.exchange_blocks(
                dest,
                [region(dest)],
                [int(bounds[dest])],
                src,
                [int(bounds[r])],
                cap,
                wire,
                sel_val.dtype,
                wire=self.wire,
                sent=delivered,
            )
            if sent is not None:
                sent.append((*region(dest), delivered[0]))
        # Sum in rank order so the result does not depend on the rotation.
        dev = A.is_device(sel_val)
        return K.coalesce(
            A.concat([p[0] for p in parts], np.int64, dev),
            A.concat([p[1] for p in parts], sel_val.dtype, dev),
        )

    def _global_threshold(self, red_val):
        """The k-th largest reduced magnitude over all regions (0 when fewer than k exist)."""
        k = self.k
        _, top = K.topk_abs(red_val, min(k, red_val.shape[0]))
        dev = A.is_device(red_val)
        mags = A.concat(
            [A.absolute(top), A.zeros(k - top.shape[0], red_val.dtype, dev)], red_val.dtype, dev
        )
        everyone = self.comm.allgather_array(mags).reshape(self.P * k) if self.P > 1 else mags
        th = float(K.kth_largest_abs(everyone, k))
        # NaN data gives a NaN threshold; 0 keeps every reduced entry (NaN included).
        return th if math.isfinite(th) else 0.0

    def _balance(self, keep_idx, keep_val, sent=None):
        """Redistribute the kept entries (in global index order) evenly: rank q gets positions
        uniform_bounds(M, P)[q] … [q+1] of their concatenation over owners 0 … P−1.
        ``sent`` gets (indices, values, decoded values) of every piece sent."""
        P, r = self.P, self.rank
        if P == 1:
            return np.array([keep_idx.shape[0]], np.int64), keep_idx, keep_val
        counts = self.comm.allgather_array(np.array([keep_idx.shape[0]], np.int64))[:, 0]
        have = np.concatenate(([0], np.cumsum(counts)))  # owner s holds have[s] … have[s+1]
        want = K.uniform_bounds(int(have[-1]), P)  # rank q gets want[q] … want[q+1]

        def overlap(s, q):  # positions, relative to owner s's segment, that s gives to q
            lo, hi = max(have[s], want[q]), min(have[s + 1], want[q + 1])
            return int(lo - have[s]), int(max(lo, hi) - have[s])

        def piece(q):
            a, b = overlap(r, q)
            return keep_idx[a:b], keep_val[a:b]

        wire = wire_index_dtype(self.n)
        parts = [None] * P
        parts[r] = piece(r)
        for i in range(1, P):
            dest, src = (r + i) % P, (r - i) % P
            a, b = overlap(src, r)
            delivered = []
            (parts[src],) = self.comm.exchange_blocks(
                dest,
                [piece(dest)],
                [0],
                src,
                [0],
                b - a,
                wire,
                keep_val.dtype,
                wire=self.wire,
                sent=delivered,
            )
            if sent is not None:
                sent.append((*piece(dest), delivered[0]))
        # Owners' segments are consecutive in index order, so rank order keeps indices sorted.
        dev = A.is_device(keep_val)
        return (
            counts,
            A.concat([p[0] for p in parts], np.int64, dev),
            A.concat([p[1] for p in parts], keep_val.dtype, dev),
        )

    def _allgather(self, bal_idx, bal_val, counts, sent=None):
        """Every rank gets every kept entry: one all-gather of equal-size padded chunks
        ("compact": the chunks as they are, whose encoded sizes differ, after their sizes;
        ``sent`` gets (indices, values, decoded values) of this rank's chunk)."""
        P = self.P
        if P == 1:
            return bal_idx, bal_val
        if self.wire != "coo":
            dev = A.is_device(bal_val)
            vdt = np.dtype(bal_val.dtype)
            idt = wire_index_dtype(self.n)
            buf, delivered = pack_wire(
                [(bal_idx, bal_val)], [0], idt, vdt, self.wire, quantise=self.comm.quantise
            )
            if sent is not None:
                sent.append((bal_idx, bal_val, delivered[0]))
            rows = self.comm.allgatherv_bytes(buf, pad=True)
            chunks = [unpack_wire(row, 1, [0], idt, vdt, self.wire, dev)[0] for row in rows]
            return (
                A.concat([c[0] for c in chunks], np.int64, dev),
                A.concat([c[1] for c in chunks], vdt, dev),
            )
        M = int(counts.sum())
        sizes = np.diff(K.uniform_bounds(M, P))
        c_max = int(sizes.max(initial=0))
        # Chunks differ by at most one entry: padding them to ⌈M/P⌉ turns the allgatherv into
        # an all-gather of one fixed-size buffer (no size exchange, one message).
        pad = c_max - bal_idx.shape[0]
        dev = A.is_device(bal_val)
        vdt = np.dtype(bal_val.dtype)
        idx = A.concat((bal_idx, A.zeros(pad, np.int64, dev)), np.int64, dev)
        val = A.concat((bal_val, A.zeros(pad, vdt, dev)), vdt, dev)
        wire = wire_index_dtype(self.n)
        mine = pack_blocks([(idx, val)], [0], wire, vdt, device_range_check=False)
        everyone = self.comm.allgather_array(mine)
        chunks = [unpack_blocks(everyone[q], 1, [0], wire, vdt)[0] for q in range(P)]
        return (
            A.concat([c[0][: sizes[q]] for q, c in enumerate(chunks)], np.int64, dev),
            A.concat([c[1][: sizes[q]] for q, c in enumerate(chunks)], vdt, dev),
        )

    def _residual_after(self, x, sel_idx, sel_val, out_idx, sent, forwarded):
        """Algorithm 1, line 12, and Algorithm 2's residual: X minus what this rank contributed,
        where it counted (local top-k ∩ global output), plus what the wire rounded off.

        Written into X itself: the step owns it (the base class never hands in a buffer anyone
        else holds), and a step that is not applied keeps the old residual. ``sent`` and
        ``forwarded``: (indices, values, decoded values) of the pieces this rank sent to owners
        and of the reduced entries it sent on."""
        residual = x
        mode = self.residual_mode
        if mode == "local":
            # forget everything sent, even if dropped downstream
            A.zero_at(residual, sel_idx)
        else:
            # Contributed and in the output (local top-k ∩ global top-k): E = 0 there (what was
            # sent is X itself; a non-finite one leaves too), plus the wire's rounding below.
            A.zero_members(residual, sel_idx, out_idx)
        # What the wire rounded off stays here ("compact"; nothing for "coo"): a selected
        # entry's where it counted (all of X stays where it did not), and the whole remainder
        # of every reduced entry forwarded (they all reach the output).
        reached = out_idx if mode == "global" else None
        for i, v, q in sent:
            keep_remainder(residual, i, v, q, mode, members=reached)
        for i, v, q in forwarded:
            keep_remainder(residual, i, v, q, mode)
        return residual

    def _nudge(self, th, M):
        """Move the reused global threshold towards k surviving entries for the next step."""
        if not (math.isfinite(th) and th > 0):
            return th
        factor = ((M + 1) / (self.k + 1)) ** GLOBAL_NUDGE
        return th * min(2.0, max(0.5, factor))

    # -- checkpoints ------------------------------------------------------------------------
    def _extra_state(self) -> dict:
        return {
            "bounds": None if self.bounds is None else self.bounds.copy(),
            "global_threshold": self.global_threshold,
            "selector": self.selector.state_dict(),
        }

    @classmethod
    def _state_fields(cls, comm, extra: dict, opts: dict) -> list[int]:
        if not extra:
            return []
        return region_fields(extra.get("bounds"), extra.get("global_threshold", math.nan))

    def _state_words(self) -> dict:
        return {
            "state's region bounds": None if self.bounds is None else self.bounds.tolist(),
            "state's global threshold": self.global_threshold,
        }

    def _load_extra_state(self, state: dict) -> None:
        b = state.get("bounds")
        if b is not None:
            b = np.asarray(b, dtype=np.int64)
            if b.shape != (self.P + 1,) or b[0] != 0 or b[-1] != self.n or np.any(np.diff(b) < 0):
                raise ValueError(
                    f"state bounds must be {self.P + 1} non-decreasing boundaries from 0 to "
                    f"{self.n}, got {b!r}"
                )
        th = check_float("state global_threshold", state.get("global_threshold", math.nan))
        if th < 0:  # NaN (none yet) passes; a negative one selected every reduced value
            raise ValueError(f"state global_threshold must be >= 0 (or NaN), got {th!r}")
        self.bounds = b
        self.global_threshold = float(th)
        if "selector" in state:
            self.selector.load_state_dict(state["selector"])
