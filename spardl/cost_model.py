"""α-β(-γ) costs of every allreduce in :data:`spardl.ALGORITHMS`: closed forms and trace replay.

Units: α is seconds per message (latency), β seconds per byte (inverse bandwidth), γ seconds per
byte merged (the local reduction of what arrives: ``merge_add``, ``coalesce``, ``scatter_add``).
A *word* is one index or one value, so an (index, value) pair is 2 words, and ``word_bytes``
(4 for int32 wire indices and float32 values) turns words into bytes.

Two counts, and why they differ
-------------------------------
* ``messages`` counts what :mod:`spardl.comm` counts in ``stats["messages"]``: a point-to-point
  send is 1 **and so is a collective call**, whatever the MPI library does inside it. Measured
  stats match these formulas exactly (``tests/mpi/test_cost_model.py``).
* ``rounds`` counts the latency terms that set the time. A point-to-point message is one round;
  a collective runs at its algorithmic cost on P ranks: ⌈log₂P⌉ rounds for an all-gather(v) or a
  broadcast (Bruck / binomial tree), 2⌈log₂P⌉ for an allreduce (Rabenseifner: reduce-scatter +
  all-gather). Counting a collective as one α, as ``messages`` does, flatters the all-gather based
  methods (topka, gaussiank, topkdsa, Ok-Topk's last step) at large P.

Every closed form is per rank and per step:

* ``words``: the volume one rank sends, as :mod:`spardl.comm` accounts it: an all-gather sends
  everything but the rank's own part ((P−1)·part), an allreduce of m words 2m(P−1)/P, a broadcast
  m(P−1)/P;
* ``path_words``: the words on the critical path (the β terms of the time). It equals ``words``
  for every algorithm whose ranks all send in every round; only the tree of ``gtopk`` differs
  (a rank sends once, the root waits ⌈log₂P⌉ rounds).

Time = rounds·α + path_words·word_bytes·(β + γ). γ is charged once per byte on the critical path:
every byte that arrives is merged into a partial sum or an output once (in the symmetric
exchanges of these algorithms a rank receives what it sends). With γ = 0 (the default) the model
is the classic α-β model. Headers (block counts, padding) are left out: a few bytes per message.
With P = 1 nothing is sent and every cost is zero.

Wire formats (docs/design.md §2.1): the formulas count words; ``predict(..., wire="compact")``
prices them at :func:`compact_pair_bytes`/2 bytes each (delta-coded indices and 16-bit values
at the given density) instead of ``word_bytes``, and adds the size messages that variable-size
compact buffers need where "coo" sends a fixed size (a size all-gather before topka's and
oktopk's last all-gather, a size broadcast before gtopk's broadcast).

:func:`replay` prices a recorded trace (:mod:`spardl.trace`) with the same rules, message by
message, so traces of any algorithm, including future ones, need no formula.

The ``NETWORKS`` presets give α and β of common interconnects, with their sources.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from ._checks import (
    check_choice,
    check_density,
    check_float,
    check_int,
    check_int_at_least,
    type_name,
)

__all__ = [
    "Cost",
    "NETWORKS",
    "FORMULAS",
    "ceil_log2",
    "dense",
    "topka",
    "gaussiank",
    "topkdsa",
    "gtopk",
    "spardl",
    "oktopk",
    "budget",
    "collective_rounds",
    "compact_pair_bytes",
    "predict",
    "replay",
    "replay_steps",
]


@dataclass(frozen=True)
class Cost:
    """Per-rank, per-step cost of one allreduce.

    Attributes
    ----------
    messages : float
        Data messages one rank sends (a collective call counts 1). Amortized (fractional) where
        some steps send more, as Ok-Topk's re-evaluation steps.
    words : float
        Words (indices and values) one rank sends.
    rounds : float
        Latency terms on the critical path (α terms of the time): a point-to-point message is
        1, a collective its algorithmic cost (:func:`collective_rounds`).
    path_words : float
        Words on the critical path (β terms of the time, times ``word_bytes``).
    """

    messages: float
    words: float
    rounds: float
    path_words: float

    def seconds(self, alpha: float, beta: float, word_bytes: int = 4, gamma: float = 0.0) -> float:
        """rounds·α + path_words·word_bytes·(β + γ), in seconds.

        Parameters
        ----------
        alpha, beta : float
            α in seconds per message (per round), β in seconds per byte sent; finite, ≥ 0.
        word_bytes : float, default 4
            Bytes per word, finite and > 0.
        gamma : float, default 0.0
            γ in seconds per byte merged (each byte that arrives is merged once); finite, ≥ 0.

        Returns
        -------
        float
            Seconds of one step on the critical path.

        Raises
        ------
        TypeError
            If a rate or ``word_bytes`` is not a real number (bool included), naming it.
        ValueError
            If a rate is negative or not finite, or ``word_bytes`` is not finite and > 0.
        """
        _check_rates(alpha, beta, gamma)
        _check_positive("word_bytes", word_bytes)
        # Term by term: β + γ may overflow for huge finite rates, and 0·inf would be NaN
        # where nothing is sent (P = 1).
        path_bytes = self.path_words * word_bytes
        return self.rounds * alpha + path_bytes * beta + path_bytes * gamma


def _cost(messages, words, rounds=None, path_words=None) -> Cost:
    return Cost(
        float(messages),
        float(words),
        float(messages if rounds is None else rounds),
        float(words if path_words is None else path_words),
    )


_ZERO = Cost(0.0, 0.0, 0.0, 0.0)

#: The ``kind`` of a trace record (:func:`collective_rounds`).
_KINDS = ("p2p", "allgather", "allgatherv", "bcast", "allreduce")


def _check_count(name: str, value, lo: int) -> int:
    """``value`` when it is a Python int (not a bool) ≥ ``lo``: TypeError or ValueError naming
    ``name`` otherwise. The integer check of every function here."""
    return check_int_at_least(name, value, lo, numpy=False)


def _check(P, n, k, **options) -> None:
    """The argument checks of every closed form: P ≥ 1, n ≥ 1 and k in [1, n], Python ints;
    ``options``: name=(value, lo), an integer option that must be ≥ lo."""
    _check_count("P", P, 1)
    _check_count("n", n, 1)
    check_int("k", k, numpy=False)
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    for name, (value, lo) in options.items():
        _check_count(name, value, lo)


def ceil_log2(P: int) -> int:
    """⌈log₂P⌉ (0 for P = 1): rounds of a binomial tree, a Bruck all-gather or SRS.

    Parameters
    ----------
    P : int
        A number of ranks, ≥ 1 (a Python int).

    Returns
    -------
    int

    Raises
    ------
    TypeError
        If ``P`` is not an integer (bool included).
    ValueError
        If ``P`` < 1.
    """
    _check_count("P", P, 1)
    return (P - 1).bit_length()


def collective_rounds(kind: str, P: int) -> int:
    """Latency terms (α) of one collective call on P ranks, or of one point-to-point message.

    Parameters
    ----------
    kind : {"p2p", "allgather", "allgatherv", "bcast", "allreduce"}
        The ``kind`` field of a trace record (:meth:`spardl.comm.Comm.start_trace`).
    P : int
        Ranks taking part in the collective.

    Returns
    -------
    int
        1 for "p2p"; ⌈log₂P⌉ for an all-gather(v) (Bruck, IEEE TPDS 1997) or a broadcast
        (binomial tree); 2⌈log₂P⌉ for an allreduce (Rabenseifner's reduce-scatter + all-gather,
        Thakur, Rabenseifner & Gropp, IJHPCA 2005, Sec. 4.4). 0 for a collective on one rank.

    Raises
    ------
    TypeError
        If ``kind`` is not a string or ``P`` not an integer (bool included), naming it.
    ValueError
        If ``kind`` is unknown or ``P`` < 1.
    """
    check_choice("kind", kind, _KINDS)
    _check_count("P", P, 1)
    if kind == "p2p":
        return 1
    if kind in ("allgather", "allgatherv", "bcast"):
        return ceil_log2(P)
    return 2 * ceil_log2(P)


def density_floor(density: float, count: int, divisor: int = 1) -> int:
    """⌊ρ·count/divisor⌋, with ρ read as the decimal it was written as.

    A float ρ stands for the shortest decimal that rounds to it (what ``repr`` prints: 0.29,
    whose binary value is 0.28999999999999998), and the product with that decimal is exact:
    0.29·100 gives 29, 0.882037037·5000027 gives 4410208 (4410208.999999999), at any size. A
    density computed as a ratio counts as the ratio: when m = ⌊…⌋ + 1 has m·divisor/count
    rounding to ρ itself (2/3 of 3 entries, whose decimal 0.6666666666666666 falls short), m.
    That rule also applies where a float cannot tell m/count from ρ, once count passes about
    1/(ρ·2⁻⁵³) (10¹⁶ entries at ρ = 0.1): 0.1 of 10¹⁸ + 1 gives 10¹⁷ + 1.

    Parameters
    ----------
    density : float
        ρ, in (0, 1] (a NumPy float is read as a Python float).
    count, divisor : int
        count ≥ 0, divisor ≥ 1.

    Returns
    -------
    int
    """
    rho = float(density)
    x = Fraction(repr(rho)) * count / divisor
    k = math.floor(x)
    if k < x and count and float(Fraction((k + 1) * divisor, count)) == rho:
        return k + 1
    return k


def budget(density: float, n: int) -> int:
    """k = ⌊ρ·n⌋, at least 1 and at most n (the rule of :func:`spardl.algorithms.base.budget`;
    :func:`density_floor`).

    Parameters
    ----------
    density : float
        ρ in (0, 1].
    n : int
        The vector's length, ≥ 1.

    Returns
    -------
    int
        k in [1, n].

    Raises
    ------
    TypeError
        If ``density`` is not a real number or ``n`` not an integer (bool included), naming it.
    ValueError
        If ``density`` is not in (0, 1] or ``n`` < 1, naming it.
    """
    rho = check_density("density", density)
    check_int("n", n)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return int(min(n, max(1, density_floor(rho, n))))


# -- the algorithms ------------------------------------------------------------------------------
def dense(P: int, n: int, k: int | None = None) -> Cost:
    """Dense allreduce of n values: one collective (1 message, 2⌈log₂P⌉ rounds), 2n(P−1)/P words.

    Parameters
    ----------
    P : int
        Ranks, ≥ 1.
    n : int
        Gradient length, ≥ 1.
    k : int, optional
        Ignored (a dense allreduce sends every value), but checked to be in [1, n] if given.

    Returns
    -------
    Cost
        Per rank and step (words, rounds; :meth:`Cost.seconds` for seconds); all zero at P = 1.

    Raises
    ------
    TypeError
        If P, n or a given k is not a Python int (bool included), naming it.
    ValueError
        If P < 1, n < 1 or a given k is not in [1, n], naming it.

    Notes
    -----
    Rabenseifner's reduce-scatter + all-gather (Thakur, Rabenseifner & Gropp, "Optimization of
    Collective Communication Operations in MPICH", IJHPCA 2005, Sec. 4.4):
    2·log₂P·α + 2n(P−1)/P·β; one collective call here.
    """
    _check(P, n, n if k is None else k)
    if P == 1:
        return _ZERO
    return _cost(1, 2 * n * (P - 1) / P, rounds=collective_rounds("allreduce", P))


def topka(P: int, n: int, k: int) -> Cost:
    """TopkA: all-gather of every rank's k (index, value) pairs: 1 message (⌈log₂P⌉ rounds),
    2k(P−1) words (exact).

    Parameters
    ----------
    P : int
        Ranks, ≥ 1.
    n : int
        Gradient length, ≥ 1.
    k : int
        Entries each rank selects, in [1, n].

    Returns
    -------
    Cost
        Per rank and step (words, rounds; :meth:`Cost.seconds` for seconds); all zero at P = 1.

    Raises
    ------
    TypeError
        If P, n or k is not a Python int (bool included), naming it.
    ValueError
        If P < 1, n < 1 or k is not in [1, n], naming it.

    Notes
    -----
    Renggli et al., SparCML, arXiv 1802.08021, Sec. 5 (the all-gather baseline), and Li &
    Hoefler, arXiv 2201.07598, Table 1 (TopkA: log P·α + 2k(P−1)·β). Equal counts on every
    rank let one fixed-size all-gather replace an allgatherv.
    """
    _check(P, n, k)
    if P == 1:
        return _ZERO
    return _cost(1, 2 * k * (P - 1), rounds=collective_rounds("allgather", P))


def gaussiank(P: int, n: int, k: int) -> Cost:
    """Gaussiank: as TopkA with a threshold-selected count ≈ k, so an allgatherv: 2 messages
    (sizes, data; 2⌈log₂P⌉ rounds) and ≈ 2k(P−1) words (expected; the count varies with the
    data).

    Parameters
    ----------
    P : int
        Ranks, ≥ 1.
    n : int
        Gradient length, ≥ 1.
    k : int
        Entries each rank selects, in [1, n].

    Returns
    -------
    Cost
        Per rank and step (words, rounds; :meth:`Cost.seconds` for seconds); all zero at P = 1.

    Raises
    ------
    TypeError
        If P, n or k is not a Python int (bool included), naming it.
    ValueError
        If P < 1, n < 1 or k is not in [1, n], naming it.

    Notes
    -----
    Shi et al., "Understanding Top-k Sparsification in Distributed Deep Learning",
    arXiv 1911.08772 (the Gaussian threshold); Li & Hoefler, arXiv 2201.07598, Table 1.
    """
    _check(P, n, k)
    if P == 1:
        return _ZERO
    # + the size word of every other rank
    return _cost(2, 2 * k * (P - 1) + (P - 1), rounds=2 * collective_rounds("allgatherv", P))


def topkdsa(P: int, n: int, k: int) -> Cost:
    """SparCML's dynamic sparse allreduce: split-reduce to P uniform regions (P−1 messages), then
    an allgatherv of the reduced regions (2 messages), a region going dense past break-even.
    Rounds: P−1 + 2⌈log₂P⌉.

    Words, assuming each rank's k entries spread evenly over the regions and do not overlap
    (the fill-in worst case): 2k(P−1)/P for the split, and (P−1)·min(2k, ⌈n/P⌉) for the
    all-gather (each region holds at most k distinct pairs, or ⌈n/P⌉ dense values). An upper
    bound in expectation; overlapping indices send less.

    Parameters
    ----------
    P : int
        Ranks, ≥ 1.
    n : int
        Gradient length, ≥ 1.
    k : int
        Entries each rank selects, in [1, n].

    Returns
    -------
    Cost
        Per rank and step (words, rounds; :meth:`Cost.seconds` for seconds); all zero at P = 1.

    Raises
    ------
    TypeError
        If P, n or k is not a Python int (bool included), naming it.
    ValueError
        If P < 1, n < 1 or k is not in [1, n], naming it.

    Notes
    -----
    Renggli et al., SparCML, arXiv 1802.08021, Sec. 5 (DSAR_Split_AllGather) and its cost
    analysis; Li & Hoefler, arXiv 2201.07598, Table 1 (TopkDSA).
    """
    _check(P, n, k)
    if P == 1:
        return _ZERO
    region = -(-n // P)
    return _cost(
        P + 1,
        2 * k * (P - 1) / P + (P - 1) * min(2 * k, region),
        rounds=P - 1 + 2 * collective_rounds("allgatherv", P),
    )


def gtopk(P: int, n: int, k: int) -> Cost:
    """gTop-k: ⌈log₂P⌉ rounds of pairwise merges up a binomial tree, then a broadcast of k pairs.

    Per rank: at most one send of k pairs in the tree plus the broadcast (2 messages,
    2k + 2k(P−1)/P words). Critical path: ⌈log₂P⌉ tree rounds of 2k words, then the broadcast
    (⌈log₂P⌉ rounds, 2k(P−1)/P words): 2⌈log₂P⌉ rounds.

    Parameters
    ----------
    P : int
        Ranks, ≥ 1.
    n : int
        Gradient length, ≥ 1.
    k : int
        Entries each rank selects, in [1, n].

    Returns
    -------
    Cost
        Per rank and step (words, rounds; :meth:`Cost.seconds` for seconds); all zero at P = 1.

    Raises
    ------
    TypeError
        If P, n or k is not a Python int (bool included), naming it.
    ValueError
        If P < 1, n < 1 or k is not in [1, n], naming it.

    Notes
    -----
    Shi et al., arXiv 1901.04359, Sec. III (Algorithm 2) and its cost (2 log P·α + 4k log P·β
    with a tree broadcast); a broadcast is one collective here.
    """
    _check(P, n, k)
    if P == 1:
        return _ZERO
    R = ceil_log2(P)
    return _cost(
        2,
        2 * k + 2 * k * (P - 1) / P,
        rounds=R + collective_rounds("bcast", P),
        path_words=2 * k * R + 2 * k * (P - 1) / P,
    )


def spardl(
    P: int, n: int, k: int, d: int = 1, density: float | None = None, sag_budget: str = "start"
) -> Cost:
    """SparDL with d teams of m = P/d ranks.

    k_b = min(C, max(1, ⌊ρ·C⌋)) with C = ⌈n/m⌉ is the per-block budget (ρ = k/n when
    ``density`` is not given), h = max(1, ⌊ρC/d⌋) the owners' budget before SAG (its start
    value, clamped to [max(1, ⌊k_b/d⌋), k_b]; it adapts between steps).

    * SRS inside a team: R = ⌈log₂m⌉ messages; every rank sends each of the m−1 blocks it does
      not own once, k_b pairs each: 2k_b(m−1) words.
    * SAG across teams (d > 1): a Bruck all-gather of h pairs, ⌈log₂d⌉ messages, 2h(d−1) words.
    * SAG inside the team: a Bruck all-gather of k_b pairs, ⌈log₂m⌉ messages, 2k_b(m−1) words.

    d = 1: 2⌈log₂P⌉ messages and 4k_b(P−1) ≈ 4k(P−1)/P words; exact (block lengths all ≥ k_b).

    ``sag_budget`` picks h for d > 1. "start": h's first value (exact at the first step, and
    in steady state when the d owners' selections are disjoint: the least volume). "max":
    h = k_b, the value h adapts to when the d owners select the same indices (their union
    never fills k_b): 2k_b(d−1) words across teams, the most. Projections that choose d
    (``spardl model``) use "max" so that teams are never credited with a volume the
    adaptation may not keep.

    Parameters
    ----------
    P : int
        Ranks, ≥ 1.
    n : int
        Gradient length, ≥ 1.
    k : int
        Entries selected, in [1, n]; sets ρ = k/n when ``density`` is not given.
    d : int, default 1
        Teams, ≥ 1, dividing P.
    density : float, optional
        ρ in (0, 1] (the allreducer's, which k = ⌊ρn⌋ may round).
    sag_budget : {"start", "max"}, default "start"
        h for d > 1, as above.

    Returns
    -------
    Cost
        Per rank and step (words, rounds; :meth:`Cost.seconds` for seconds); all zero at P = 1.

    Raises
    ------
    TypeError
        If P, n, k or d is not a Python int (bool included), ``density`` not a real number or
        ``sag_budget`` not a string, naming it.
    ValueError
        If P < 1, n < 1, k is not in [1, n], d < 1 or does not divide P, ``density`` is not in
        (0, 1] or ``sag_budget`` is another string, naming it.

    Notes
    -----
    Zhao et al., "SparDL", arXiv 2304.00737, Sec. 4 (SRS, SAG; cost analysis of Sec. 4.2-4.3)
    and docs/design.md §4 (one packed message per round).
    """
    _check(P, n, k, d=(d, 1))
    if P % d:
        raise ValueError(f"d must divide P={P}, got {d}")
    if density is not None:
        density = check_density("density", density)
    check_choice("sag_budget", sag_budget, ("start", "max"))
    if P == 1:
        return _ZERO
    rho = k / n if density is None else density
    m = P // d
    C = -(-n // m)
    k_b = budget(rho, C)
    # The owners' start budget, clamped as the implementation does; the whole block when ρ·C
    # covers it (nothing to drop).
    h = max(min(k_b, max(1, k_b // d)), min(k_b, max(1, density_floor(rho, C, d))))
    if k_b == C or sag_budget == "max":
        h = k_b
    msgs = 2 * ceil_log2(m) + ceil_log2(d)
    words = 4 * k_b * (m - 1) + 2 * h * (d - 1)
    return _cost(msgs, words)


def oktopk(
    P: int,
    n: int,
    k: int,
    threshold_interval: int = 32,
    region_interval: int = 64,
    step: int | None = None,
) -> Cost:
    """Ok-Topk (``spardl.algorithms.oktopk``).

    Every step: split and reduce (P−1 messages), a count all-gather and P−1 balancing messages,
    one all-gather of the balanced chunks: 2P messages; plus one allreduce of the P+1 region
    boundaries every τ (``region_interval``) steps and one all-gather of k magnitudes every τ'
    (``threshold_interval``) steps. With ``step`` the cost of that step (exact messages), else
    the average over steps (2P + 1/τ + 1/τ'). Rounds: 2(P−1) + 2⌈log₂P⌉, + 2⌈log₂P⌉/τ and
    + ⌈log₂P⌉/τ' (the collectives at their algorithmic cost).

    Words: the paper's bound 6k(P−1)/P (split 2k(P−1)/P with balanced regions, balance at most
    2k(P−1)/P, all-gather 2k(P−1)/P, for about k surviving entries), plus P−1 count words,
    (P+1)·2(P−1)/P boundary words every τ steps and k(P−1) magnitude words every τ' steps.

    Parameters
    ----------
    P : int
        Ranks, ≥ 1.
    n : int
        Gradient length, ≥ 1.
    k : int
        Entries each rank selects, in [1, n].
    threshold_interval : int, default 32
        τ', steps between threshold re-evaluations, ≥ 1.
    region_interval : int, default 64
        τ, steps between region-boundary re-evaluations, ≥ 1.
    step : int, optional
        A step number, ≥ 0: the cost of that step instead of the average.

    Returns
    -------
    Cost
        Per rank and step (words, rounds; :meth:`Cost.seconds` for seconds); all zero at P = 1.

    Raises
    ------
    TypeError
        If P, n, k, an interval or ``step`` (unless None) is not a Python int (bool included),
        naming it.
    ValueError
        If P < 1, n < 1, k is not in [1, n], an interval < 1 or ``step`` < 0, naming it.

    Notes
    -----
    Li & Hoefler, arXiv 2201.07598, Sec. 3.1, Eq. 1-3: ≤ (2P + 2 log P)α + 6k(P−1)/P·β; the
    collectives count one message each here, so the messages stay within 2P + 2.
    """
    options = {
        "threshold_interval": (threshold_interval, 1),
        "region_interval": (region_interval, 1),
    }
    if step is not None:
        options["step"] = (step, 0)
    _check(P, n, k, **options)
    if P == 1:
        return _ZERO
    if step is None:
        regions, thresholds = 1 / region_interval, 1 / threshold_interval
    else:
        regions = float(step % region_interval == 0)
        thresholds = float(step % threshold_interval == 0)
    msgs = 2 * P + regions + thresholds
    R = ceil_log2(P)
    rounds = 2 * (P - 1) + 2 * R + regions * 2 * R + thresholds * R
    words = (
        6 * k * (P - 1) / P
        + (P - 1)
        + regions * 2 * (P + 1) * (P - 1) / P
        + thresholds * k * (P - 1)
    )
    return _cost(msgs, words, rounds=rounds)


def compact_pair_bytes(density: float, value_bytes: float = 4.0) -> float:
    """Expected bytes of one (index, value) pair in the compact wire format.

    Parameters
    ----------
    density : float
        ρ in (0, 1]: the fraction of a block's coordinates the message holds, taken as spread
        uniformly at random, so that the gaps between indices are geometric:
        P(gap ≥ t) = (1 − ρ)^t.
    value_bytes : float, default 4.0
        Bytes of an unrounded value (4: float32; 8: float64): what a value costs at ρ = 1,
        where an allreducer sends values unrounded (its output must be the exact mean).

    Returns
    -------
    float
        Below ρ = 1, 2 (a 16-bit value) plus the cheapest index coding's expected bytes: a
        ladder gap starting at 1, 2 or 4 bytes (w bytes, and the next width again past each
        escape 2^(8w) − 1), or a bitmap (1/(8ρ) bytes per pair). At ρ = 1, ``value_bytes``
        alone (a full block has no index bytes). Block headers (a few bytes per block) are left
        out, as everywhere in this model.

    Notes
    -----
    About 3.15 at ρ = 0.01, 3.9 at ρ = 0.003, 4.0 at ρ = 0.001, against 8 for "coo" (int32 and
    float32). See spardl_kernels/cpu/wire.py for the format.

    Raises
    ------
    ValueError, TypeError
        If ``density`` is not in (0, 1], or ``value_bytes`` is not a finite number > 0.
    """
    budget(density, 1)  # the range check
    _check_positive("value_bytes", value_bytes)
    rho = float(density)
    if rho >= 1.0:
        return float(value_bytes)

    def tail(t):  # P(gap >= t)
        return math.exp(t * math.log1p(-rho))

    e1, e2, e4 = tail(0xFF), tail(0xFFFF), tail(0xFFFFFFFF)
    ladders = (1 + 2 * e1 + 4 * e2 + 8 * e4, 2 + 4 * e2 + 8 * e4, 4 + 8 * e4)
    return 2.0 + min(*ladders, 1.0 / (8.0 * rho))


def _compact_messages(algorithm: str, P: int, c: Cost) -> Cost:
    """The cost of ``algorithm`` with compact buffers: a size message where "coo" sends one
    fixed-size collective (topka's and oktopk's all-gather, gtopk's broadcast); P − 1 size
    words each (8 bytes: 2 words)."""
    kind = {"topka": "allgather", "oktopk": "allgather", "gtopk": "bcast"}.get(algorithm)
    if kind is None or P == 1:
        return c
    size_words = 2 * (P - 1) if kind == "allgather" else 2 * (P - 1) / P
    return Cost(
        c.messages + 1,
        c.words + size_words,
        c.rounds + collective_rounds(kind, P),
        c.path_words + size_words,
    )


#: Algorithm name -> formula (P, n, k, **options) -> Cost.
FORMULAS = {
    "dense": dense,
    "topka": topka,
    "gaussiank": gaussiank,
    "topkdsa": topkdsa,
    "gtopk": gtopk,
    "spardl": spardl,
    "oktopk": oktopk,
}

#: Interconnect presets: α in seconds per message, β in seconds per byte.
NETWORKS = {
    # 10 Gb/s Ethernet: β = 8 bits / 10e9 bit/s = 0.8 ns/byte (line rate); α ≈ 25 µs, the order
    # of MPI-over-TCP small-message latency on commodity 10 GbE (OSU osu_latency reports).
    "ethernet-10g": {"alpha": 25e-6, "beta": 8 / 10e9},
    # 100 Gb/s InfiniBand EDR: β = 8 / 100e9 = 0.08 ns/byte (line rate); α ≈ 1.5 µs, the MPI
    # small-message latency of EDR HCAs (Mellanox ConnectX-5 product brief; OSU benchmarks).
    "infiniband-100g": {"alpha": 1.5e-6, "beta": 8 / 100e9},
    # NVLink 3 (A100): 300 GB/s per GPU and direction (NVIDIA A100 datasheet), β = 1/300e9;
    # α ≈ 5 µs, the order of NCCL's per-call latency between GPUs of one node.
    "nvlink": {"alpha": 5e-6, "beta": 1 / 300e9},
}


def predict(
    algorithm: str,
    P: int,
    n: int,
    density: float,
    teams: int = 1,
    alpha: float = NETWORKS["infiniband-100g"]["alpha"],
    beta: float = NETWORKS["infiniband-100g"]["beta"],
    word_bytes: int = 4,
    gamma: float = 0.0,
    wire: str = "coo",
    value_bytes: float = 4.0,
    **options,
) -> dict:
    """The α-β(-γ) cost of one step of ``algorithm`` on P ranks, from its closed form.

    Parameters
    ----------
    algorithm : str
        A key of :data:`FORMULAS`.
    P : int
        World size, ≥ 1.
    n : int
        Gradient length, ≥ 1.
    density : float
        ρ in (0, 1]; k = max(1, ⌊ρn⌋).
    teams : int, default 1
        d, SparDL's number of teams, ≥ 1 (must divide P for SparDL); ignored by the others.
    alpha : float, default 100 Gb/s InfiniBand
        Seconds per message (per round).
    beta : float, default 100 Gb/s InfiniBand
        Seconds per byte.
    word_bytes : float, default 4
        Bytes per word (4: int32 indices and float32 values) with ``wire="coo"``; finite, > 0.
    gamma : float, default 0.0
        Seconds per byte merged on arrival (see the module docstring).
    wire : {"coo", "compact"}, default "coo"
        The allreducer's wire format. "compact" prices a word at
        :func:`compact_pair_bytes` (density)/2 bytes instead of ``word_bytes`` and adds the
        size messages of variable-size buffers (module docstring). An estimate: the index
        bytes depend on how the selected coordinates spread.
    value_bytes : float, default 4.0
        With ``wire="compact"`` at density 1, the bytes of a value, sent unrounded (4: float32,
        8: float64); finite, > 0.
    **options
        Passed to the formula (``threshold_interval``, ``region_interval``, ``step`` for
        Ok-Topk).

    Returns
    -------
    dict
        ``messages``, ``words``, ``bytes`` (words·word_bytes): what one rank sends, counted as
        ``stats`` counts; ``rounds`` (latency terms) and ``seconds``
        (rounds·α + path_words·word_bytes·(β + γ)): the time.

    Raises
    ------
    TypeError
        If ``algorithm`` or ``wire`` is not a string, P, n or ``teams`` not a Python int, a
        rate or ``word_bytes`` not a real number (bools are none of these), or an option is
        unknown or of the wrong type: naming the argument.
    ValueError
        If ``algorithm`` or ``wire`` is unknown, P, n or ``teams`` < 1, ``teams`` does not
        divide P for SparDL, ``density`` is not in (0, 1], a rate is negative or not finite,
        ``word_bytes`` or ``value_bytes`` is not finite and > 0, or an option is out of range:
        naming the argument.
    """
    check_choice("algorithm", algorithm, tuple(sorted(FORMULAS)))
    f = FORMULAS[algorithm]
    check_choice("wire", wire, ("coo", "compact"))
    _check_rates(alpha, beta, gamma)
    _check_positive("word_bytes", word_bytes)
    _check_positive("value_bytes", value_bytes)
    _check_count("P", P, 1)
    _check_count("teams", teams, 1)
    if algorithm == "spardl" and P % teams:
        raise ValueError(f"teams must divide P={P}, got {teams}")
    k = budget(density, n)
    if algorithm == "spardl":
        c = f(P, n, k, d=teams, density=density, **options)
    else:
        c = f(P, n, k, **options)
    if wire == "compact" and algorithm != "dense":
        c = _compact_messages(algorithm, P, c)
        word_bytes = compact_pair_bytes(density, value_bytes) / 2
    return {
        "messages": c.messages,
        "words": c.words,
        "bytes": c.words * word_bytes,
        "rounds": c.rounds,
        "seconds": c.seconds(alpha, beta, word_bytes, gamma),
    }


def _check_rates(alpha, beta, gamma) -> None:
    """α, β and γ: real numbers (Python ones, not bools), finite and ≥ 0."""
    for name, v in (("alpha", alpha), ("beta", beta), ("gamma", gamma)):
        check_float(name, v, numpy=False)
        if not 0 <= v < math.inf:
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


def _check_positive(name: str, value) -> None:
    """A size in bytes: a real number (a Python one, not a bool), finite and > 0."""
    check_float(name, value, numpy=False)
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


_FIELDS = ("step", "phase", "kind", "peer", "bytes")


def _record(rec, where: str):
    """(step, phase, kind, peer, bytes) from a tuple, list or dict trace record; ``where``
    (``traces[r]``) names its trace in the TypeError or ValueError of a malformed record."""
    if isinstance(rec, dict):
        missing = [f for f in _FIELDS if f not in rec]
        if missing:
            raise ValueError(f"{where}: a trace record lacks {missing}: {rec!r}")
        step, phase, kind, peer, nbytes = (rec[f] for f in _FIELDS)
    elif isinstance(rec, (tuple, list)) and len(rec) == len(_FIELDS):
        step, phase, kind, peer, nbytes = rec
    else:
        raise ValueError(
            f"{where}: a trace record is (step, phase, kind, peer, bytes), got {rec!r}"
        )
    for name, v in (("step", step), ("peer", peer), ("bytes", nbytes)):
        check_int(f"{where}: trace record {name}", v)  # NumPy ints too: records read back
    if not isinstance(phase, str):
        raise TypeError(f"{where}: trace record phase must be a string, got {type_name(phase)}")
    if kind not in _KINDS:
        raise ValueError(f"{where}: trace record kind must be one of {_KINDS}, got {kind!r}")
    if step < 0:
        raise ValueError(f"{where}: trace record step must be >= 0, got {step}")
    if nbytes < 0:
        raise ValueError(f"{where}: trace record bytes must be >= 0, got {nbytes}")
    for name, v in (("step", step), ("peer", peer), ("bytes", nbytes)):
        if not -(2**63) <= v < 2**63:  # what the accounting counts in; float math past it
            raise ValueError(f"{where}: trace record {name} must fit in int64, got {v}")
    return int(step), phase, kind, int(peer), int(nbytes)


def _check_traces(traces) -> int:
    """The number of ranks of ``traces``: a non-empty sequence of per-rank sequences."""
    if isinstance(traces, (str, bytes, dict)) or not hasattr(traces, "__len__"):
        raise TypeError(f"traces must be a list of per-rank traces, got {type_name(traces)}")
    if len(traces) == 0:
        raise ValueError("traces must hold at least one rank's trace, got none")
    for r, trace in enumerate(traces):
        if isinstance(trace, (str, bytes, dict)) or not hasattr(trace, "__iter__"):
            raise TypeError(
                f"traces[{r}] must be a sequence of trace records, got {type_name(trace)}"
            )
    return len(traces)


def replay_steps(
    traces, alpha: float, beta: float, gamma: float = 0.0, P: int | None = None
) -> list[dict]:
    """Price every step of recorded per-rank traces under the α-β(-γ) model.

    A rank's time in a step is the sum over the messages it sent of
    ``collective_rounds(kind, P)·α + bytes·(β + γ)``: a point-to-point message costs α plus its
    size, a collective its algorithmic latency plus the volume :mod:`spardl.comm` accounted for
    it (which is that of the bandwidth-optimal algorithm). The step's time is the slowest rank's.

    Parameters
    ----------
    traces : sequence of P sequences of records
        ``traces[r]`` is rank r's trace: records (step, phase, kind, peer, bytes), as tuples,
        lists or dicts (:mod:`spardl.trace` gathers and saves them).
    alpha, beta, gamma : float
        Seconds per message, per byte sent, per byte merged (γ ≥ 0, default 0).
    P : int, optional
        Ranks in the collectives (default ``len(traces)``). Byte volumes stay as recorded.

    Returns
    -------
    list of dict
        One per step, ascending: ``step``, ``seconds`` (the slowest rank's), ``rank`` (which
        one), ``messages`` (per rank, a list; equals the ``stats["messages"]`` increments),
        ``bytes`` (per rank, a list), ``rounds`` (per rank, a list) and ``phases`` (the slowest
        rank's seconds per phase).

    Raises
    ------
    TypeError
        If ``traces`` or a rank's trace is not a sequence, a record's step, peer or bytes is
        not an integer or its phase not a string, a rate is not a real number or ``P`` (unless
        None) not a Python int (bools are none of these), naming it.
    ValueError
        If ``traces`` is empty, a record is malformed (not 5 fields, a missing key, an unknown
        kind, a negative step or bytes), a rate is negative or not finite, or ``P`` < 1,
        naming it.

    Notes
    -----
    The sum over a rank's own sends is exact for algorithms whose ranks all send in every round
    (SparDL, Ok-Topk, TopkA, Gaussiank, TopkDSA, dense). For gtopk's one-way tree it is a lower
    bound: the root receives ⌈log₂P⌉ messages in sequence while each rank sends one; the closed
    form :func:`gtopk` prices that critical path.
    """
    _check_rates(alpha, beta, gamma)
    ranks = _check_traces(traces)
    P = ranks if P is None else _check_count("P", P, 1)
    per = {}  # step -> rank -> [seconds, messages, bytes, rounds, {phase: seconds}]
    for r, trace in enumerate(traces):
        for rec in trace:
            step, phase, kind, _peer, nbytes = _record(rec, f"traces[{r}]")
            rounds = collective_rounds(kind, P)
            t = rounds * alpha + nbytes * (beta + gamma)
            row = per.setdefault(step, {}).setdefault(r, [0.0, 0, 0, 0, {}])
            row[0] += t
            row[1] += 1
            row[2] += nbytes
            row[3] += rounds
            row[4][phase] = row[4].get(phase, 0.0) + t
    out = []
    for step in sorted(per):
        rows = per[step]
        secs = [rows[r][0] if r in rows else 0.0 for r in range(ranks)]
        slow = max(range(ranks), key=lambda r: secs[r])
        out.append(
            {
                "step": step,
                "seconds": secs[slow],
                "rank": slow,
                "messages": [rows[r][1] if r in rows else 0 for r in range(ranks)],
                "bytes": [rows[r][2] if r in rows else 0 for r in range(ranks)],
                "rounds": [rows[r][3] if r in rows else 0 for r in range(ranks)],
                "phases": dict(rows[slow][4]) if slow in rows else {},
            }
        )
    return out


def replay(traces, alpha: float, beta: float, gamma: float = 0.0, P: int | None = None) -> float:
    """Mean predicted seconds per step of recorded traces (see :func:`replay_steps`).

    Parameters
    ----------
    traces, alpha, beta, gamma, P
        As :func:`replay_steps`.

    Returns
    -------
    float
        Seconds per step, the mean of :func:`replay_steps`' ``seconds``; 0.0 for traces
        without messages (P = 1).

    Raises
    ------
    TypeError, ValueError
        As :func:`replay_steps`, naming the argument.
    """
    steps = replay_steps(traces, alpha, beta, gamma, P)
    return sum(s["seconds"] for s in steps) / len(steps) if steps else 0.0
