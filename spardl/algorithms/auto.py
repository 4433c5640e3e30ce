"""`auto`: the allreduce predicted fastest, chosen on every rank alike and re-chosen as it runs.

Each candidate's step is predicted as the α-β cost of its communication
(:func:`spardl.cost_model.predict`, α and β measured by a short ping-pong at construction, given,
or read from a ``spardl bench pingpong --json`` fit) plus its local work, measured: the first
steps run every candidate in turn (``trials`` steps each), and a step's local work is its wall time
less the model's communication, that is everything the model does not price (the kernels, MPI's
own reduction arithmetic, waiting for slower ranks and for a shared core). Trial steps are real
steps (their results are the allreduce's), so a trial costs only its excess over the best
candidate's step. docs/design.md §12.

The residual is this allreducer's own: a sparse candidate's ``_reduce`` gets X = g + E and returns
the new E, exactly as it does inside its own allreducer, so a switch between sparse candidates
moves nothing and loses nothing. A switch to ``dense`` flushes the residual: the first dense
step reduces X = g + E (dense's own step on X, or for float16 gradients one generic
step through :meth:`_reduce`), after which E is zero and MPI's own Allreduce runs on the gradient
itself (:class:`~spardl.algorithms.dense.Dense`'s step).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from .. import _arrays as A
from .. import cost_model
from .._checks import check_counter_room, check_float, check_int, load_error, undo_or_break
from ..comm import Comm, name_hash, signature_field, wire_index_dtype
from ..dtypes import work_dtype
from .base import Allreducer, Reduced
from .dense import Dense
from .gaussiank import Gaussiank
from .gtopk import GTopk
from .oktopk import OkTopk
from .spardl import SparDL
from .topka import TopkA
from .topkdsa import TopkDSA

__all__ = ["Auto", "Candidate", "candidate_names", "explain"]

#: The allreducers a candidate may run (``spardl.ALGORITHMS`` without importing the package).
_CLASSES = {
    "dense": Dense,
    "spardl": SparDL,
    "oktopk": OkTopk,
    "topka": TopkA,
    "gtopk": GTopk,
    "topkdsa": TopkDSA,
    "gaussiank": Gaussiank,
}
#: The default candidates (SparDL with every feasible number of teams), in trial order: dense
#: last, so that on a slow link the sparse steps measured first can spare its trial (``prune``).
#: gTop-k is left out: it does not conserve (the partial sums its tree drops belong to no rank's
#: residual); name it in ``candidates`` to allow it anyway. The 16-bit dense allreduce
#: (``Dense(wire_dtype="float16")``) is no candidate for the same reason: what float16 rounds
#: off belongs to no residual.
DEFAULT = ("spardl", "oktopk", "topka", "dense")
#: Ping-pong sizes (bytes) and round trips per size of the measurement at construction.
PINGPONG_SIZES = (8, 4096, 262144)
PINGPONG_REPEAT = 5


@dataclass(frozen=True)
class Candidate:
    """One allreduce ``auto`` may run: ``algorithm`` (a key of :data:`spardl.ALGORITHMS`) with
    ``teams`` (SparDL's d; 1 for the others). ``name`` is how ``stats["auto"]`` lists it."""

    algorithm: str
    teams: int = 1

    @property
    def name(self) -> str:
        return f"spardl:d={self.teams}" if self.algorithm == "spardl" else self.algorithm


def _divisors(P: int) -> list[int]:
    return [d for d in range(1, P + 1) if P % d == 0]


def candidate_names(P: int, candidates=None) -> list[str]:
    """The candidates ``auto`` considers on P ranks, by name.

    Parameters
    ----------
    P : int
        World size, ≥ 1.
    candidates : sequence of str, optional
        Names to choose among: a key of :data:`spardl.ALGORITHMS`, where ``"spardl"`` stands for
        SparDL with every d dividing P, or ``"spardl:d=<d>"`` for one d. Default: SparDL with
        every d, Ok-Topk, TopkA and dense.

    Returns
    -------
    list of str
        In the order given (the order breaks ties), without repeats.

    Raises
    ------
    TypeError
        Naming ``P`` if it is not an integer (bool included); naming ``candidates`` if it is
        not a list or tuple of str.
    ValueError
        Naming ``P`` if it is < 1; naming ``candidates`` if a name is unknown, d does not
        divide P, or it is empty.
    """
    check_int("P", P)
    if P < 1:
        raise ValueError(f"P must be >= 1, got {P}")
    return [c.name for c in _parse_candidates(int(P), candidates)]


def _parse_candidates(P: int, candidates) -> list[Candidate]:
    if candidates is None:
        candidates = DEFAULT
    if isinstance(candidates, str) or not isinstance(candidates, (list, tuple)):
        raise TypeError(
            f"candidates must be a list of algorithm names, got {type(candidates).__name__}"
        )
    out: list[Candidate] = []
    for c in candidates:
        if not isinstance(c, str):
            raise TypeError(f"candidates must hold str names, got {type(c).__name__}")
        if c == "spardl":
            found = [Candidate("spardl", d) for d in _divisors(P)]
        elif c.startswith("spardl:d="):
            try:
                d = int(c.removeprefix("spardl:d="))
            except ValueError:
                raise ValueError(f"candidates: {c!r} is not spardl:d=<integer>") from None
            if d < 1 or P % d:
                raise ValueError(f"candidates: {c!r}: d must be a positive divisor of P={P}")
            found = [Candidate("spardl", d)]
        elif c in _CLASSES:
            found = [Candidate(c)]
        else:
            raise ValueError(
                f"candidates: unknown {c!r}; accepted: {sorted(_CLASSES)} or 'spardl:d=<d>'"
            )
        out += [f for f in found if f not in out]
    if not out:
        raise ValueError("candidates must name at least one algorithm")
    return out


class Auto(Allreducer):
    """The candidate allreduce predicted fastest on this communicator, re-chosen every
    ``interval`` steps (``spardl.make("auto", comm, n, ...)``).

    Parameters
    ----------
    comm, n, density, op, residual, nonfinite, check, wire
        As :class:`spardl.algorithms.base.Allreducer`; every candidate runs with them.
    candidates : list of str, optional
        What to choose among (:func:`candidate_names`), in trial order. Default: SparDL with
        every d dividing P (``"spardl:d=<d>"``), Ok-Topk, TopkA and ``dense`` (MPI's own
        Allreduce).
        gTop-k is eligible only when named here: it does not conserve (its tree drops partial
        sums that no residual keeps), so with it the conservation invariant holds on the steps
        of the other candidates only.
    interval : int, default 100
        Steps between decisions (after the trials), ≥ 1.
    trials : int, default 3
        Steps each candidate runs first, in turn, to measure its local work (the least of its
        last ``trials`` steps is its estimate, the current candidate's refreshed by every step
        it runs; the first step of each absorbs first-call costs). 0: no trials; the choice is
        the model's communication time alone.
    prune : float, default 2.0
        A candidate is not tried when the model's communication alone, C_c, exceeds ``prune``
        times the fastest step measured so far (each candidate's least step, the maximum over
        ranks): it cannot win unless the model overstates its communication that much. Its
        prediction is then C_c. 0 tries every candidate; otherwise ≥ 1.
    alpha, beta : float, optional
        Seconds per message and per byte, ≥ 0, both or neither. Default: measured at
        construction by a ping-pong between ranks 0 and 1 (18 round trips of 8 B to
        256 KiB, :func:`spardl.pingpong.pingpong`); 0 on one rank.
    fit : str or os.PathLike, optional
        A JSON file written by ``spardl bench pingpong --json PATH`` (its ``alpha`` and
        ``beta``), read by rank 0. Not with ``alpha`` and ``beta``.
    hysteresis : float, default 0.05
        A decision after the first switches only if the best prediction is below
        (1 − hysteresis) times the current candidate's, in [0, 1).

    Raises
    ------
    ValueError, TypeError
        On every rank, naming the option, if an option is invalid on any rank or the ranks
        disagree; a fit file that rank 0 cannot read raises on every rank.

    Notes
    -----
    Every rank takes the same decision: the local work of each candidate is the maximum over
    ranks of the ranks' estimates (one allreduce), and rank 0's choice is broadcast; α and β are
    rank 0's ping-pong (broadcast), the options' (agreed by the construction's cross-rank
    check) or rank 0's file. ``stats["auto"]`` holds the choice and every candidate's prediction
    (:func:`explain` prints it). The model counts ``word_bytes`` from the work dtype (an int32
    index and a value per pair; ``wire="compact"``: the model's own estimate,
    :func:`spardl.cost_model.compact_pair_bytes`) and no γ: the merges are local work,
    measured. A step is a transaction as in every allreducer: one that raises or is skipped
    leaves the choice and every candidate's state unchanged; decisions and switches happen only
    after an applied step.
    """

    name = "auto"
    options: dict = {
        "candidates": None,
        "interval": 100,
        "trials": 3,
        "prune": 2.0,
        "alpha": None,
        "beta": None,
        "fit": None,
        "hysteresis": 0.05,
    }

    def __init__(self, comm, n, **kwargs):
        self._inners: dict[int, Allreducer] = {}
        super().__init__(comm, n, **kwargs)
        # Collective from here on: every rank passed the base class's cross-rank check.
        try:
            self._start()
        except BaseException:
            self.close()  # a fit that cannot be read raises on every rank alike
            raise

    def _start(self) -> None:
        self.alpha, self.beta, self.rates = self._rates()
        self._pending: dict[int, tuple] = {}  # loaded states of candidates not built yet
        self._choice = 0
        self._flush = False
        self._trial = [0, 0]  # in the trials: [candidate index, its steps so far]; else None
        self._since = 0  # steps since the last decision
        self._skipped: list[int] = []  # candidates the trials left out (prune)
        self._decisions = 0
        self._switches = 0
        self._predicted: dict = {}
        self._decided_at = None
        if self.trials == 0:
            self._trial = None
            self._decide()
        else:
            self._use(0)
        self._report()

    # -- options --------------------------------------------------------------------------------
    def _setup(self) -> None:
        o = self.opts
        self.cands = _parse_candidates(self.P, o["candidates"])
        self.interval = check_int("interval", o["interval"])
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1, got {self.interval}")
        self.trials = check_int("trials", o["trials"])
        if self.trials < 0:
            raise ValueError(f"trials must be >= 0, got {self.trials}")
        self.prune = float(check_float("prune", o["prune"]))
        if not (self.prune == 0 or 1 <= self.prune < math.inf):
            raise ValueError(f"prune must be 0 or a finite number >= 1, got {self.prune}")
        self.hysteresis = float(check_float("hysteresis", o["hysteresis"]))
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"hysteresis must be in [0, 1), got {self.hysteresis}")
        given = {}
        for name in ("alpha", "beta"):
            v = check_float(name, o[name], or_none=True)
            if v is not None and not (0 <= v < math.inf):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
            given[name] = v
        if (given["alpha"] is None) != (given["beta"] is None):
            raise ValueError("alpha and beta must be given together (or neither)")
        fit = o["fit"]
        if fit is not None:
            if not isinstance(fit, (str, os.PathLike)):
                raise TypeError(f"fit must be a path, got {type(fit).__name__}")
            if given["alpha"] is not None:
                raise ValueError("fit and alpha/beta are exclusive: give one or the other")
        self._given = given
        self.conserves = all(_CLASSES[c.algorithm].conserves for c in self.cands)
        self.window = max(1, self.trials)
        # Per candidate, its last steps' (local, wall, inside MPI) seconds on this rank.
        self._times = [deque(maxlen=self.window) for _ in self.cands]

    def _rates(self) -> tuple[float, float, str]:
        """(α, β, where they come from), the same on every rank (collective)."""
        if self._given["alpha"] is not None:
            return float(self._given["alpha"]), float(self._given["beta"]), "given"
        if self.opts["fit"] is not None:
            return self._read_fit(self.opts["fit"])
        if self.P == 1:
            return 0.0, 0.0, "one rank: no messages"
        from ..pingpong import fit_alpha_beta, pingpong

        ctl = Comm(self.comm)  # a duplicate: the ping-pong's messages stay out of the counters
        try:
            rows = pingpong(ctl, PINGPONG_SIZES, repeat=PINGPONG_REPEAT, warmup=1)
        finally:
            ctl.free()
        # Rank 0's times (pingpong broadcasts them), so the fit is the same float everywhere.
        alpha, beta = fit_alpha_beta([s for s, _ in rows], [max(t, 1e-12) for _, t in rows])
        return alpha, beta, "ping-pong"

    def _read_fit(self, path) -> tuple[float, float, str]:
        got = None
        if self.rank == 0:
            try:
                with open(path) as f:
                    doc = json.load(f)
                a, b = doc["alpha"], doc["beta"]
                for name, v in (("alpha", a), ("beta", b)):
                    check_float(name, v, numpy=False)
                    if not 0 <= v < math.inf:
                        raise ValueError(f"{name} must be a finite number >= 0, got {v}")
                got = (float(a), float(b), None)
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                got = (0.0, 0.0, f"{type(e).__name__}: {e}")
        alpha, beta, err = self.comm.bcast_object(got, root=0, control=True)
        if err is not None:
            raise ValueError(
                f"fit: cannot read alpha and beta from {os.fspath(path)!r} on rank 0 ({err})"
            )
        return alpha, beta, f"fit {os.fspath(path)}"

    def close(self) -> None:
        """As :meth:`Allreducer.close`, for every candidate built so far as well."""
        if not getattr(self, "_closed", True):
            for ar in self._inners.values():
                ar.close()
        super().close()

    # -- the candidates -------------------------------------------------------------------------
    def _inner(self, i: int) -> Allreducer:
        """Candidate i's allreducer, built on first use (collective: every rank builds it at
        the same point). It shares this allreducer's communicator, so its messages count in
        the same ``stats``."""
        ar = self._inners.get(i)
        if ar is None:
            c = self.cands[i]
            ar = _CLASSES[c.algorithm](
                self.comm,
                self.n,
                density=self.density,
                op=self.op,
                residual=self.residual_mode,
                nonfinite=self.nonfinite,
                check=self.check,
                wire=self.wire,
                **self._candidate_options(c),
            )
            # A loaded state waiting for this candidate is applied now; one it refuses on some
            # rank raises on every rank, and the candidate is not kept (its state stays pending).
            pending, err = self._pending.get(i), None
            if pending is not None:
                try:
                    self._set_inner_state(ar, pending)
                except Exception as e:  # noqa: BLE001 - every rank must hear of any failure
                    err = load_error(e)
            try:
                self.collective_check(
                    err,
                    [name_hash(f"auto|build|{c.name}"), i, int(pending is not None)],
                    {"auto builds candidate": c.name, "with a loaded state": pending is not None},
                )
            except BaseException:
                ar.close()
                raise
            self._pending.pop(i, None)
            self._inners[i] = ar
        return ar

    @staticmethod
    def _candidate_options(c) -> dict:
        """The algorithm options candidate ``c`` is built with (beyond those of every
        allreducer): SparDL's d."""
        return {"teams": c.teams} if c.algorithm == "spardl" else {}

    def _dense_now(self) -> bool:
        return self.cands[self._choice].algorithm == "dense"

    def _use(self, i: int) -> None:
        """Make candidate i the current one (after an applied step, or at construction)."""
        old = self._choice
        ar = self._inner(i)
        self.device_resident = ar.device_resident
        if i == old:
            return
        self._switches += 1
        if self.cands[old].algorithm == "dense" and old in self._inners:
            self._inners[old]._pool.clear()  # its result buffers: memory, not state
        self._choice = i
        # The first dense step after a sparse one reduces X = g + E: the residual is flushed.
        self._flush = (
            self._dense_now() and self._residual is not None and self.residual_mode != "none"
        )

    # -- the step -------------------------------------------------------------------------------
    def __call__(self, grad):
        """As :meth:`Allreducer.__call__`, with the current candidate's step (module docstring);
        after an applied step, a trial switch or a decision may follow (collective)."""
        before = self.step
        flush = self._flush and self._dense_now()
        with self.comm.mpi_clock() as spent:  # the seconds inside MPI calls, as they end
            t0 = time.perf_counter()
            out = super().__call__(grad)
            wall = time.perf_counter() - t0
        inside = spent[0]
        if self.step != before:  # applied, on every rank alike
            i = self._choice
            if not self._dense_now():
                self._inner(i).step += 1  # Ok-Topk's periodic re-estimations count its steps
            # The step that flushes E is not dense's step on g: it is not timed as one, and in
            # the trials it is not one of dense's trial steps.
            if not flush:
                local = wall - self._communication(self.cands[i])
                self._times[i].append((local, wall, inside))
            if not (flush and self._trial is not None):
                self._after_step()
        return out

    def _check_counter_room(self) -> None:
        # The current candidate counts the step too (its own step, and dense's call count).
        # Its two integers only (_inner_state would build the candidate's whole extra state).
        super()._check_counter_room()
        i = self._choice
        ar = self._inners.get(i)
        st = (ar.step, ar._calls) if ar is not None else self._pending.get(i)
        if st is not None:
            name = self.cands[i].name
            check_counter_room(f"candidate {name}'s step", st[0])
            check_counter_room(f"candidate {name}'s calls", st[1])

    def _step(self, grad):
        if self._dense_now() and not self._flush:
            return self._dense_step(grad)
        if self._dense_now():
            return self._flush_step(grad)
        return super()._step(grad)

    def _flush_step(self, grad):
        """The first dense step after a sparse one: dense's own step on X = g + E (gradients
        of the work dtype, host and device alike, so both give the same bits, bytes and
        state; float16 ones take the generic step of :meth:`_flush_reduce`), after which E is
        zero. On the host its buffer of X becomes the zero residual."""
        g = self._accept(grad)
        device = A.is_device(g)
        self._residual_for(g, device)
        if g.dtype != self._residual.dtype:
            return self._step_accepted(g)
        x = self._accumulate(g, device)
        ar = self._inner(self._choice)
        ar._dtype = self._dtype
        out, applied = ar._step_accepted(x)
        if applied:
            old = self._residual
            if device:  # dense's result is a buffer of its own: X is free, but not zeroed here
                self._residual = A.zeros(self.n, x.dtype, True)
            else:
                self._residual = x
                x.fill(0)
                self._spares.keep(old)
            self._flush = False
            self.step += 1
        return out, applied

    def _dense_step(self, grad):
        """MPI's own Allreduce of the gradient (the residual is zero: flushed)."""
        ar = self._inner(self._choice)
        ar._dtype = self._dtype  # so that it refuses a gradient of another dtype, as we do
        self._calls += 1
        out, applied = ar._step(grad)
        if applied:
            if self._dtype is None:
                self._dtype = ar._dtype
                self._residual = A.zeros(self.n, work_dtype(ar._dtype), A.is_device(grad))
            self.step += 1
        return out, applied

    def _first_selection(self):
        if self._dense_now():
            return None
        return self._inner(self._choice)._first_selection()

    def _reduce(self, x) -> Reduced:
        if self._dense_now():
            self._flush = False
            return self._flush_reduce(x)
        ar = self._inner(self._choice)
        ar._pre, self._pre = self._pre, None
        try:
            return ar._reduce(x)
        finally:
            ar._pre = None

    def _flush_reduce(self, x) -> Reduced:
        """The flushing dense step: the sum of every rank's X = g + E; E becomes zero."""
        dev = A.is_device(x)
        with self.comm.phase("allreduce"):
            sums = self.comm.allreduce(x, "sum") if self.P > 1 else A.copy(x)
        return Reduced(A.arange(self.n, dev), sums, A.zeros(self.n, x.dtype, dev))

    def _density_changed(self) -> None:
        for ar in self._inners.values():
            ar._apply_density(self.density)

    # -- decisions ------------------------------------------------------------------------------
    def _after_step(self) -> None:
        if self._trial is None:
            self._since += 1
            if self._since % self.interval == 0:
                self._decide(incumbent=True)
            return
        self._trial[1] += 1
        if self._trial[1] < self.trials:
            return
        nxt = self._next_trial(self._trial[0] + 1)
        if nxt is None:
            self._trial = None
            self._since = 0
            self._decide()
        else:
            self._trial = [nxt, 0]
            self._use(nxt)
            self._report()

    def _next_trial(self, j: int):
        """The next candidate from index j on to try, or None: the trials are over. Candidates
        whose modelled communication exceeds ``prune`` times the fastest step measured so far
        (agreed: each rank's least wall time, the maximum over ranks) are skipped."""
        if j >= len(self.cands):
            return None
        if not self.prune:
            return j
        walls = [min(t[1] for t in w) for w in self._times if w]
        fastest = max(self.comm.allgather_object(min(walls), control=True))
        while j < len(self.cands):
            if self._communication(self.cands[j]) <= self.prune * fastest:
                return j
            self._skipped.append(j)
            j += 1
        return None

    def _word_bytes(self) -> tuple[float, float]:
        """Bytes per word with ``wire="coo"``: of the sparse candidates (an index and a value
        per pair) and of dense (a value), in the work dtype (float32 before the first step)."""
        work = work_dtype(np.dtype(np.float32) if self._dtype is None else self._dtype)
        sparse = (np.dtype(wire_index_dtype(self.n)).itemsize + work.itemsize) / 2
        return sparse, float(work.itemsize)

    def _communication(self, c: Candidate) -> float:
        """The model's seconds of communication of one step of candidate ``c`` now (this
        density, dtype and wire; α and β)."""
        sparse_wb, dense_wb = self._word_bytes()
        return cost_model.predict(
            c.algorithm,
            self.P,
            self.n,
            self.density,
            teams=c.teams,
            alpha=self.alpha,
            beta=self.beta,
            word_bytes=dense_wb if c.algorithm == "dense" else sparse_wb,
            wire=self.wire,
            value_bytes=dense_wb,  # a value of the work dtype: unrounded at density 1
        )["seconds"]

    def _estimates(self) -> list[list[float]]:
        """This rank's (local, wall, inside MPI) estimate per candidate: the least of each over
        its last steps; wall = −1 when it has not run."""
        return [[min(t[j] for t in w) if w else -1.0 for j in range(3)] for w in self._times]

    def predictions(self, estimates=None) -> dict:
        """Each candidate's predicted step now.

        Parameters
        ----------
        estimates : sequence of (local, wall, mpi), optional
            Seconds per candidate (wall < 0: not measured). Default: this rank's own
            (the decisions use the maximum over ranks of each instead).

        Returns
        -------
        dict
            {name: {"communication", "local", "predicted", "measured", "mpi"}}, in candidate
            order, in seconds: the model's communication at this allreducer's α and β now; the
            local work, what the candidate's steps took beyond the model's communication at the
            time (the least of its last steps; negative where the model overestimates the
            communication; None when not measured or ``trials=0``); the predicted step, their
            sum (at least 0); the measured step and the time inside MPI calls (None when not
            measured).
        """
        if estimates is None:
            estimates = self._estimates()
        out = {}
        for c, (loc, wall, mpi) in zip(self.cands, estimates, strict=True):
            comm = self._communication(c)
            seen = wall >= 0
            use = self.trials > 0 and seen
            out[c.name] = {
                "communication": comm,
                "local": float(loc) if use else None,
                "predicted": max(comm + (float(loc) if use else 0.0), 0.0),
                "measured": float(wall) if seen else None,
                "mpi": float(mpi) if seen else None,
            }
        return out

    def _decide(self, incumbent: bool = False) -> None:
        """Choose (collective): the local estimates agreed as their maximum over ranks, every
        candidate predicted, and rank 0's choice broadcast. With ``incumbent`` (a decision
        after the first) the current candidate keeps its place unless another one is predicted
        faster by the ``hysteresis`` margin."""
        # Rows: local, wall, MPI; the maximum over ranks, exact (one control message).
        every = self.comm.allgather_object(self._estimates(), control=True)
        agreed = np.max(np.array(every, dtype=np.float64), axis=0)
        pred = self.predictions(agreed.tolist())
        times = [p["predicted"] for p in pred.values()]
        best = min(range(len(times)), key=lambda j: (times[j], j))
        cur, choice = self._choice, best
        if incumbent and times[best] >= (1 - self.hysteresis) * times[cur]:
            choice = cur
        choice = int(self.comm.bcast_object(choice, root=0, control=True))
        self._predicted = pred
        self._decisions += 1
        self._decided_at = self.step
        self._use(choice)
        self._report()

    def _report(self) -> None:
        """``stats["auto"]``: the choice and the last decision's predictions."""
        self.comm.stats["auto"] = {
            "choice": self.cands[self._choice].name,
            "phase": "chosen" if self._trial is None else "trials",
            "decided_at_step": self._decided_at,
            "decisions": self._decisions,
            "switches": self._switches,
            "interval": self.interval,
            "trials": self.trials,
            "prune": self.prune,
            "not_tried": [self.cands[j].name for j in self._skipped],
            "hysteresis": self.hysteresis,
            "alpha": self.alpha,
            "beta": self.beta,
            "rates": self.rates,
            "conserves": self.conserves,
            "candidates": {k: dict(v) for k, v in self._predicted.items()}
            or {c.name: None for c in self.cands},
        }

    # -- state ----------------------------------------------------------------------------------
    def _inner_state(self, i: int):
        ar = self._inners.get(i)
        if ar is None:
            return self._pending.get(i)
        if self.cands[i].algorithm == "dense":
            return (ar.step, ar._calls, None if ar._dtype is None else str(ar._dtype), None)
        return (ar.step, ar._calls, None, ar._extra_state())

    @staticmethod
    def _set_inner_state(ar, st) -> None:
        step, calls, dtype, extra = st
        if extra is not None:
            ar._load_extra_state(extra)
        ar.step, ar._calls = int(step), int(calls)
        if isinstance(ar, Dense):
            ar._dtype = None if dtype is None else np.dtype(dtype)

    def _snapshot(self):
        # Also what a load may change beyond the current candidate: the states of candidates
        # not built yet, and those of built ones (a failed load restores them all).
        built = {i: self._inner_state(i) for i in self._inners}
        return (*super()._snapshot(), dict(self._pending), built)

    def _restore(self, saved) -> None:
        super()._restore(saved[:6])
        self._pending = dict(saved[6])
        for i, st in saved[7].items():
            if i in self._inners and i != self._choice and st is not None:
                self._set_inner_state(self._inners[i], st)

    def _state_signature(self) -> list[int]:
        # The trials' and decisions' collectives follow auto's counters, and the current
        # candidate's steps follow its own step, call count and the fields its class compares
        # (``_state_fields``; its state may be pending: not built yet). Those fields can take a
        # collective of the candidate's own (SparDL's h among a block's owners), so they are
        # computed only where every rank holds the same candidate, counters and whether it has
        # a state of its own; elsewhere the differing fields fail the comparison by themselves.
        trial = self._trial or [-1, -1]
        i = self._choice
        st = self._inner_state(i)
        extra = st[3] if st is not None and isinstance(st[3], dict) else {}
        own = [
            i,
            *trial,
            self._since,
            int(self._flush),
            name_hash(repr(self._skipped)),
            *((-1, -1) if st is None else (signature_field(st[0]), signature_field(st[1]))),
            int(bool(extra)),
        ]
        every = self.comm.allgather_object(own, control=True)
        if any(o != own for o in every):
            return own
        c = self.cands[i]
        cls = _CLASSES[c.algorithm]
        opts = {**cls.options, **self._candidate_options(c)}
        return own + cls._state_fields(self.comm, extra, opts)

    def _extra_state(self) -> dict:
        # The current candidate's state only: a step changes no other (O(P), as the base asks).
        i = self._choice
        return {
            "choice": self.cands[i].name,
            "flush": self._flush,
            "inner": self._inner_state(i),
            "trial": None if self._trial is None else list(self._trial),
            "since": self._since,
            "not_tried": list(self._skipped),
            "times": [[list(t) for t in w] for w in self._times],
        }

    def _restart_trials(self) -> None:
        """The trials afresh from the first candidate, nothing measured (after a load)."""
        self._trial = [0, 0] if self.trials else None
        self._since, self._skipped = 0, []
        for w in self._times:
            w.clear()
        self._choice = 0
        self._flush = (
            self._dense_now() and self._residual is not None and self.residual_mode != "none"
        )
        self.device_resident = _CLASSES[self.cands[0].algorithm].device_resident
        self._report()

    def _load_extra_state(self, state) -> None:
        if not state:  # a state without it (folded for another world size): trials afresh
            self._restart_trials()
            return
        names = [c.name for c in self.cands]
        if state["choice"] not in names:
            raise ValueError(f"state chose {state['choice']!r}, not among candidates {names}")
        if len(state["times"]) != len(names):
            raise ValueError(f"state holds the times of {len(state['times'])} candidates")
        i = names.index(state["choice"])
        inner = state["inner"]
        if inner is not None:
            inner = _checked_inner(inner)
            if i in self._inners:
                self._set_inner_state(self._inners[i], inner)
            else:
                self._pending[i] = inner
        self._choice, self._flush = i, bool(state["flush"])
        self.device_resident = _CLASSES[self.cands[i].algorithm].device_resident
        if "trial" in state:
            trial = state["trial"]
            self._trial = None if trial is None else [int(trial[0]), int(trial[1])]
            self._since = int(state["since"])
            self._skipped = [int(j) for j in state["not_tried"]]
        else:  # saved before `prune`, whose default order had dense first: see _legacy_times
            rel = self.step - int(state["trial_start"])
            T = self.trials * len(self.cands)
            if rel < T:  # inside the trials: they start again
                self._restart_trials()
                return
            self._trial, self._since, self._skipped = None, (rel - T) % self.interval, []
        times = state["times"] if "trial" in state else self._legacy_times(state["times"])
        for w, saved in zip(self._times, times, strict=True):
            w.clear()
            w.extend(tuple(float(v) for v in t) for t in saved)
        self._report()

    def load_state_dict(self, state: dict) -> None:
        """As :meth:`Allreducer.load_state_dict`; the current candidate's saved state is also
        applied now, the candidate built if it is not yet (collective), so that a state it
        refuses on some rank (e.g. SparDL's h outside its range on one block's owners) raises
        here on every rank, and every rank keeps its state as it was."""
        self._check_open()
        if self.broken is not None:  # refused on every rank, the half-restored state unread
            super().load_state_dict(state)
        saved = self._snapshot()
        super().load_state_dict(state)
        if self._choice in self._pending:  # on every rank alike: the load compared it
            try:
                self._inner(self._choice)
            except BaseException as e:
                undo_or_break(self, lambda: self._restore(saved), e)
                raise

    def _legacy_times(self, times):
        """The timing windows of a state saved before ``prune``, in this allreducer's order: with
        the default candidates those states listed them in the old default order (dense first)."""
        if self.opts["candidates"] is not None:
            return times
        old = ["dense", *[n for n in candidate_names(self.P) if n != "dense"]]
        by_name = dict(zip(old, times, strict=True))
        return [by_name[c.name] for c in self.cands]

    def __repr__(self) -> str:
        return (
            f"Auto(P={self.P}, n={getattr(self, 'n', '?')}, "
            f"density={getattr(self, 'density', '?')}, "
            f"choice={self.cands[self._choice].name if hasattr(self, '_choice') else '?'!r})"
        )


