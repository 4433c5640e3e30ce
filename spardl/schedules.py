"""Communication schedules as pure functions of (P, rank): no MPI, tested symbolically.

Each schedule is a list of :class:`Round`: in a round a rank sends one packed message to ``dest``
holding the items ``send`` and receives one from ``source`` holding the items ``recv``. Items are
block ids (Spar-Reduce-Scatter) or the ids of the ranks whose contribution an item is (Bruck
all-gather), always in [0, P). A round's items are consecutive modulo P, so they are held as a
:class:`CyclicRange` (first item, length, P): a schedule takes O(log P) time and memory for any P.
"""

from __future__ import annotations

import math
import numbers
import operator
import sys
from collections.abc import Sequence
from typing import NamedTuple

from ._checks import check_int

__all__ = ["CyclicRange", "Round", "num_rounds", "srs_schedule", "bruck_schedule"]


class CyclicRange(Sequence):
    """The integers ``start, start+1, …, start+count−1``, each taken modulo ``modulus``: an
    immutable sequence that stores three numbers whatever its length.

    Parameters
    ----------
    start : int
        The first item before the reduction modulo ``modulus`` (any integer).
    count : int
        The number of items, in [0, modulus] and at most ``sys.maxsize`` (so that ``len``
        reports it); the items are distinct.
    modulus : int
        The modulus, ≥ 1; every item lies in [0, modulus).

    Raises
    ------
    TypeError
        If an argument is not an integer (a Python or NumPy one; a bool is not).
    ValueError
        If ``modulus`` < 1, or ``count`` is negative or above ``modulus`` or ``sys.maxsize``.

    Notes
    -----
    It reads as the tuple of its items: ``len``, indexing (negative indices too), ``in``,
    ``index`` and ``count`` take O(1) time and memory, iteration (forward and reversed) O(1)
    per item. A slice of step 1 is again a :class:`CyclicRange`; a slice of any other step is
    the tuple of its items. It equals a tuple of the same items and another
    :class:`CyclicRange` of the same items (compared in O(1)), and, like a tuple, never a
    list; ``+`` with a tuple or a :class:`CyclicRange` gives the concatenated tuple. Its hash is
    the equal tuple's, so hashing costs time and memory linear in the length, as building that
    tuple does. An integer, or a real number (``numbers.Real``) equal to one, is a member when it
    equals an item (``3``, ``numpy.int64(3)``, ``3.0``), as for the tuple; no other value is.
    """

    __slots__ = ("_start", "_count", "_modulus")

    def __init__(self, start: int, count: int, modulus: int):
        for name, value in (("start", start), ("count", count), ("modulus", modulus)):
            check_int(name, value)
        start, count, modulus = int(start), int(count), int(modulus)
        if modulus < 1:
            raise ValueError(f"modulus must be >= 1, got {modulus}")
        most = min(modulus, sys.maxsize)
        if not 0 <= count <= most:
            raise ValueError(
                f"count must be in [0, min(modulus, sys.maxsize) = {most}], got {count}"
            )
        object.__setattr__(self, "_start", start % modulus)
        object.__setattr__(self, "_count", count)
        object.__setattr__(self, "_modulus", modulus)

    def __setattr__(self, name, value):
        raise AttributeError(f"CyclicRange is immutable (cannot set {name!r})")

    def __delattr__(self, name):
        raise AttributeError(f"CyclicRange is immutable (cannot delete {name!r})")

    def __reduce__(self):
        return (CyclicRange, (self._start, self._count, self._modulus))

    @property
    def start(self) -> int:
        """The first item, reduced into [0, modulus) (also for an empty range)."""
        return self._start

    @property
    def modulus(self) -> int:
        """The modulus; every item lies in [0, modulus)."""
        return self._modulus

    def _runs(self) -> tuple:
        """The items as at most two runs ``(lo, hi)`` of consecutive integers lo … hi−1: up to
        the wrap past modulus − 1, then from 0. The runs are maximal (modulus − 1 and 0 are not
        consecutive), so two ranges hold the same items exactly when their runs are equal."""
        s, c, m = self._start, self._count, self._modulus
        if c == 0:
            return ()
        if s + c <= m:
            return ((s, s + c),)
        return ((s, m), (0, s + c - m))

    def __len__(self) -> int:
        return self._count

    def __iter__(self):
        for lo, hi in self._runs():
            yield from range(lo, hi)

    def __reversed__(self):
        for lo, hi in reversed(self._runs()):
            yield from range(hi - 1, lo - 1, -1)

    def __getitem__(self, key):
        if isinstance(key, slice):
            picked = range(self._count)[key]
            if picked.step == 1:
                n = max(0, picked.stop - picked.start)
                return CyclicRange(self._start + picked.start, n, self._modulus)
            return tuple(self[i] for i in picked)
        try:
            i = operator.index(key)
        except TypeError:
            raise TypeError(
                f"CyclicRange indices must be integers or slices, got {type(key).__name__}"
            ) from None
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError("CyclicRange index out of range")
        v = self._start + i
        return v - self._modulus if v >= self._modulus else v

    def _position(self, value):
        """The position of ``value`` among the items, or None when it equals none of them."""
        try:
            v = operator.index(value)
        except TypeError:
            # a real number equal to an integer (3.0, Fraction(3)) is compared as that integer
            if not isinstance(value, numbers.Real):
                return None
            try:
                v = math.floor(value)
            except (OverflowError, ValueError):  # inf, nan
                return None
            if v != value:
                return None
        if not 0 <= v < self._modulus:
            return None
        i = (v - self._start) % self._modulus
        return i if i < self._count else None

    def __contains__(self, value) -> bool:
        return self._position(value) is not None

    def index(self, value, start=0, stop=None) -> int:
        """The position of ``value``, searched in positions [start, stop) as ``tuple.index``.

        Raises
        ------
        ValueError
            If no item in those positions equals ``value``.
        """
        i = self._position(value)
        lo, hi, _ = slice(start, stop).indices(self._count)
        if i is None or not lo <= i < hi:
            raise ValueError(f"{value!r} is not in the CyclicRange")
        return i

    def count(self, value) -> int:
        """How many items equal ``value``: 0 or 1 (the items are distinct)."""
        return 0 if self._position(value) is None else 1

    def __eq__(self, other):
        if isinstance(other, CyclicRange):
            return self._runs() == other._runs()
        if isinstance(other, tuple):
            return len(other) == self._count and all(
                a == b for a, b in zip(self, other, strict=True)
            )
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __add__(self, other):
        if isinstance(other, (tuple, CyclicRange)):
            return tuple(self) + tuple(other)
        return NotImplemented

    def __radd__(self, other):
        if isinstance(other, tuple):
            return other + tuple(self)
        return NotImplemented

    def __repr__(self) -> str:
        return f"CyclicRange(start={self._start}, count={self._count}, modulus={self._modulus})"


