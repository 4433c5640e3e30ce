"""What every allreducer shares: argument checks on every rank, the cross-rank consistency check,
error feedback bookkeeping, the op (mean or sum), non-finite handling, statistics and checkpoints.

A subclass implements one method, :meth:`Allreducer._reduce`, which reads like its paper: it gets
this rank's accumulated gradient X = g + E_old and returns the summed sparse result and this rank's
new residual E_new.

GPU gradients (anything with ``__cuda_array_interface__``: torch CUDA tensors, CuPy, Numba device
arrays, the CUDA simulator's arrays) keep every per-step buffer on the device: X, the partial
sums, the residual and the selections are Numba device arrays, the kernels run as their CUDA
twins, the other array operations come from :mod:`spardl._arrays`, and only packed messages go
to MPI (:mod:`spardl.comm`). The result is bit-identical to the same call on host arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

import numpy as np

import spardl_kernels as K

from .. import _arrays as A
from .._checks import (
    OptionMismatch,
    add_note,
    check_bool,
    check_choice,
    check_counter,
    check_counter_room,
    check_density,
    check_int,
    load_error,
    malformed,
    raise_if,
    restored_error,
    undo_or_break,
)
from ..comm import WIRES, Comm, name_hash, signature_digest, signature_field
from ..cost_model import budget as cost_budget
from ..dtypes import VALUE_DTYPES
from ..dtypes import work_dtype as _work_dtype
from ..result import SparseResult

__all__ = ["Allreducer", "Reduced", "NonFiniteError", "Above", "budget"]

SIGNATURE_LEN = 7
OPS = ("mean", "sum")
RESIDUALS = ("global", "local", "none")
NONFINITE = ("raise", "skip", "propagate")


class NonFiniteError(ValueError):
    """A gradient held NaN or Inf; raised on every rank, and the step is not applied."""


def budget(density: float, n: int) -> int:
    """k = ⌊ρ·n⌋, at least 1 and at most n.

    Parameters
    ----------
    density : float
        ρ, in (0, 1].
    n : int
        Vector length, ≥ 1.

    Returns
    -------
    int
        The number of entries to select: ρ·n exactly, floored, with ρ read as the decimal it
        was written as (0.29·100 gives 29, never 28) or, for a ratio, as the ratio (2/3 of 3
        gives 2; :func:`spardl.cost_model.density_floor`, which says where a float cannot
        tell the two apart).

    Raises
    ------
    TypeError, ValueError
        If ``density`` is not a real number in (0, 1] (:func:`spardl.cost_model.budget`).
    """
    return cost_budget(density, n)


@dataclass
class Reduced:
    """What :meth:`Allreducer._reduce` returns.

    indices : int64 array, ascending, identical on every rank
    values : work-dtype array, the SUM over ranks at ``indices``, identical on every rank
    residual : work-dtype array of shape (n,), this rank's new residual E_new
    """

    indices: np.ndarray
    values: np.ndarray
    residual: np.ndarray


@dataclass(frozen=True)
class Above:
    """A first selection by threshold (:meth:`Allreducer._first_selection`): every entry of X
    with |x_i| >= ``threshold``, made in the X = g + E pass
    (:func:`spardl_kernels.accumulate_above`) and handed out by
    :meth:`Allreducer._preselected_above`."""

    threshold: float


#: How a failed check names :attr:`Allreducer.user`.
_USER = "allreducer (in the order built on its communicator)"

_DTYPE_CODES = {dt: code for code, dt in enumerate(VALUE_DTYPES, start=1)}


def _dtype_code(dtype) -> int:
    """1, 2, 3 for float16, float32, float64 (native byte order), 0 for anything else (None
    too): a dict lookup, where ``str(dtype)`` costs microseconds on every call."""
    return _DTYPE_CODES.get(dtype, 0)


def _float_bits(x) -> int:
    """A real number as a signature field: the bits of ``float(x)`` (Python and NumPy numbers
    alike, so that ranks that pass different NumPy floats disagree), or -1 for anything else
    (then the rank's own check has failed and says why)."""
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        return -1
    try:
        return int(np.array([float(x)], dtype=np.float64).view(np.int64)[0])
    except OverflowError:
        return -1


class Allreducer:
    """Base class of every sparse (and the dense) allreduce.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm or spardl.comm.Comm
        The communicator; P = its size. An mpi4py communicator is duplicated, so messages never
        mix with the caller's; a :class:`spardl.comm.Comm` is used as it is (shared, and not
        freed by :meth:`close`).
    n : int
        Gradient length, ≥ 1, the same on every rank.
    density : float, default 0.01
        ρ in (0, 1]; k = max(1, ⌊ρ·n⌋).
    op : {"mean", "sum"}, default "mean"
        The reduction.
    residual : {"global", "local", "none"}, default "global"
        Error feedback. "global": nothing is lost (the conservation invariant of docs/design.md §4);
        "local": a rank forgets what it sent even if it was dropped downstream (an ablation);
        "none": no error feedback at all.
    nonfinite : {"raise", "skip", "propagate"}, default "raise"
        What to do when the reduced gradient holds NaN or Inf: raise :class:`NonFiniteError` on
        every rank, or drop the step on every rank (an empty result, counted in
        ``stats["skipped_steps"]``), or return it as it is. A step that raises (this error, bad
        input, ranks that disagree) or is dropped is not applied: the whole state (residual,
        counters, the algorithm's thresholds, budgets and boundaries: everything
        :meth:`state_dict` holds) stays as it was, on every rank.
    check : bool, default True
        Run the cross-rank consistency check on every call (one small allreduce). Without it a
        call with mismatched arguments across ranks may hang.
    wire : {"coo", "compact"}, default "coo"
        How sparse messages are encoded (docs/design.md §2.1). "coo": counts, int32 (int64 past
        2^31) block-relative indices and work-dtype values, bit for bit: 8 bytes per float32
        pair. "compact": indices delta-coded per block (1, 2, 4 or 8-byte gaps with escapes, a
        bitmap or nothing, whichever is smallest) and values in 16 bits (float16 or bfloat16
        of v·2^s, chosen per block so that nothing overflows; non-finite blocks go raw); the
        rounding error of every value a rank sends stays in that rank's residual (quantisation
        under error feedback), so with ``residual="global"`` the conservation invariant still
        holds. About 3.2 bytes per pair at 1 % density. The dense allreducer accepts it and
        sends dense vectors either way.

    Raises
    ------
    ValueError, TypeError
        On every rank, if any rank's arguments are invalid or the ranks disagree.
    """

    name = "base"
    #: Whether the conservation invariant holds with residual="global".
    conserves = True
    #: Options a subclass accepts, with defaults.
    options: dict = {}
    #: Whether ``_reduce`` keeps GPU buffers on the device. A subclass that cannot sets False:
    #: then X is copied to the host once, reduced there, and the result and residual are copied
    #: back once (correct, but the step costs two O(n) transfers).
    device_resident = True
    #: Whether the rounding remainder of a float16 output goes into the residuals (see
    #: :meth:`_round_keeping_remainder`). An algorithm without error feedback (dense) sets False:
    #: its output is still clamped to float16's finite range, and the remainder is dropped.
    rounding_feedback = True

    def __init__(
        self,
        comm,
        n,
        *,
        density=0.01,
        op="mean",
        residual="global",
        nonfinite="raise",
        check=True,
        wire="coo",
        **options,
    ):
        #: The communicators this allreducer made and frees on :meth:`close`: its duplicate of
        #: ``comm`` (none when ``comm`` is a spardl Comm, which it shares) and any split off it.
        self._own_comms: list[Comm] = []
        self._closed = False
        #: The exception of an undo that raised (:func:`spardl._checks.undo_or_break`): the
        #: state is half restored, and every later call but :meth:`close` refuses. None while
        #: sound.
        self.broken = None
        if isinstance(comm, Comm):
            self.comm = comm
        else:
            self.comm = Comm(comm)
            self._own_comms.append(self.comm)
        self.P = self.comm.size
        self.rank = self.comm.rank
        #: Which allreducer of its communicator this is (:meth:`spardl.comm.Comm.new_user`),
        #: compared by every call's check.
        self.user = self.comm.new_user()
        err = None
        try:
            self._validate_common(n, density, op, residual, nonfinite, check)
            self.wire = _check_wire(wire)
            self.n = int(n)
            self.density = float(density)
            self.op = op
            self.residual_mode = residual
            self.nonfinite = nonfinite
            self.check = bool(check)
            self.k = budget(self.density, self.n)
            unknown = set(options) - set(self.options)
            if unknown:
                raise TypeError(
                    f"{self.name}: unknown option(s) {sorted(unknown)}; "
                    f"accepted: {sorted(self.options)}"
                )
            self.opts = {**self.options, **options}
            self.given_options = frozenset(options)  # what the caller named, for _setup's checks
            self._setup()
        except Exception as e:  # noqa: BLE001 - re-raised on this rank after the agreement
            err = e
        described = {
            "algorithm": self.name,
            "n": n,
            "density": density,
            "op": op,
            "residual": residual,
            "nonfinite": nonfinite,
            "check": check,
            "wire": wire if isinstance(wire, str) else repr(wire),
            # Compared as they take effect: teams=1 named on one rank and left at its default
            # of 1 on another build the same allreducer.
            "options": repr(
                sorted((k, _option_value(v)) for k, v in {**self.options, **options}.items())
            ),
        }
        sig = [
            name_hash(self.name),
            _safe_int(n),
            _float_bits(density),
            name_hash(f"{op}|{residual}|{nonfinite}|{check}|{wire!r}"),
            name_hash(described["options"]),
        ]
        try:
            self.collective_check(err, sig, described)
        except BaseException:
            self._free()  # every rank raises here together: nothing is left to leak
            raise
        self.step = 0
        self._calls = 0
        self._dtype = None
        self._residual = None
        # The buffer X = g + E is written into: an older residual's once nothing else holds it.
        self._spares = A.BufferPool(1)
        self._pre = None  # selections made while accumulating (_preselected)
        stats = self.comm.stats
        stats.setdefault("skipped_steps", 0)
        stats.setdefault("steps", 0)

    # -- hooks for subclasses ---------------------------------------------------------------
    def _setup(self) -> None:
        """Validate ``self.opts`` and precompute what does not depend on data."""

    def _reduce(self, x: np.ndarray) -> Reduced:  # pragma: no cover - abstract
        raise NotImplementedError

    def _density_changed(self) -> None:
        """Recompute what depends on the density after :meth:`set_density` changed it.

        ``self.density`` and ``self.k`` already hold the new values; the residual, counters and
        selector state are kept (a selector resets a key's threshold itself when k changes).
        """

    def _extra_state(self) -> dict:
        """The algorithm's own state (thresholds, budgets, region boundaries, selectors).

        Called before every step as well as by :meth:`state_dict`: a step that raises or is
        skipped is rolled back by :meth:`_load_extra_state` of this snapshot, so it must be a
        copy (no reference to anything a step mutates in place) and cheap (O(P), not O(n)).
        """
        return {}

    def _load_extra_state(self, state: dict) -> None:
        pass

    # -- lifetime ---------------------------------------------------------------------------
    def _split(self, color: int, key: int) -> Comm:
        """``self.comm.split(color, key)`` (collective), freed by :meth:`close`."""
        sub = self.comm.split(color, key)
        self._own_comms.append(sub)
        return sub

    def close(self) -> None:
        """Free the MPI communicators this allreducer created; it cannot be called after.

        Each allreducer duplicates its communicator (unless given a :class:`spardl.comm.Comm`,
        which it shares), and some split more (SparDL's teams, the candidates of ``auto``).
        MPI libraries allow a bounded number per process (MPICH: about 2,000), so a program
        that builds allreducers repeatedly closes them, or uses them as context managers
        (``with spardl.make(...) as ar:``). Collective: every rank closes its allreducer at
        the same point. Idempotent; the state (:meth:`state_dict`, :attr:`residual`,
        ``stats``) stays readable.

        Raises
        ------
        ValueError
            With ``check=True``, on every rank, if some rank calls the allreducer (or changes
            its density, or loads a state) where another closes it: the ranks are out of step,
            and a rank waiting in the call would otherwise wait forever. Nothing is freed then.
        """
        if getattr(self, "_closed", True):
            return
        if getattr(self, "check", False) and not self.comm.freed:  # a shared Comm freed first
            calls = self._calls
            self.collective_check(
                None,
                [name_hash(f"{self.name}|close"), calls],
                lambda: {"close": self.name, "call number": calls},
            )
        self._free()

    def _free(self) -> None:
        """:meth:`close` without the cross-rank check (every rank raises together, or leaves
        a ``with`` block on an exception, where a rank whose peers went on would wait)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for c in reversed(self._own_comms):
            c.free()
        self._own_comms.clear()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self.name}: the allreducer is closed")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self._free()

    # -- density changes --------------------------------------------------------------------
    def set_density(self, density) -> None:
        """Change ρ (and so k) from the next call on, without rebuilding the allreducer.

        Collective: every rank calls it with the same value between the same two calls (a
        density schedule, e.g. the exponential warm-up of arXiv 1712.01887 §3.3). The residual
        is kept, so the conservation invariant (docs/design.md §4) holds across the change:
        what was not sent before it is still in some rank's residual after it. What the
        algorithm derives from ρ (SparDL's block budgets k_b and h, Ok-Topk's reused global
        threshold, the selectors' thresholds) is recomputed by :meth:`_density_changed`.

        Parameters
        ----------
        density : float
            The new ρ, in (0, 1].

        Raises
        ------
        ValueError, TypeError
            On every rank, if any rank's ``density`` is invalid or the ranks disagree (value,
            or the number of calls made so far); the state is then unchanged. A rank that
            steps while another changes the density raises too (the step's own check meets
            this one), unless the allreducer was built with ``check=False``: then, as for any
            mismatched call, the job may hang.
        RuntimeError
            On a rank where an earlier call could not be undone (:attr:`broken`); the other
            ranks raise a ValueError naming it.
        """
        self._check_open()
        err = rho = None
        try:
            rho = check_density("density", density)
        except (TypeError, ValueError) as e:
            err = e
        ok_float = err is None
        err = restored_error([self]) or err  # agreed below: it may hold on this rank only
        self.collective_check(
            err,
            [
                name_hash(f"{self.name}|set_density"),
                _float_bits(density) if ok_float else -1,
                self._calls,
            ],
            {"set_density": repr(density), "call number": self._calls},
        )
        self._apply_density(rho)

    def _apply_density(self, density: float) -> None:
        """Set ρ and k and recompute the algorithm's derived values; local (no messages)."""
        self.density = density
        self.k = budget(density, self.n)
        self._density_changed()

    # -- validation -------------------------------------------------------------------------
    def _validate_common(self, n, density, op, residual, nonfinite, check):
        check_int("n", n)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        check_density("density", density)
        check_choice("op", op, OPS)
        check_choice("residual", residual, RESIDUALS)
        check_choice("nonfinite", nonfinite, NONFINITE)
        check_bool("check", check)

    def collective_check(self, err, signature, described) -> None:
        """Raise on every rank if any rank failed locally or the ranks disagree
        (:func:`collective_check` over this allreducer's communicator), on ``signature`` and
        on which allreducer of the communicator this is (:attr:`user`): ranks that call two
        allreducers sharing one :class:`spardl.comm.Comm` in a different order raise instead
        of exchanging each other's messages.

        Parameters
        ----------
        err : Exception or None
            This rank's local error, re-raised on this rank.
        signature : list of int
            The fields every rank must agree on (:func:`collective_check`).
        described : dict, or a callable without arguments that returns one
            The same fields in words.

        Raises
        ------
        ValueError, TypeError
            On every rank, as :func:`collective_check`.
        """
        collective_check(self.comm, err, [*signature, self.user], self._with_user(described))

    def _with_user(self, described):
        """``described`` (a dict or a callable returning one) with :attr:`user` in words."""
        if callable(described):
            return lambda: {**described(), _USER: self.user}
        return {**described, _USER: self.user}

    def _agree_on_load(self, err, identity, described) -> None:
        """:func:`agree_on_load` of this allreducer's just loaded state, naming it as
        :meth:`collective_check` does (its :attr:`user` joins ``identity``)."""
        agree_on_load(
            self.comm, err, [*identity, self.user], self._with_user(described), loaded=self
        )

    def _as_vector(self, grad) -> np.ndarray:
        if A.is_device(grad):
            try:
                g = A.view(grad)  # zero copy: a Numba device array on the same memory
            except Exception as e:  # noqa: BLE001 - raised on every rank as a type error
                raise TypeError(
                    f"grad is a GPU array that cannot be used here ({type(e).__name__}: {e})"
                ) from e
            self._check_vector(g.ndim, g.shape, np.dtype(g.dtype))
            return g
        if getattr(grad, "requires_grad", False):
            raise TypeError(
                "grad is a tensor that requires grad: pass grad.detach() (or the .grad of a "
                "parameter, which does not require grad)"
            )
        try:
            g = np.asarray(grad)
        except Exception as e:  # noqa: BLE001 - anything NumPy cannot view is a type error
            raise TypeError(f"grad must be a 1-D array, got {type(grad).__name__}") from e
        if g.dtype == object or (g.ndim == 0 and not isinstance(grad, np.ndarray)):
            what = type(grad).__name__
            if isinstance(grad, np.ndarray):
                what = f"{what} of dtype {g.dtype}"
            raise TypeError(f"grad must be a 1-D float array, got {what}")
        self._check_vector(g.ndim, g.shape, g.dtype, grad)
        return g

    def _check_vector(self, ndim, shape, dtype, grad=None) -> None:
        if ndim != 1:
            raise ValueError(f"grad must be 1-D, got shape {tuple(shape)}")
        if dtype not in VALUE_DTYPES:
            why = ""
            native = np.dtype(dtype).newbyteorder("=") if np.dtype(dtype).kind == "f" else None
            if native is not None and native in VALUE_DTYPES:
                why = f" ({native} in non-native byte order: pass grad.astype('{native}'))"
            raise TypeError(f"grad dtype must be float16, float32 or float64, got {dtype}{why}")
        if shape[0] != self.n:
            raise ValueError(f"grad has length {shape[0]}, expected n={self.n}")
        if self._dtype is not None and dtype != self._dtype:
            how = (
                ""
                if grad is None or hasattr(grad, "dtype")
                else f" (NumPy's dtype for a {type(grad).__name__}: pass an array of {self._dtype})"
            )
            raise TypeError(f"grad dtype changed from {self._dtype} to {dtype}{how}")

    # -- the call ---------------------------------------------------------------------------
    def __call__(self, grad) -> SparseResult:
        """Reduce this rank's gradient with every other rank's.

        Parameters
        ----------
        grad : array of shape (n,), float16, float32 or float64
            This rank's gradient: NumPy (or anything NumPy views without a copy; a sequence
            such as a list is converted, a copy), or a GPU array (``__cuda_array_interface__``:
            torch CUDA tensor, CuPy, Numba device array).
            A GPU gradient keeps the whole step on the device (module docstring).

        Returns
        -------
        SparseResult
            Identical on every rank: the mean (or sum) over ranks of what was selected. Its
            arrays are Numba device arrays for a GPU gradient, bit-identical to the host call.

        Raises
        ------
        ValueError, TypeError
            On every rank, if any rank's ``grad`` is invalid or the ranks' calls disagree.
            With ``check=False`` there is no agreement: only the ranks whose own ``grad`` is
            invalid raise, and the others' call may pair with a later one or hang, as with
            plain MPI.
        NonFiniteError
            With ``nonfinite="raise"``, on every rank when the reduced values are not finite.
        OverflowError
            Before anything changes, when ``step`` or the call count is 2**63 - 1 (a state
            saved after one more call would not load).
        RuntimeError
            If an earlier call could not be undone on this rank (:attr:`broken`); the other
            ranks raise a ValueError naming this one (with ``check=False``, only this rank
            raises).

        Notes
        -----
        A call that raises, or is dropped by ``nonfinite="skip"``, leaves the allreducer's
        state (everything :meth:`state_dict` holds) as it was, on every rank. If putting it
        back raises too, the call's own error is raised with that failure in a note (PEP 678)
        (a dropped call raises the failure itself), and the allreducer is half restored:
        every later call but :meth:`close` raises the RuntimeError above.

        float16 gradients are summed in float32 and the output rounded once to float16,
        clamped to ±65504 rather than inf; with a residual, each output value's rounding
        remainder goes into the residual of the rank owning that index's block
        (:meth:`_round_keeping_remainder`), so nothing is lost to float16's precision.
        """
        # A step is a transaction: one that raises (bad input, disagreement, NonFiniteError, a
        # fault) or is skipped leaves the whole state (what state_dict holds) as it was, on
        # every rank alike, since every rank raises or skips together. The residual is only
        # replaced on success, so the snapshot keeps a reference to it, not a copy.
        self._check_open()
        refused = restored_error([self])
        if refused is not None:
            # Half restored, maybe on this rank only: with check=True every call starts with an
            # agreement, which this one meets, so that every rank raises.
            if self.check:
                self.collective_check(refused, [name_hash(f"{self.name}|refused")], {})
            raise refused
        self._check_counter_room()
        saved = (self.step, self._calls, self._dtype, self._residual, self._extra_state())
        try:
            out, applied = self._step(grad)
        except BaseException as e:
            undo_or_break(self, lambda: self._rollback(saved), e)
            raise
        finally:
            self._pre = None
        if not applied:
            undo_or_break(self, lambda: self._rollback(saved))
        return out

    def _check_counter_room(self) -> None:
        """Refuse a call while ``step`` or ``calls`` is at 2**63 - 1 (OverflowError, before any
        message or change): what it saved would be a state no loader takes. Every rank holds
        the same counters (a load checks that they agree), so every rank refuses alike."""
        check_counter_room("step", self.step)
        check_counter_room("calls", self._calls)

    def _first_selection(self):
        """The selection a step makes first, from X as it is: (ks, bounds), the budget of each
        block [bounds[b], bounds[b+1]) (0: none), an :class:`Above` threshold, or None. The base
        computes it with X itself (:func:`spardl_kernels.accumulate_topk`,
        :func:`spardl_kernels.accumulate_above`) and :meth:`_preselected` /
        :meth:`_preselected_above` hand it to :meth:`_reduce`."""
        return None

    def _accumulate_selecting(self, g, spare, ks, bounds):
        """X = g + E with the blocks' top-k of :meth:`_first_selection` on the way."""
        x, idx, vals = K.accumulate_topk(g, self._residual, ks, bounds, out=spare)
        offsets = np.concatenate(([0], np.cumsum(ks)))
        self._pre = {
            b: (idx[offsets[b] : offsets[b + 1]], vals[offsets[b] : offsets[b + 1]])
            for b in range(len(ks))
            if ks[b] > 0
        }
        return x

    def _preselected_above(self, threshold):
        """The entries of X at or above ``threshold`` from the accumulating pass (an
        :class:`Above` first selection), or None when this step did not select them there (or
        with another threshold). Handed out once."""
        pre = self._pre.pop("above", None) if self._pre else None
        if pre is None or pre[0] != threshold:
            return None
        return pre[1], pre[2]

    def _preselected(self, b, k):
        """The top-k of block b of X from the accumulating pass, or None when this step did not
        select it there (or with another k). Each block is handed out once."""
        pre = self._pre.pop(b, None) if self._pre else None
        if pre is None or pre[0].shape[0] != k:
            return None
        return pre

    def _rollback(self, saved, density=None) -> None:
        """Put back the snapshot ``saved`` of a step (step, call count, dtype, residual, the
        algorithm's own state), the counters first: plain integers, so they are back even if
        what follows raises, and every rank's close() and next agreement compare them. With
        ``density`` (a load's snapshot, :meth:`_restore`), ρ and what derives from it go back
        before the algorithm's own state, whose saved thresholds are checked against (and keyed
        by) the budgets of their own density."""
        self.step, self._calls, self._dtype, self._residual, extra = saved
        if density is not None and density != self.density:
            self._apply_density(density)
        self._load_extra_state(extra)

    def _accept(self, grad):
        """The validated gradient (a NumPy or Numba device array) of this call, after the
        cross-rank check (with ``check=True``); raises on every rank as :meth:`__call__` says.
        Counts the call. The start of every step: a subclass that overrides :meth:`_step`
        (dense, which has no residual and no selection) calls it first."""
        err = None
        g = None
        try:
            g = self._as_vector(grad)
        except (TypeError, ValueError) as e:
            err = e
        self._calls += 1
        dtype = None if g is None else g.dtype
        on_gpu = g is not None and A.is_device(g)
        if self.check:
            calls = self._calls
            self.collective_check(
                err,
                [name_hash(self.name), self.n, _dtype_code(dtype), calls, int(on_gpu)],
                lambda: {  # words only for a failed check
                    "grad dtype": str(dtype),
                    "grad device": "gpu" if on_gpu else "cpu",
                    "n": self.n,
                    "algorithm": self.name,
                    "call number": calls,
                },
            )
        elif err is not None:
            raise err
        return g

    def _step(self, grad) -> tuple[SparseResult, bool]:
        """One step of :meth:`__call__`; returns the result and whether the step was applied
        (False: dropped by ``nonfinite="skip"``)."""
        return self._step_accepted(self._accept(grad))

    def _step_accepted(self, g) -> tuple[SparseResult, bool]:
        """:meth:`_step` after the checks, for the accepted gradient ``g``."""
        device = A.is_device(g)
        self._residual_for(g, device)
        x = self._accumulate(g, device)
        old_residual = self._residual
        # At density 1 nothing is dropped and the output is the exact mean: compact messages
        # then carry their values unrounded.
        self.comm.quantise = self.density < 1.0
        red = self._reduce_staged(x, device)
        self.comm.next_step()
        if self.nonfinite != "propagate" and not A.all_finite(red.values):
            return self._not_applied(device), False
        if self.residual_mode != "none":
            self._residual = red.residual
        # The buffer no longer in use, for the next step's X (taken only if nothing refers to it
        # by then: a caller that kept ``residual`` or a view of it keeps it intact).
        self._spares.keep(old_residual if red.residual is x else x)
        self.step += 1
        self.comm.stats["steps"] += 1
        return self._output(red.indices, red.values), True

    def _residual_for(self, g, device) -> None:
        """E_old where g lives: zeros on the first call (fixing the dtype), else moved once if
        the gradient changed sides (or a host checkpoint was loaded)."""
        if self._dtype is None:
            self._dtype = np.dtype(g.dtype)
            self._residual = A.zeros(self.n, _work_dtype(self._dtype), device)
        elif A.is_device(self._residual) != device:
            self._residual = A.like(self._residual, device)

    def _accumulate(self, g, device):
        """X = g + E_old (g alone, in the work dtype, without error feedback), in one pass."""
        if self.residual_mode == "none":
            return A.cast(g, self._residual.dtype, copy=True)
        # Into the buffer of an older residual when nothing else holds it: a fresh n-length
        # buffer costs its page faults on every step (about half of SparDL's local work at
        # n = 25 M, measured). Host buffers only: a device step allocates on the device.
        spare = None if device else self._spares.take(self.n, self._residual.dtype)
        plan = self._first_selection() if self.device_resident or not device else None
        if plan is None:
            return A.accumulate(g, self._residual, out=spare)
        if isinstance(plan, Above):
            x, idx, vals = K.accumulate_above(
                g, self._residual, plan.threshold, out=None if device else spare
            )
            self._pre = {"above": (plan.threshold, idx, vals)}
            return x
        # The step's first selection rides on the same pass (K.accumulate_topk).
        return self._accumulate_selecting(g, spare, *plan)

    def _reduce_staged(self, x, device) -> Reduced:
        """:meth:`_reduce` of X, staged through the host (one copy each way) for a device X
        when the algorithm is not :attr:`device_resident`."""
        if device and not self.device_resident:
            red = self._reduce(A.to_host(x))
            return Reduced(*(A.to_device(a) for a in (red.indices, red.values, red.residual)))
        return self._reduce(x)

    def _output(self, indices, sums) -> SparseResult:
        """The result from the reduced sums: divided by P for the mean and cast to the
        gradient's dtype (float16: rounded keeping the remainder), explicit zeros dropped."""
        if self._dtype != sums.dtype:  # float16 from float32 sums
            values = self._round_keeping_remainder(indices, sums)
        else:
            values = A.divide(sums, self.P) if self.op == "mean" and self.P > 1 else sums
            values = A.cast(values, self._dtype, copy=False)
        indices, values = _without_zeros(indices, values)
        return SparseResult._of(indices, values, self.n)

    def _not_applied(self, device) -> SparseResult:
        """A reduced gradient with NaN or Inf: raise :class:`NonFiniteError` (``"raise"``) or
        count the skipped step and return the empty result (``"skip"``). Every rank sees the same
        sums, so every rank takes the same branch."""
        if self.nonfinite == "raise":
            raise NonFiniteError(
                f"{self.name}: the reduced gradient holds NaN or Inf at step {self.step}; "
                "the step was not applied (the allreducer's state is unchanged)"
            )
        self.comm.stats["skipped_steps"] += 1
        return SparseResult._of(
            A.empty(0, np.int64, device), A.empty(0, self._dtype, device), self.n
        )

    def _round_keeping_remainder(self, indices, sums):
        """The output in the gradient's dtype (float16) from the work-dtype (float32) sums; the
        rounding remainder of every output value goes into one rank's residual.

        out_i = fp16(clip(S_i / P, ±65504)) for op="mean" (S_i for "sum"): rounded to nearest,
        and an output past float16's range is clamped to the largest finite float16 instead of
        becoming inf (a sum that is NaN or Inf, under ``nonfinite="propagate"``, is kept as it is,
        with no remainder). The remainder r_i = S_i − P·out_i ("sum": S_i − out_i), in sum units,
        computed in float64 and rounded once to float32, is added to the residual of the rank
        that owns i's block of ``uniform_bounds(n, P)`` (rank q owns [b_q, b_q+1)): the same
        rank on every rank's view, each rank touching only its own ~nnz/P entries. So
        Σ_r X_r = P·out + Σ_r E_r holds to float32 rounding even when the mean underflows to 0
        or overflows float16: nothing is lost to the output's precision. With
        ``residual="none"`` there is no residual and the remainder is dropped.

        O(nnz) host work; for GPU gradients the sums are copied to the host and the output
        (and this rank's remainders) back, O(nnz) each way (float16 steps only).
        """
        dev = A.is_device(sums)
        w = A.to_host(sums)
        scale = self.P if self.op == "mean" else 1
        mean = A.divide(w, self.P) if scale > 1 else w  # the same float32 mean as before
        top = float(np.finfo(self._dtype).max)
        # A NaN or Inf sum (nonfinite="propagate") stays what it is, and only there: the finite
        # sums beside it are clamped and keep their remainders as in any other step.
        finite = np.isfinite(mean)
        clamped = np.clip(mean, -top, top)
        out = (clamped if finite.all() else np.where(finite, clamped, mean)).astype(self._dtype)
        if self.rounding_feedback and self.residual_mode != "none":
            bounds = K.uniform_bounds(self.n, self.P)
            idx = A.to_host(indices)
            lo, hi = K.block_offsets(idx, bounds)[self.rank : self.rank + 2]
            with np.errstate(invalid="ignore"):  # inf - inf where a sum is not finite
                rem = w[lo:hi].astype(np.float64) - scale * out[lo:hi].astype(np.float64)
            rem = rem.astype(w.dtype)
            nz = (rem != 0) & finite[lo:hi]
            if np.any(nz):
                own_i, own_r = idx[lo:hi][nz], rem[nz]
                if A.is_device(self._residual):
                    own_i, own_r = A.to_device(own_i), A.to_device(own_r)
                K.scatter_add(self._residual, own_i, own_r)
        return A.to_device(out) if dev else out

    # -- state ------------------------------------------------------------------------------
    @property
    def residual(self) -> np.ndarray:
        """This rank's residual E after the last call: shape (n,), the gradients' work dtype
        (float32 for float16 gradients); a device array after calls with GPU gradients. Before
        the first call (and after loading a state saved before one) the gradients' dtype is
        not known yet: float32 zeros; the first gradient fixes the dtype."""
        if self._residual is None:
            return np.zeros(self.n, dtype=np.float32)
        return self._residual

    @property
    def stats(self) -> dict:
        """Cumulative counters: messages, bytes_sent, bytes_received, control_messages, phases."""
        return self.comm.stats

    def state_dict(self) -> dict:
        """Everything needed to resume: residual, counters and the algorithm's own state.

        The residual is always a host NumPy copy (portable, picklable); after loading, the first
        call moves it to the device if the gradients live there.

        Returns
        -------
        dict
            ``algorithm`` (str), ``n``, ``world_size`` (P), ``rank``, ``step`` and ``calls``
            (int), ``density`` (ρ, float), ``dtype`` (str, or None before the first call),
            ``residual`` (ndarray of shape (n,) in the work dtype, zeros with
            ``residual="none"``; None before the first call, and always for ``"dense"``,
            which drops nothing and keeps no residual) and ``extra`` (dict: the
            algorithm's own state,
            e.g. thresholds, budgets, region boundaries). Not a view: later calls leave it
            unchanged. :meth:`load_state_dict` takes it back, at this world size;
            :mod:`spardl.elastic` folds a set of them into another.

        Raises
        ------
        RuntimeError
            If a failed call could not be undone (:attr:`broken`): a half-restored state is
            not saved as if it were sound.
        """
        raise_if(restored_error([self]))
        return {
            "algorithm": self.name,
            "n": self.n,
            "world_size": self.P,
            "rank": self.rank,
            "density": self.density,
            "step": self.step,
            "calls": self._calls,
            "dtype": None if self._dtype is None else str(self._dtype),
            "residual": None if self._residual is None else np.array(A.to_host(self._residual)),
            "extra": self._extra_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output; the next call continues bit for bit.

        The density is part of the state: the saved ρ replaces the one this allreducer was
        built with (as :meth:`set_density` would), so that a density schedule such as the
        warm-up continues where it was saved. Another algorithm, n, world size or rank is
        refused instead, since no call could continue from it.

        Collective: every rank calls it (each with its own rank's state) between the same two
        calls. All or nothing, on every rank: if the state is invalid on any rank, every rank
        raises and every rank's state stays as it was.

        Parameters
        ----------
        state : dict
            What :meth:`state_dict` returned (on this rank).

        Raises
        ------
        TypeError
            On every rank, if some rank's ``state`` is not a dict, its ``step`` or ``calls`` is
            not an integer (a bool included), its ``density`` not a real number, its ``extra``
            not a dict, its ``dtype`` is not float16/32/64, or its residual is not of that
            dtype's work dtype.
        ValueError
            On every rank, if some rank's state misses a key, comes from another algorithm, n,
            world size or rank, has a negative ``step`` or ``calls`` or a ``density`` outside
            (0, 1], holds a NaN or Inf in its residual (unless ``nonfinite="propagate"``) or a
            non-zero residual where this allreducer has ``residual="none"`` (it would drop
            those entries), or the ranks' states disagree on the
            step, the call count, the density or what the algorithm's messages depend on
            (:meth:`_state_signature`: Ok-Topk's regions and global threshold, SparDL's h),
            or some rank is not in this load (stepping, say), or the allreducer is closed.
            A fault while loading (another exception) is a malformed state: a ValueError,
            the fault as its cause.
        RuntimeError
            On a rank where an earlier call could not be undone (:attr:`broken`); the other
            ranks raise a ValueError naming it. A load whose own undo raises is half restored
            too (its error carries that failure in a note).
        """
        self._check_open()
        calls = self._calls
        err = restored_error([self])  # agreed below: it may hold on this rank only
        if err is None:  # a half-restored state is neither read nor loaded into
            saved = self._snapshot()
            try:
                self._load_local(state)
            except Exception as e:  # noqa: BLE001 - every rank must hear of any failure
                err = load_error(e)
                undo_or_break(self, lambda: self._restore(saved), err)
        try:
            self._agree_on_load(
                err,
                [name_hash(f"{self.name}|load_state_dict"), calls],
                {"load_state_dict": self.name, "call number before": calls},
            )
        except BaseException as e:
            if err is None:  # loaded here: put back (a failed load was put back above)
                undo_or_break(self, lambda: self._restore(saved), e)
            raise

    def _loaded_signature(self) -> tuple[list, dict]:
        """What every rank's just loaded state must agree on, as signature fields and in words
        (:func:`collective_check`): the call count, the step, ρ (k and every message size
        follow from it) and :meth:`_state_signature`. Collective, and only once every rank is
        known to be in the same load (:func:`agree_on_load`): :meth:`_state_signature` may
        exchange messages of its own."""
        more = self._state_signature()
        return [self._calls, self.step, _float_bits(self.density), *more], {
            "state's call number": self._calls,
            "state's step": self.step,
            "state's density": self.density,
            **self._state_words(),
            "state's other counters": more,
        }

    def _state_words(self) -> dict:
        """The values behind :meth:`_state_signature`'s fields, named, for the message of a
        failed comparison (its fields are digests and differences): none here; Ok-Topk names
        its regions and reused threshold, SparDL with d > 1 its h. Local, and only called on
        a loaded (so validated) state."""
        return {}

    def _state_signature(self) -> list[int]:
        """Integers every rank's loaded state must agree on besides the step, call count and
        density (:meth:`load_state_dict`): :meth:`_state_fields` of this allreducer's own
        state. Called on every rank (it may exchange messages)."""
        return type(self)._state_fields(self.comm, self._extra_state(), self.opts)

    @classmethod
    def _state_fields(cls, comm: Comm, extra: dict, opts: dict) -> list[int]:
        """The signature fields of an algorithm's own state (``extra``, as :meth:`_extra_state`
        returns it) that every rank must agree on because its collective schedule follows
        them: none here; Ok-Topk (regions, reused threshold) and SparDL with d > 1 (h among a
        block's owners) override it. A classmethod so that ``auto`` can compare the state of
        a candidate it has not built yet. Called on every rank with the same ``opts`` and a
        non-empty ``extra`` on all or none; it may exchange messages over ``comm`` (a value
        only some ranks must share is compared that way), and it must take any loaded value
        without raising (the comparison, not this function, reports a bad one)."""
        return []

    def _snapshot(self):
        """Everything :meth:`_load_local` changes (the residual by reference: it is replaced,
        never written in place, by a load)."""
        return (
            self.step,
            self._calls,
            self._dtype,
            self._residual,
            self._extra_state(),
            self.density,
        )

    def _restore(self, saved) -> None:
        """Put back a :meth:`_snapshot` (:meth:`_rollback` with its density): the step and call
        count first (plain integers, that close() and every agreement compare), then the
        density, then the algorithm's own state. What derives from ρ (block budgets, h, a
        selector's k) must be the snapshot's before the saved thresholds are loaded, which are
        checked against (and keyed by) those budgets."""
        self._rollback(saved[:5], density=saved[5])

    def _load_local(self, state) -> None:
        """:meth:`load_state_dict` on this rank alone (no messages); all or nothing here, but
        for a restore that raises after a failed load (noted on the load's error; every caller
        then restores from its own snapshot)."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict (from state_dict()), got {type(state).__name__}")
        missing = [
            k
            for k in ("algorithm", "n", "world_size", "rank", "step", "calls", "dtype", "residual")
            if k not in state
        ]
        if missing:
            raise ValueError(f"state is missing key(s) {missing} (not a state_dict() output?)")
        for key, mine in (
            ("algorithm", self.name),
            ("n", self.n),
            ("world_size", self.P),
            ("rank", self.rank),
        ):
            if state[key] != mine:
                raise ValueError(
                    f"state was saved with {key}={state[key]!r}, this allreducer has {mine!r}"
                )
        res = state["residual"]
        if res is not None and getattr(res, "shape", None) != (self.n,):
            raise ValueError(
                f"state residual has shape {getattr(res, 'shape', None)}, expected ({self.n},)"
            )
        self._check_loaded_counters(state)
        self._check_loaded_residual(state["dtype"], res)
        density = check_density("state density", state.get("density", self.density))
        extra = state.get("extra", {})
        if not isinstance(extra, dict):
            raise TypeError(f"state extra must be a dict, got {type(extra).__name__}")
        saved = self._snapshot()
        try:
            self.step = int(state["step"])
            self._calls = int(state["calls"])
            self._dtype = None if state["dtype"] is None else np.dtype(state["dtype"])
            self._residual = None if res is None else np.array(A.to_host(res), copy=True)
            if density != self.density:  # saved after set_density: ρ, k and what derives
                self._apply_density(density)
            self._load_extra_state(extra)
        except OptionMismatch as e:  # saved under another option: said as it is
            self._restore_after_load(saved, e)
            raise
        except Exception as e:  # noqa: BLE001 - a malformed state: restored, then a ValueError
            err = malformed(e)
            self._restore_after_load(saved, err)
            raise err from e

    def _restore_after_load(self, saved, err) -> None:
        """Put back the :meth:`_snapshot` ``saved`` after :meth:`_load_local` failed with
        ``err``. A restore that raises is noted on ``err``, which stays the error to raise (its
        cause the load's own fault): every caller of :meth:`_load_local` restores its own
        snapshot after a failure, and marks the state half restored if that raises too."""
        try:
            self._restore(saved)
        except Exception as undo:  # noqa: BLE001 - noted: the load's error is the one to see
            add_note(
                err,
                f"putting the state back failed here ({type(undo).__name__}: {undo}); the "
                "caller's undo tries again",
            )

    @staticmethod
    def _check_loaded_counters(state, what: str = "state") -> None:
        """A state's step and call count: integers (not bools) in [0, 2**63); errors name them
        as ``what`` says (e.g. "state's inner" for a candidate's state inside ``auto``'s)."""
        for key in ("step", "calls"):
            check_counter(f"{what} {key}", state[key])

    def _check_loaded_residual(self, dtype, res) -> None:
        """A state's gradient dtype and residual: a float dtype, and a residual of its work dtype
        (none before the first call), finite unless ``nonfinite="propagate"`` (the only mode in
        which a NaN or Inf reaches a residual)."""
        if dtype is None:
            if res is not None:
                raise ValueError("state residual given without a gradient dtype")
            return
        try:
            dtype = np.dtype(dtype)
        except TypeError as e:
            raise TypeError(f"state dtype {dtype!r} is not a dtype") from e
        if dtype.name not in ("float16", "float32", "float64"):
            raise TypeError(f"state dtype must be float16, float32 or float64, got {dtype}")
        if res is None:
            return
        host = A.to_host(res)
        want = _work_dtype(dtype)
        if np.dtype(host.dtype) != want:
            raise TypeError(
                f"state residual has dtype {host.dtype}; a {dtype} gradient's residual is {want}"
            )
        if self.nonfinite != "propagate" and not np.all(np.isfinite(host)):
            raise ValueError(
                "state residual holds NaN or Inf, which only nonfinite='propagate' can produce"
            )
        if self.residual_mode == "none" and np.any(host != 0):
            raise ValueError(
                "state residual holds the entries a run with error feedback has not applied "
                "yet, and this allreducer has residual='none', which would drop them: load it "
                "with residual='global' or 'local', or zero state['residual'] to drop them"
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(P={self.P}, n={getattr(self, 'n', '?')}, "
            f"density={getattr(self, 'density', '?')}, op={getattr(self, 'op', '?')!r})"
        )


def collective_check(comm: Comm, err, signature, described) -> None:
    """Raise on every rank if any rank failed locally or the ranks disagree.

    One small allreduce when everything is fine; on failure, one more (an all-gather of the
    error reports) so that every rank can name the argument and the ranks involved.

    Parameters
    ----------
    comm : Comm
        The communicator every rank calls this on.
    err : Exception or None
        This rank's local validation error, re-raised on this rank.
    signature : sequence of int
        Integers that must be equal on every rank, any number of them (past ``SIGNATURE_LEN``
        the rest are compared by one digest), any size (:func:`spardl.comm.signature_field`).
    described : dict, or a callable without arguments that returns one
        The same fields in words, to name what differs (compared by ``repr``: ``0.1`` and
        ``np.float32(0.1)`` differ). A callable is called only when the check fails, so that
        a call made every step does not build its words every step.

    Raises
    ------
    ValueError, TypeError
        On every rank, unless every rank passed and all signatures match.
    """
    ok, same = comm.agree_fields(err is None, _fixed_signature(signature))
    if ok and same:
        return
    if callable(described):
        described = described()
    reports = comm.allgather_object((error_report(err), described))
    if err is not None or not ok:
        raise_rejected(err, [rep[0] for rep in reports])
    descs = [rep[1] for rep in reports]
    keys = dict.fromkeys(key for d in descs for key in d)  # every rank's, so each call is named
    diffs = [
        f"{key}: " + ", ".join(f"rank {r}={d.get(key)!r}" for r, d in enumerate(descs))
        for key in keys
        if any(repr(d.get(key)) != repr(descs[0].get(key)) for d in descs)
    ]
    raise ValueError("ranks disagree on " + "; ".join(diffs or ["the call sequence"]))


def error_report(err) -> tuple[str, str, bool] | None:
    """What a rank tells the others of its local error ``err``: (type name, message, whether
    it is an argument error: a TypeError or ValueError, subclasses included), or None."""
    if err is None:
        return None
    return (type(err).__name__, str(err), isinstance(err, (TypeError, ValueError)))


def raise_rejected(err, reports) -> NoReturn:
    """Raise after a failed agreement: ``err`` on its own rank, else the first failing rank's
    error type, naming that rank and its message.

    Parameters
    ----------
    err : Exception or None
        This rank's local error.
    reports : list
        Every rank's :func:`error_report`, in rank order; at least one is not None.

    Raises
    ------
    TypeError, ValueError
        TypeError if the first failing rank's error is one, else ValueError, on every rank,
        so that every rank can catch it alike: ``err`` itself where it is of that type, else
        one naming the first failing rank (and ``err``, from which it is raised). An ``err``
        that is neither (a fault, not an argument error) is raised as it is.
    """
    r, (kind, msg, argument) = next((r, rep) for r, rep in enumerate(reports) if rep is not None)
    exc = TypeError if kind == "TypeError" else ValueError
    if err is not None and (isinstance(err, exc) or not isinstance(err, (TypeError, ValueError))):
        raise err  # of the agreed type, or no argument error at all (a fault keeps its type)
    own = "" if err is None else f"; this rank's own: {type(err).__name__}: {err}"
    # An argument error is a rejection; anything else (a state that could not be restored, a
    # fault) is that rank's failure, and said so.
    did = "rejected its arguments" if argument else "failed"
    raise exc(f"rank {r} {did} ({kind}: {msg}){own}") from err


def agree_on_load(comm: Comm, err, identity, described, loaded=None, prefix: str = "") -> None:
    """Raise on every rank unless every rank loaded its state and the loaded states agree.

    Two agreements (:func:`collective_check`): first that every rank is in the same load
    (``identity``) and loaded its own state (``err`` is None everywhere); then, for an allreducer
    just loaded, that the ranks' loaded states agree (:meth:`Allreducer._loaded_signature`).
    The second may exchange messages of its own (SparDL's h among a block's owners, ``auto``'s
    current candidate), which a rank busy elsewhere (stepping, or loading something else)
    would never answer: the first agreement is what turns that mismatch into an error on every
    rank instead of a hang.

    Parameters
    ----------
    comm : Comm
        The communicator every rank agrees on.
    err : Exception or None
        This rank's error from loading its own state, re-raised on this rank.
    identity : sequence of int
        What names this load on every rank (a hashed name, the call or step number).
    described : dict
        ``identity`` in words, for the message.
    loaded : Allreducer, optional
        The allreducer whose just loaded state must agree across ranks.
    prefix : str, default ""
        Put before the names of the loaded state's fields in the message.

    Raises
    ------
    ValueError, TypeError
        On every rank, if some rank's load failed, the ranks are not all in this load, or the
        loaded states disagree.
    """
    collective_check(comm, err, identity, described)
    if loaded is None:
        return
    fields, more = loaded._loaded_signature()
    collective_check(
        comm,
        None,
        [*identity, *fields],
        {**described, **{f"{prefix}{k}": v for k, v in more.items()}},
    )


def _fixed_signature(signature) -> list[int]:
    """``signature`` as exactly ``SIGNATURE_LEN`` int64 fields, the same length on every rank
    (the agreement is one fixed-size allreduce): padded with zeros, or its fields from the last
    slot on replaced by one digest of them."""
    sig = [signature_field(v) for v in signature]
    if len(sig) > SIGNATURE_LEN:
        rest = np.array(sig[SIGNATURE_LEN - 1 :], dtype=np.int64)
        sig = [*sig[: SIGNATURE_LEN - 1], signature_digest(rest.tobytes())]
    return sig + [0] * (SIGNATURE_LEN - len(sig))


def _without_zeros(indices, values):
    """Drop the entries that are exactly ±0 (NaN is kept): the same vector, no explicit zeros.

    A top-k of a block with fewer than k non-zeros selects zeros too (ties go to the lower index),
    and a mean can round to 0 in the gradient's dtype; the result should not list them. One pass
    over the nnz output values; the dense vector (``to_dense()``) is unchanged, and so are the
    residuals (computed before).
    """
    tiny = float(np.nextafter(values.dtype.type(0), values.dtype.type(1)))
    # |v| >= smallest subnormal  <=>  v != 0 or NaN. Counted first: usually nothing is dropped,
    # and a selection of (nearly) every entry overflows select_above's first buffer and is done
    # twice (3.6 ms of a 52 ms SparDL step at n = 25 M, P = 1, against 0.1 ms for the count).
    if K.count_above(values, tiny) == len(values):
        return indices, values
    keep, kept = K.select_above(values, tiny)
    return A.take(indices, keep), kept


def _check_wire(wire) -> str:
    """``wire`` if it names a wire format, else the error naming it."""
    if not isinstance(wire, str):
        raise TypeError(f"wire must be a str, one of {WIRES}, got {type(wire).__name__}")
    if wire not in WIRES:
        hint = ""
        if wire.lower() in ("fp16", "float16", "half", "bf16", "bfloat16"):
            hint = (
                " (wire is the sparse message format; the 16-bit dense allreduce is "
                "make('dense', comm, n, wire_dtype='float16'), `spardl train --wire fp16`)"
            )
        raise ValueError(f"wire must be one of {WIRES}, got {wire!r}{hint}")
    return wire


def _option_value(v):
    """An option's value as the ranks compare it: NumPy scalars as the Python number or bool of
    the same value (``teams=np.int64(2)`` on one rank and ``teams=2`` on another agree), tuples
    as lists, containers element by element; anything else as it is (compared by ``repr``)."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    if isinstance(v, (list, tuple)):
        return [_option_value(x) for x in v]
    if isinstance(v, dict):
        return {k: _option_value(x) for k, x in sorted(v.items(), key=lambda kv: repr(kv[0]))}
    return v


def _safe_int(v) -> int:
    try:
        return int(v)
    except (TypeError, ValueError, OverflowError):
        return -1
