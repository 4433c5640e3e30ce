"""Type checks of option values, one wording for every module: ``{name} must be an integer, got
{type}`` and ``{name} must be a float, got {type}`` (a TypeError naming the argument).

``bool`` is a subclass of ``int`` in Python, so ``teams=True`` would pass a plain
``isinstance(v, int)``; every check here rejects it. Range checks stay with their callers, which
know the range and word it, except the density's (ρ in (0, 1]), which every allreducer, its
loaded states and the cost model share.

Also the undo of a failed call shared by the allreducers and the PyTorch layer: an undo that
raises leaves its owner half restored (:func:`undo_or_break`), and every later use of it
refuses (:func:`restored_error`).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "MAX_WORLD_SIZE",
    "add_note",
    "check_int",
    "check_int_at_least",
    "check_float",
    "check_bool",
    "check_choice",
    "check_counter",
    "check_counter_room",
    "check_density",
    "is_count",
    "load_error",
    "malformed",
    "raise_if",
    "restored_error",
    "type_name",
    "undo_or_break",
]


#: The most ranks a world holds: MPI's ranks and sizes are C ints (the kernels' ``check_P`` has
#: the same bound; that package does not import this one).
MAX_WORLD_SIZE = 2**31 - 1


def type_name(value) -> str:
    """The name of ``value``'s type for a message: ``float`` for a builtin, ``numpy.float32``,
    ``numpy.bool`` or ``torch.Tensor`` for the others (a NumPy bool is not a bool here, and
    "must be a bool, got bool" would not say why)."""
    t = type(value)
    if t.__module__ == "builtins":
        return t.__qualname__
    return f"{t.__module__}.{t.__qualname__}"


def check_bool(name: str, value):
    """``value`` itself when it is a Python ``bool`` (a NumPy bool or an int is not).

    Raises
    ------
    TypeError
        ``"{name} must be a bool, got {type}"``.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type_name(value)}")
    return value


def check_choice(name: str, value, choices) -> str:
    """``value`` when it is one of the strings ``choices``: a TypeError naming ``name`` for a
    value that is no string, a ValueError listing ``choices`` for another string."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type_name(value)}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def is_count(value) -> bool:
    """Whether ``value`` is a non-negative integer (a Python or NumPy one, never a bool): the
    predicate of :func:`check_int` with the range of a counter."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0


def check_int(name: str, value, *, numpy: bool = True):
    """``value`` itself when it is an integer: a Python ``int``, or a NumPy integer when ``numpy``
    (the pure modules, whose results are Python numbers, take Python ints only); never a bool.

    Raises
    ------
    TypeError
        ``"{name} must be an integer, got {type}"``.
    """
    types = (int, np.integer) if numpy else int
    if isinstance(value, bool) or not isinstance(value, types):
        raise TypeError(f"{name} must be an integer, got {type_name(value)}")
    return value


def check_int_at_least(name: str, value, lo: int, *, numpy: bool = True) -> int:
    """``value`` as a Python int when it is an integer (:func:`check_int`) ≥ ``lo``.

    Raises
    ------
    TypeError
        ``"{name} must be an integer, got {type}"``.
    ValueError
        ``"{name} must be >= {lo}, got {value}"``.
    """
    check_int(name, value, numpy=numpy)
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return int(value)


def check_counter(name: str, value) -> int:
    """``value`` as a Python int when it is a loaded step or call count: an integer (not a bool)
    in [0, 2**63).

    Raises
    ------
    TypeError
        ``"{name} must be an integer, got {type}"`` (:func:`check_int`).
    ValueError
        ``"{name} must be in [0, 2**63), got {value}"``.
    """
    check_int(name, value)
    if not 0 <= value < 2**63:
        raise ValueError(f"{name} must be in [0, 2**63), got {value}")
    return int(value)


def check_counter_room(name: str, value: int) -> None:
    """Refuse, before it changes anything, a call that would take the step or call count
    ``value`` past 2**63 - 1: its state would hold 2**63, which :func:`check_counter` (every
    state loader) refuses, so a checkpoint saved after it could not be loaded.

    Raises
    ------
    OverflowError
        ``"{name} is {value}, the largest a state holds (2**63 - 1): ..."``.
    """
    if value >= 2**63 - 1:
        raise OverflowError(
            f"{name} is {value}, the largest a state holds (2**63 - 1): one more call would "
            "take it past, and a checkpoint saved after it could not be loaded; nothing was "
            "changed"
        )


class OptionMismatch(ValueError):
    """A state saved under another option than this object's (a load refuses it naming both),
    as opposed to a malformed one (:func:`malformed`)."""