class Round(NamedTuple):
    """One round of a schedule, seen from one rank.

    dest : int, the rank this rank sends to
    send : CyclicRange, the items sent, in this order (equal to the tuple of them)
    source : int, the rank this rank receives from
    recv : CyclicRange, the items received, in this order (equal to the tuple of them)
    """

    dest: int
    send: CyclicRange
    source: int
    recv: CyclicRange


def _check(P, rank):
    check_int("P", P, numpy=False)
    check_int("rank", rank, numpy=False)
    if P < 1:
        raise ValueError(f"P must be >= 1, got {P}")
    if P > sys.maxsize:
        raise ValueError(f"P must be <= sys.maxsize = {sys.maxsize}, got {P}")
    if not 0 <= rank < P:
        raise ValueError(f"rank must be in [0, P={P}), got {rank}")


def num_rounds(P: int) -> int:
    """R = ⌈log₂P⌉ (0 for P = 1).

    Raises
    ------
    TypeError
        If P is not a Python int (a bool or a NumPy integer is not), as in :func:`srs_schedule`.
    ValueError
        If P < 1.
    """
    check_int("P", P, numpy=False)
    if P < 1:
        raise ValueError(f"P must be >= 1, got {P}")
    return (P - 1).bit_length()


def srs_schedule(P: int, rank: int) -> list[Round]:
    """The Spar-Reduce-Scatter schedule of one rank, for any P.

    R = ⌈log₂P⌉ rounds. Round sizes s₀ = P − 2^(R−1), then s_j = 2^(R−1−j) for j ≥ 1; gaps
    g_j = 2^(R−1−j). In round j rank r sends blocks r+g_j … r+g_j+s_j−1 (mod P) to rank r+g_j and
    receives blocks r … r+s_j−1 from rank r−g_j. The sizes add to P−1; every rank sends every
    block it does not own exactly once (after it has received everything it will receive for
    that block), and rank r ends owning block r, summed over all ranks along a binomial tree.

    Parameters
    ----------
    P : int
        Ranks (≥ 1).
    rank : int
        This rank, in [0, P).

    Returns
    -------
    list of Round
        R rounds; ``send``/``recv`` are the block ids, each a :class:`CyclicRange` (equal to
        the tuple of the ids; O(1) memory whatever its length). Empty for P = 1.

    Raises
    ------
    TypeError
        If P or rank is not a Python int (a bool or a NumPy integer is not).
    ValueError
        If P < 1 or P > ``sys.maxsize`` (the most items ``len`` can count), or rank is outside
        [0, P).

    Notes
    -----
    SparDL, Zhao et al., arXiv 2304.00737, Sec. 4.1 (Spar-Reduce-Scatter, the non-power-of-two
    case handled by a first round of size P − 2^(R−1)); docs/design.md §4.
    """
    _check(P, rank)
    R = num_rounds(P)
    rounds = []
    for j in range(R):
        g = 1 << (R - 1 - j)
        s = P - g if j == 0 else g
        send = CyclicRange(rank + g, s, P)
        recv = CyclicRange(rank, s, P)
        rounds.append(Round((rank + g) % P, send, (rank - g) % P, recv))
    return rounds