def _checked_inner(inner) -> tuple:
    """A saved candidate state as ``_set_inner_state`` takes it, checked on this rank:
    (step, call count, dtype name or None, the algorithm's own state dict or None).

    Raises
    ------
    ValueError
        Not a sequence of those four fields; a step or call count outside [0, 2**63).
    TypeError
        A field of another type (a bool is no count).
    """
    if not isinstance(inner, (tuple, list)) or len(inner) != 4:
        raise ValueError(
            "state's inner (the current candidate's state) must be (step, calls, dtype, extra)"
        )
    step, calls, dtype, extra = inner
    Allreducer._check_loaded_counters({"step": step, "calls": calls}, "state's inner")
    if dtype is not None and not isinstance(dtype, str):
        raise TypeError(f"state's inner dtype must be a dtype name or None, got {dtype!r}")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"state's inner extra must be a dict or None, got {type(extra).__name__}")
    return (int(step), int(calls), dtype, extra)


def _count(n: int, noun: str) -> str:
    """``1 decision``, ``2 decisions``, ``0 switches``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('ch') else 's'}"


def explain(report: dict) -> str:
    """``stats["auto"]`` as a table: one line per candidate (the model's communication, the
    local work, their sum, and the measured step and time inside MPI, in ms), the choice
    marked.

    Parameters
    ----------
    report : dict
        ``allreducer.stats["auto"]``.

    Returns
    -------
    str
        Lines without a trailing newline.

    Raises
    ------
    TypeError
        If ``report`` is not a dict.
    ValueError
        If ``report`` lacks a field ``stats["auto"]`` holds (it is not such a report).
    """
    if not isinstance(report, dict):
        raise TypeError(f"report must be a dict (stats['auto']), got {type(report).__name__}")
    need = "choice phase decisions switches interval trials alpha beta rates prune candidates"
    missing = [k for k in need.split() if k not in report]
    if missing:
        raise ValueError(
            f"report must be an auto allreducer's stats['auto'], which holds {', '.join(missing)}"
        )
    head = (
        f"auto: {report['choice']} ({report['phase']}; {_count(report['decisions'], 'decision')}"
        f", {_count(report['switches'], 'switch')} (trials included), every "
        f"{report['interval']} steps after "
        f"{report['trials']} trial steps each); alpha = {report['alpha'] * 1e6:.2f} us, "
        f"beta = {report['beta'] * 1e9:.4f} ns/B ({report['rates']})"
    )
    if report.get("not_tried"):
        why = ""
        if report["prune"]:
            why = f" (communication > {report['prune']:g} x the fastest step)"
        head += f"; not tried{why}: " + ", ".join(report["not_tried"])
    lines = [
        head,
        f"  {'candidate':<14} {'comm ms':>9} {'local ms':>9} {'predicted':>10} "
        f"{'measured':>9} {'in MPI':>9}",
    ]

    def ms(v):
        return "-" if v is None else f"{v * 1e3:.3f}"

    for name, p in report["candidates"].items():
        mark = "*" if name == report["choice"] else " "
        if p is None:
            lines.append(f"{mark} {name:<14} {'(not decided yet)':>40}")
            continue
        lines.append(
            f"{mark} {name:<14} {ms(p['communication']):>9} {ms(p['local']):>9} "
            f"{ms(p['predicted']):>10} {ms(p.get('measured')):>9} {ms(p.get('mpi')):>9}"
        )
    return "\n".join(lines)
