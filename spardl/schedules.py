"""Communication schedules as pure functions of (P, rank): no MPI, tested symbolically.

Each schedule is a list of :class:`Round`: in a round a rank sends one packed message to ``dest``
holding the items ``send`` and receives one from ``source`` holding the items ``recv``. Items are
block ids (Spar-Reduce-Scatter) or the ids of the ranks whose contribution an item is (Bruck
all-gather), always in [0, P).
"""

from __future__ import annotations

from typing import NamedTuple

from ._checks import check_int

__all__ = ["Round", "num_rounds", "srs_schedule", "bruck_schedule"]


class Round(NamedTuple):
    """One round of a schedule, seen from one rank.

    dest : int, the rank this rank sends to
    send : tuple of int, the items sent, in this order
    source : int, the rank this rank receives from
    recv : tuple of int, the items received, in this order
    """

    dest: int
    send: tuple
    source: int
    recv: tuple


def _check(P, rank):
    check_int("P", P, numpy=False)
    check_int("rank", rank, numpy=False)
    if P < 1:
        raise ValueError(f"P must be >= 1, got {P}")
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
        R rounds; ``send``/``recv`` are block ids. Empty for P = 1.

    Raises
    ------
    ValueError, TypeError
        If P < 1 or rank is outside [0, P).

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
        send = tuple((rank + g + i) % P for i in range(s))
        recv = tuple((rank + i) % P for i in range(s))
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
        ``send``/``recv`` are item (owner rank) ids. Empty for P = 1.

    Raises
    ------
    ValueError, TypeError
        If P < 1 or rank is outside [0, P).

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
        send = tuple((rank + q) % P for q in range(c))
        recv = tuple((rank + step + q) % P for q in range(c))
        rounds.append(Round((rank - step) % P, send, (rank + step) % P, recv))
    return rounds