def malformed(e: BaseException) -> ValueError:
    """The ValueError a load raises for a state it could not take (``e``: a KeyError for a
    missing field, an OverflowError of a number past a float, ...), ``e`` as its cause."""
    err = ValueError(f"state is malformed ({type(e).__name__}: {e})")
    err.__cause__ = e
    return err


def load_error(e: Exception) -> Exception:
    """What a load reports (to its agreement) for the exception ``e`` of taking a state: an
    argument error (a TypeError or ValueError, :class:`OptionMismatch` included) stays as it
    is; anything else becomes the malformed-state error (:func:`malformed`), ``e`` its cause."""
    return e if isinstance(e, (TypeError, ValueError)) else malformed(e)


def check_float(name: str, value, *, numpy: bool = True, or_none: bool = False):
    """``value`` itself when it is a real number: a Python ``int`` or ``float``, or a NumPy float
    or integer when ``numpy``; never a bool. With ``or_none``, None passes too (and the message
    says so).

    Raises
    ------
    TypeError
        ``"{name} must be a float, got {type}"`` (``"a float or None"`` with ``or_none``).
    """
    if or_none and value is None:
        return None
    types = (int, float, np.floating, np.integer) if numpy else (int, float)
    if isinstance(value, bool) or not isinstance(value, types):
        what = "a float or None" if or_none else "a float"
        raise TypeError(f"{name} must be {what}, got {type_name(value)}")
    return value


def check_density(name: str, value, *, numpy: bool = True) -> float:
    """``value`` as the Python float it is stored as, when that is a density ρ in (0, 1].

    The range is checked on that float, not on ``value`` in its own precision: a NumPy
    longdouble of 1e-4000 is in range but stored as 0.0, and is rejected.

    Raises
    ------
    TypeError
        ``"{name} must be a float, got {type}"`` (:func:`check_float`).
    ValueError
        ``"{name} must be in (0, 1], got {value}"``, NaN included.
    """
    check_float(name, value, numpy=numpy)
    try:
        rho = float(value)
    except OverflowError:  # an integer too large for a float is out of range anyway
        rho = math.inf
    if not 0 < rho <= 1:  # NaN fails every comparison
        # a Python number as itself; another (a NumPy longdouble) by its repr, which keeps
        # its own precision (formatting it as a float would print 1e-4000 as 0.0)
        shown = value if type(value) in (int, float) else repr(value)
        if type(value) is int and value.bit_length() > 64:
            shown = f"an integer of {len(str(value))} digits"
        raise ValueError(f"{name} must be in (0, 1], got {shown}")
    return rho


def undo_or_break(owner, undo, error: BaseException | None = None) -> None:
    """Call ``undo()``, which puts back what a failed (``error``, propagating) or skipped call
    of ``owner`` changed. ``owner`` is anything with a ``broken`` attribute (None while sound):
    an allreducer, or a core or the hook state of :mod:`spardl.torch`.

    If the undo raises too, the state is half restored: ``owner.broken`` keeps the undo's
    exception, and every later use refuses (:func:`restored_error`). With ``error``, the
    undo's failure is attached to it as a note (PEP 678), and this returns so that the caller
    re-raises ``error``, the one the caller of the failed call must see (an interrupt during
    the undo still propagates); without it, the undo's exception propagates."""
    try:
        undo()
    except BaseException as e:
        owner.broken = e
        if error is None or not isinstance(e, Exception):
            raise
        add_note(
            error,
            f"undoing it failed too ({type(e).__name__}: {e}): the state could not be "
            "restored, and this object refuses every later call",
        )


def add_note(error: BaseException, note: str) -> None:
    """Attach ``note`` to ``error`` (PEP 678), shown under its message in a traceback."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10: where PEP 678's backports read notes
        error.__notes__ = [*getattr(error, "__notes__", []), note]


def restored_error(owners) -> RuntimeError | None:
    """The error every later use raises if a failed call of one of ``owners`` could not be
    undone (``broken``, set by :func:`undo_or_break`): a RuntimeError saying that the state
    could not be restored, the undo's error as its cause; None if every owner is sound. An
    undo can fail on one rank only, so a collective call hands it to its agreement (every rank
    raises), never raises it on its own rank before the others' messages."""
    for owner in owners:
        if owner.broken is not None:
            e = owner.broken
            err = RuntimeError(
                f"the state could not be restored after a failed call (undoing it raised "
                f"{type(e).__name__}: {e}): this object cannot go on from it; close it and "
                "start again from a checkpoint"
            )
            err.__cause__ = e
            return err
    return None


def raise_if(err: BaseException | None) -> None:
    """Raise ``err`` unless it is None (a local call's refusal: :func:`restored_error`)."""
    if err is not None:
        raise err