def bruck_schedule(P: int, rank: int) -> list[Round]:
    """The Bruck all-gather schedule of one rank, for any P.

    ⌈log₂P⌉ rounds. Before round i rank r holds the items r, r+1, …, r+2^i−1 (mod P) (item q is
    rank q's contribution). In round i it sends the first min(2^i, P−2^i) items it holds,
    r … r+c−1, to rank r−2^i and receives items r+2^i … r+2^i+c−1 from rank r+2^i. After the last
    round every rank holds every item exactly once. Items are named by their owner, so no final
    rotation is needed (this is the variant that sends "down", to r−2^i).

    Parameters
    ----------
    P : int
        Ranks (≥ 1).
    rank : int
        This rank, in [0, P).

    Returns
    -------
    list of Round
        ⌈log₂P⌉ rounds; ``send``/``recv`` are the item (owner rank) ids, each a
        :class:`CyclicRange` (equal to the tuple of the ids; O(1) memory whatever its length).
        Empty for P = 1.

    Raises
    ------
    TypeError
        If P or rank is not a Python int (a bool or a NumPy integer is not).
    ValueError
        If P < 1 or P > ``sys.maxsize`` (the most items ``len`` can count), or rank is outside
        [0, P).

    Notes
    -----
    Bruck, Ho, Kipnis, Upfal & Weathersby, "Efficient algorithms for all-to-all communications in
    multiport message-passing systems", IEEE TPDS 8(11), 1997 (the concatenation algorithm).
    """
    _check(P, rank)
    rounds = []
    for i in range(num_rounds(P)):
        step = 1 << i
        c = min(step, P - step)
        send = CyclicRange(rank, c, P)
        recv = CyclicRange(rank + step, c, P)
        rounds.append(Round((rank - step) % P, send, (rank + step) % P, recv))
    return rounds
