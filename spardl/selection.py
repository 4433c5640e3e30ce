"""Stateful top-k selectors: which entries of a block (or a whole vector) a rank sends.

A selector is called once per *key* per step (a key names a stream, e.g. a block id whose
statistics change slowly between steps) and returns the positions of the entries of largest
magnitude. :class:`ExactSelector` computes the exact top-k every time. :class:`ThresholdSelector`
reuses a magnitude threshold between exact recomputations, as Ok-Topk does (Li & Hoefler,
PPoPP 2022, arXiv 2201.07598, Sec. 3.1.1), so most steps cost one streaming pass
(``select_above``) instead of a selection.

Both are deterministic functions of their inputs and their state: ranks that hold the same data
and the same state make the same choice, bit for bit.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

import spardl_kernels as K
from spardl_kernels.devices import is_device_array

from . import _arrays as A
from ._checks import (
    OptionMismatch,
    check_counter,
    check_float,
    check_int,
    check_int_at_least,
    malformed,
    type_name,
)

__all__ = ["Selector", "ExactSelector", "ThresholdSelector", "make_selector", "SELECTORS"]


def _check_x_k(x, k):
    if not is_device_array(x):  # device arrays stay on the device (the kernels' CUDA twins)
        x = np.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"x must be 1-D, got shape {x.shape}")
    check_int("k", k)
    if not 0 <= k <= x.shape[0]:
        raise ValueError(f"k must be in [0, len(x)={x.shape[0]}], got {k}")
    return x, int(k)


def _check_k(k) -> int:
    """A budget: an integer (not a bool) ≥ 0, as a Python int."""
    return check_int_at_least("k", k, 0)


def _check_n_k(n, k) -> tuple[int, int]:
    """A length n ≥ 0 and a budget k in [0, n], integers (not bools), as Python ints."""
    n = check_int_at_least("n", n, 0)
    check_int("k", k)
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, n={n}], got {k}")
    return n, int(k)


def _empty(x):
    if is_device_array(x):
        from numba import cuda

        return cuda.device_array(0, np.int64), cuda.device_array(0, x.dtype)
    return np.empty(0, dtype=np.int64), np.empty(0, dtype=x.dtype)


class Selector:
    """Base class: choose about k entries of largest magnitude of a 1-D array.

    Subclasses implement :meth:`select` and :meth:`max_count`; the state methods default to
    "no state".
    """

    kind = "base"

    def select(self, x, k, key=0) -> tuple[np.ndarray, np.ndarray]:
        """Select entries of ``x`` of large magnitude.

        Parameters
        ----------
        x : ndarray of shape (n,), float16, float32 or float64
            A block or a whole vector.
        k : int
            The budget, 0 ≤ k ≤ n.
        key : hashable, default 0
            The stream whose state is reused across steps (e.g. the block id). One call per
            key per step.

        Returns
        -------
        indices : int64 ndarray of shape (c,), ascending, relative to ``x``
            c ≤ :meth:`max_count` (k).
        values : ndarray of shape (c,), x's dtype
            ``x[indices]``, with their sign.

        Raises
        ------
        ValueError
            If ``x`` is not 1-D or k is outside [0, n].
        TypeError
            If k is not an integer.
        """
        raise NotImplementedError

    def max_count(self, k: int) -> int:
        """Upper bound of ``len(indices)`` returned for budget ``k`` (sizes receive buffers).

        Parameters
        ----------
        k : int
            The budget, ≥ 0.

        Returns
        -------
        int

        Raises
        ------
        TypeError
            If ``k`` is not an integer (bool included).
        ValueError
            If ``k`` < 0.
        """
        raise NotImplementedError

    def planned(self, n: int, k: int, key=0):
        """The threshold t the next :meth:`select` of an x of length n with budget k for ``key``
        will select above (``select_above(x, t)``), or None when that call will not (an exact
        call, or a selector without thresholds). A caller that makes that selection itself
        while it computes x (``spardl_kernels.accumulate_above``) passes it to :meth:`select`
        as ``above``. Changes nothing.

        Parameters
        ----------
        n : int
            Length of the next x, ≥ 0.
        k : int
            The budget, in [0, n].
        key : hashable, default 0
            The stream (as :meth:`select`).

        Returns
        -------
        float or None

        Raises
        ------
        TypeError
            If ``n`` or ``k`` is not an integer (bool included).
        ValueError
            If ``n`` < 0 or ``k`` is not in [0, n].
        """
        _check_n_k(n, k)
        return None

    def state_dict(self) -> dict:
        """The selector's state, to checkpoint.

        Returns
        -------
        dict
            Plain Python and NumPy values; ``"kind"`` names the selector.
        """
        return {"kind": self.kind}

    def load_state_dict(self, state) -> None:
        """Restore :meth:`state_dict` output.

        Parameters
        ----------
        state : dict
            A :meth:`state_dict` of a selector of this kind (and options).

        Raises
        ------
        TypeError
            If ``state`` is not a dict.
        ValueError
            If ``state`` was saved by another kind of selector (:class:`OptionMismatch`,
            naming both) or names no kind of selector.
        """
        if not isinstance(state, dict):
            raise TypeError(
                f"selector state must be a dict (from state_dict()), got {type_name(state)}"
            )
        kind = state.get("kind")
        if kind != self.kind and not (isinstance(kind, str) and kind in SELECTORS):
            raise ValueError(
                f"selector state kind must be one of {sorted(SELECTORS)}, got {kind!r}"
            )
        if kind != self.kind:  # a state of the other selector: an option, not a malformed state
            raise OptionMismatch(
                f"state was saved with selector={state.get('kind')!r}, this allreducer has "
                f"selector={self.kind!r}"
            )


class ExactSelector(Selector):
    """The exact top-k by magnitude (``spardl_kernels.topk_abs``); stateless.

    Ties go to the lower index and NaN ranks above +inf (docs/design.md §3), so every rank agrees.
    ``max_count(k) = k``.
    """

    kind = "exact"

    def select(self, x, k, key=0, above=None):
        """The exact top-k of ``x`` by magnitude.

        Parameters
        ----------
        x : ndarray of shape (n,), float16, float32 or float64
            A block or a whole vector (a NumPy or a GPU array).
        k : int
            The budget, 0 ≤ k ≤ n.
        key : hashable, default 0
            Ignored (no state).
        above : tuple, optional
            Ignored (every call is exact).

        Returns
        -------
        indices : int64 ndarray of shape (k,), ascending
        values : ndarray of shape (k,), x's dtype
            ``x[indices]``.

        Raises
        ------
        TypeError
            If ``k`` is not an integer (bool included).
        ValueError
            If ``x`` is not 1-D or ``k`` is not in [0, n].
        """
        x, k = _check_x_k(x, k)
        if k == 0:
            return _empty(x)
        return K.topk_abs(x, k)

    def max_count(self, k: int) -> int:
        """``k`` itself (see :meth:`Selector.max_count`).

        Parameters
        ----------
        k : int
            The budget, ≥ 0.

        Returns
        -------
        int

        Raises
        ------
        TypeError
            If ``k`` is not an integer (bool included).
        ValueError
            If ``k`` < 0.
        """
        return _check_k(k)


class ThresholdSelector(Selector):
    """Top-k by a magnitude threshold reused between exact recomputations (Ok-Topk style).

    Per key the selector keeps a threshold t and a call counter c.

    * Every ``interval``-th call for a key (c ≡ 0 mod ``interval``; always the first call, and
      whenever k or len(x) changed since the last call), the exact top-k is returned and
      t = ``kth_largest_abs(x, k)``.
    * Otherwise ``select_above(x, t)`` is returned (count c_t). If c_t > ``max_count(k)`` it falls
      back to the exact top-k and recomputes t exactly; the top-k then lies among the c_t > k
      entries the threshold passed (every entry above the k-th largest is above t), so it is
      selected from those, not from x again. Else t is nudged for the next call:
      t ← t · clip(((c_t + 1)/(k + 1))^γ, 1/2, 2) with γ = ``nudge``. A count above k raises
      t, a count below lowers it; the +1 keeps an empty selection from collapsing t to 0, and the
      clip bounds one step's change to a factor of two.
    * A threshold that is not a finite positive number (all-zero or non-finite data at the last
      exact step) is not reused: that call is exact.
    * k = len(x) (density 1: nothing is to be dropped) is always exact: every entry is returned,
      however the data moved since the threshold was set.

    So every call returns at most ``max_count(k) = ⌈k·(1 + slack)⌉`` entries, and
    at least k entries on the exact calls.

    Parameters
    ----------
    interval : int, default 32
        τ', calls between exact recomputations (Ok-Topk's default), ≥ 1. 1 means always exact.
    slack : float, default 0.25
        Allowed excess of a reused threshold's count over k, finite and ≥ 0.
    nudge : float, default 0.5
        γ, exponent of the multiplicative nudge, in [0, 1] (0 disables nudging).

    Raises
    ------
    ValueError, TypeError
        Naming the option, if it is out of range or of the wrong type.

    Notes
    -----
    Ok-Topk, arXiv 2201.07598, Sec. 3.1.1 (threshold reuse between exact top-k every τ' steps).
    The nudge is this project's rule.
    """

    kind = "threshold"

    def __init__(self, interval: int = 32, slack: float = 0.25, nudge: float = 0.5):
        check_int("interval", interval)
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        check_float("slack", slack)
        if not 0 <= slack < math.inf:
            raise ValueError(f"slack must be a finite number >= 0, got {slack}")
        check_float("nudge", nudge)
        if not 0 <= nudge <= 1:
            raise ValueError(f"nudge must be in [0, 1], got {nudge}")
        self.interval = int(interval)
        self.slack = float(slack)
        self.nudge = float(nudge)
        # key -> [threshold (float), calls (int), k (int), n (int)]
        self._keys: dict = {}

    def max_count(self, k: int) -> int:
        """⌈k·(1 + slack)⌉ (see :meth:`Selector.max_count`).

        Parameters
        ----------
        k : int
            The budget, ≥ 0.

        Returns
        -------
        int

        Raises
        ------
        TypeError
            If ``k`` is not an integer (bool included).
        ValueError
            If ``k`` < 0.
        """
        k = _check_k(k)
        bound = k * (1.0 + self.slack)
        if bound == math.inf:  # past a float (a huge slack): the exact product, no length's
            return math.ceil(Fraction(k) * (1 + Fraction(self.slack)))
        return math.ceil(bound)

    def _exact(self, x, k, st, above=None):
        """The exact top-k of x, and t set to its k-th largest |x|. ``above``: (indices, values)
        of every entry of x at or above some threshold, more than k of them: the top-k is
        among them (in ascending index order, so ties break alike), selected in O(len)."""
        if above is None:
            idx, vals = K.topk_abs(x, k)
        else:
            rel, vals = K.topk_abs(above[1], k)
            idx = A.take(above[0], rel)
        # The k-th largest |x| is the smallest of the k selected (the same total order): an
        # O(k) selection instead of a second pass over x.
        st[0] = float(K.kth_largest_abs(vals, k))
        return idx, vals

    def planned(self, n: int, k: int, key=0):
        """As :meth:`Selector.planned`: the reused threshold, or None on an exact call.

        Parameters
        ----------
        n : int
            Length of the next x, ≥ 0.
        k : int
            The budget, in [0, n].
        key : hashable, default 0
            The stream (as :meth:`select`).

        Returns
        -------
        float or None
            The threshold the next ``select(x, k, key)`` of an x of length ``n`` selects above,
            or None when that call is exact.

        Raises
        ------
        TypeError
            If ``n`` or ``k`` is not an integer (bool included).
        ValueError
            If ``n`` < 0 or ``k`` is not in [0, n].
        """
        n, k = _check_n_k(n, k)
        st = self._keys.get(key)
        if st is None or st[2] != k or st[3] != n or k == 0:
            return None
        t = st[0]
        if k == n or st[1] % self.interval == 0 or not (math.isfinite(t) and t > 0):
            return None
        return t

    def select(self, x, k, key=0, above=None):
        """As :meth:`Selector.select`; ``above``: the (indices, values) of
        ``select_above(x, planned(len(x), k, key))``, computed by the caller, used instead of
        selecting them here (ignored on a call that is exact)."""
        x, k = _check_x_k(x, k)
        n = x.shape[0]
        st = self._keys.get(key)
        if st is None or st[2] != k or st[3] != n:
            st = self._keys[key] = [math.nan, 0, k, n]
        calls = st[1]
        st[1] = calls + 1
        if k == 0:
            return _empty(x)
        t = st[0]
        if k == n or calls % self.interval == 0 or not (math.isfinite(t) and t > 0):
            return self._exact(x, k, st)
        idx, vals = K.select_above(x, t) if above is None else above
        c = idx.shape[0]
        if c > self.max_count(k):
            return self._exact(x, k, st, above=(idx, vals))
        factor = ((c + 1) / (k + 1)) ** self.nudge
        st[0] = t * min(2.0, max(0.5, factor))
        return idx, vals

    def state_dict(self) -> dict:
        """The options and, per key, the threshold and its call counter.

        Returns
        -------
        dict
            ``kind``, ``interval``, ``slack``, ``nudge`` and ``keys``: a list of
            (key, [threshold, calls, k, n]).
        """
        return {
            "kind": self.kind,
            "interval": self.interval,
            "slack": self.slack,
            "nudge": self.nudge,
            "keys": [(key, list(v)) for key, v in self._keys.items()],
        }

    def load_state_dict(self, state) -> None:
        """Restore :meth:`state_dict` output, all or nothing.

        Parameters
        ----------
        state : dict
            A :meth:`state_dict` of a ThresholdSelector with the same options (a key saved as a
            tuple may come back as a list, as JSON writes it).

        Raises
        ------
        TypeError
            If ``state`` is not a dict.
        ValueError
            If ``state`` is of another kind of selector or other options, lacks a field, or is
            malformed (``keys`` not a list of (key, [threshold, calls, k, n]) with a float
            threshold, counters in [0, 2**63) and 0 ≤ k ≤ n): nothing is loaded then.
        """
        super().load_state_dict(state)
        missing = [f for f in ("interval", "slack", "nudge", "keys") if f not in state]
        if missing:
            raise ValueError(
                f"selector state is missing key(s) {missing} (not a state_dict() output?)"
            )
        for name in ("interval", "slack", "nudge"):
            if state[name] != getattr(self, name):
                raise ValueError(
                    f"selector state has {name}={state[name]!r}, "
                    f"this selector has {getattr(self, name)!r}"
                )
        try:
            entries = state["keys"]
            if not isinstance(entries, (list, tuple)):
                raise TypeError(f"selector state keys must be a list, got {type_name(entries)}")
            keys = {}
            for entry in entries:
                if not isinstance(entry, (list, tuple)) or len(entry) != 2:
                    raise ValueError(
                        f"selector state keys: an entry is (key, [threshold, calls, k, n]), "
                        f"got {entry!r}"
                    )
                key, v = entry
                key = tuple(key) if isinstance(key, list) else key
                try:
                    hash(key)
                except TypeError:
                    raise TypeError(f"selector state key {key!r} is not hashable") from None
                if not isinstance(v, (list, tuple)) or len(v) != 4:
                    raise ValueError(
                        f"selector state key {key!r}: [threshold, calls, k, n], got {v!r}"
                    )
                t = float(check_float("selector state threshold", v[0]))
                calls, k, n = (
                    check_counter(f"selector state {f}", x)
                    for f, x in zip(("calls", "k", "n"), v[1:], strict=True)
                )
                if k > n:
                    raise ValueError(f"selector state key {key!r}: k={k} > n={n}")
                keys[key] = [t, calls, k, n]
        except Exception as e:  # noqa: BLE001 - a malformed state: nothing loaded, a ValueError
            raise malformed(e) from e
        self._keys = keys


SELECTORS = {"exact": ExactSelector, "threshold": ThresholdSelector}


def make_selector(kind: str, **opts) -> Selector:
    """A selector by name.

    Parameters
    ----------
    kind : {"exact", "threshold"}
        :class:`ExactSelector` or :class:`ThresholdSelector`.
    **opts
        The selector's options (``interval``, ``slack``, ``nudge`` for "threshold"; none for
        "exact").

    Returns
    -------
    Selector

    Raises
    ------
    ValueError
        Naming ``selector`` if ``kind`` is unknown; naming the option if an option is out of range.
    TypeError
        Naming the option if it is unknown for this kind or of the wrong type.
    """
    cls = SELECTORS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"selector must be one of {sorted(SELECTORS)}, got {kind!r}")
    if cls is ExactSelector and opts:
        raise TypeError(f"selector 'exact' takes no options, got {sorted(opts)}")
    allowed = {"interval", "slack", "nudge"}
    unknown = set(opts) - allowed
    if unknown:
        raise TypeError(
            f"selector {kind!r}: unknown option(s) {sorted(unknown)}; accepted: {sorted(allowed)}"
        )
    return cls(**opts)
