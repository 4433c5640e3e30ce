"""Type checks of option values, one wording for every module: ``{name} must be an integer, got
{type}`` and ``{name} must be a float, got {type}`` (a TypeError naming the argument).

``bool`` is a subclass of ``int`` in Python, so ``teams=True`` would pass a plain
``isinstance(v, int)``; every check here rejects it. Range checks stay with their callers, which
know the range and word it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["check_int", "check_float", "check_bool", "type_name"]


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
