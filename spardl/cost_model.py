"""Closed-form α-β costs of every allreduce in :data:`spardl.ALGORITHMS`.

Units: α is seconds per message, β seconds per byte; a *word* is one index or one value, so an
(index, value) pair is 2 words, and ``word_bytes`` (4 for int32 wire indices and float32 values)
turns words into bytes. Every formula is per rank and per step and follows the counting rules of
:mod:`spardl.comm`:

* ``messages``: data messages one rank sends; a point-to-point send counts 1 and so does a
  collective call (whatever the MPI library does inside it);
* ``words``: the volume one rank sends; an all-gather sends everything but the rank's own part
  to the others ((P−1)·part), an allreduce of m words sends 2m(P−1)/P, a broadcast m(P−1)/P;
* ``rounds`` / ``path_words``: the α terms and the words on the critical path, which set the time.
  They equal ``messages`` / ``words`` for every algorithm whose ranks all send in every round;
  only the tree of ``gtopk`` differs (a rank sends once, the root waits ⌈log₂P⌉ rounds).

Time = rounds·α + path_words·word_bytes·β. Headers (block counts, padding) are left out: they are
a few bytes per message. With P = 1 nothing is sent and every cost is zero.

The ``NETWORKS`` presets give order-of-magnitude α and β of common interconnects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    "predict",
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
        Messages on the critical path (α terms of the time).
    path_words : float
        Words on the critical path (β terms of the time, times ``word_bytes``).
    """

    messages: float
    words: float
    rounds: float
    path_words: float

    def seconds(self, alpha: float, beta: float, word_bytes: int = 4) -> float:
        """rounds·α + path_words·word_bytes·β, in seconds (α: s/message, β: s/byte)."""
        return self.rounds * alpha + self.path_words * word_bytes * beta


def _cost(messages, words, rounds=None, path_words=None) -> Cost:
    return Cost(float(messages), float(words),
                float(messages if rounds is None else rounds),
                float(words if path_words is None else path_words))


_ZERO = Cost(0.0, 0.0, 0.0, 0.0)


def _check(P, n, k):
    for name, v in (("P", P), ("n", n), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if P < 1:
        raise ValueError(f"P must be >= 1, got {P}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")


def ceil_log2(P: int) -> int:
    """⌈log₂P⌉ (0 for P = 1): rounds of a binomial tree, a Bruck all-gather or SRS."""
    return (int(P) - 1).bit_length()


def budget(density: float, n: int) -> int:
    """k = ⌊ρ·n⌋, at least 1 and at most n (the rule of :func:`spardl.algorithms.base.budget`)."""
    if isinstance(density, bool) or not isinstance(density, (int, float)):
        raise TypeError(f"density must be a float, got {type(density).__name__}")
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    return int(min(n, max(1, math.floor(density * n * (1 + 1e-9)))))


# -- the algorithms ------------------------------------------------------------------------------
def dense(P: int, n: int, k: int | None = None) -> Cost:
    """Dense allreduce of n values: one collective, 2n(P−1)/P words (exact).

    Notes
    -----
    Rabenseifner's reduce-scatter + all-gather (Thakur, Rabenseifner & Gropp, "Optimization of
    Collective Communication Operations in MPICH", IJHPCA 2005, Sec. 4.4):
    2·log₂P·α + 2n(P−1)/P·β; one collective call here.
    """
    _check(P, n, n if k is None else k)
    if P == 1:
        return _ZERO
    return _cost(1, 2 * n * (P - 1) / P)


def topka(P: int, n: int, k: int) -> Cost:
    """TopkA: all-gather of every rank's k (index, value) pairs: 1 message, 2k(P−1) words (exact).

    Notes
    -----
    Renggli et al., SparCML, arXiv 1802.08021, Sec. 5 (the all-gather baseline), and Li &
    Hoefler, arXiv 2201.07598, Table 1 (TopkA: log P·α + 2k(P−1)·β). Equal counts on every
    rank let one fixed-size all-gather replace an allgatherv.
    """
    _check(P, n, k)
    if P == 1:
        return _ZERO
    return _cost(1, 2 * k * (P - 1))


def gaussiank(P: int, n: int, k: int) -> Cost:
    """Gaussiank: as TopkA with a threshold-selected count ≈ k, so an allgatherv: 2 messages
    (sizes, data) and ≈ 2k(P−1) words (expected; the count varies with the data).

    Notes
    -----
    Shi et al., "Understanding Top-k Sparsification in Distributed Deep Learning",
    arXiv 1911.08772 (the Gaussian threshold); Li & Hoefler, arXiv 2201.07598, Table 1.
    """
    _check(P, n, k)
    if P == 1:
        return _ZERO
    return _cost(2, 2 * k * (P - 1) + (P - 1))  # + the size word of every other rank


def topkdsa(P: int, n: int, k: int) -> Cost:
    """SparCML's dynamic sparse allreduce: split-reduce to P uniform regions (P−1 messages), then
    an allgatherv of the reduced regions (2 messages), a region going dense past break-even.

    Words, assuming each rank's k entries spread evenly over the regions and do not overlap
    (the fill-in worst case): 2k(P−1)/P for the split, and (P−1)·min(2k, ⌈n/P⌉) for the
    all-gather (each region holds at most k distinct pairs, or ⌈n/P⌉ dense values). An upper
    bound in expectation; overlapping indices send less.

    Notes
    -----
    Renggli et al., SparCML, arXiv 1802.08021, Sec. 5 (DSAR_Split_AllGather) and its cost
    analysis; Li & Hoefler, arXiv 2201.07598, Table 1 (TopkDSA).
    """
    _check(P, n, k)
    if P == 1:
        return _ZERO
    region = -(-n // P)
    return _cost(P + 1, 2 * k * (P - 1) / P + (P - 1) * min(2 * k, region))


def gtopk(P: int, n: int, k: int) -> Cost:
    """gTop-k: ⌈log₂P⌉ rounds of pairwise merges up a binomial tree, then a broadcast of k pairs.

    Per rank: at most one send of k pairs in the tree plus the broadcast (2 messages,
    2k + 2k(P−1)/P words). Critical path: ⌈log₂P⌉ tree rounds + the broadcast, 2k words each.

    Notes
    -----
    Shi et al., arXiv 1901.04359, Sec. III (Algorithm 2) and its cost (2 log P·α + 4k log P·β
    with a tree broadcast); a broadcast is one collective here.
    """
    _check(P, n, k)
    if P == 1:
        return _ZERO
    R = ceil_log2(P)
    return _cost(2, 2 * k + 2 * k * (P - 1) / P, rounds=R + 1,
                 path_words=2 * k * R + 2 * k * (P - 1) / P)


def spardl(P: int, n: int, k: int, d: int = 1, density: float | None = None) -> Cost:
    """SparDL with d teams of m = P/d ranks.

    k_b = min(C, max(1, ⌊ρ·C⌋)) with C = ⌈n/m⌉ is the per-block budget (ρ = k/n when
    ``density`` is not given), h = max(1, ⌊ρC/d⌋) the owners' budget before SAG (its start
    value, clamped to [max(1, ⌊k_b/d⌋), k_b]; it adapts between steps).

    * SRS inside a team: R = ⌈log₂m⌉ messages; every rank sends each of the m−1 blocks it does
      not own once, k_b pairs each: 2k_b(m−1) words.
    * SAG across teams (d > 1): a Bruck all-gather of h pairs, ⌈log₂d⌉ messages, 2h(d−1) words.
    * SAG inside the team: a Bruck all-gather of k_b pairs, ⌈log₂m⌉ messages, 2k_b(m−1) words.

    d = 1: 2⌈log₂P⌉ messages and 4k_b(P−1) ≈ 4k(P−1)/P words; exact (block lengths all ≥ k_b).

    Notes
    -----
    Zhao et al., "SparDL", arXiv 2304.00737, Sec. 4 (SRS, SAG; cost analysis of Sec. 4.2-4.3)
    and DESIGN.md §4 (one packed message per round).
    """
    _check(P, n, k)
    if isinstance(d, bool) or not isinstance(d, int) or d < 1 or P % d:
        raise ValueError(f"d must be a positive divisor of P={P}, got {d}")
    if P == 1:
        return _ZERO
    rho = k / n if density is None else float(density)
    m = P // d
    C = -(-n // m)
    k_b = budget(rho, C)
    # The owners' start budget, clamped as the implementation does; the whole block when ρ·C
    # covers it (nothing to drop).
    h = max(min(k_b, max(1, k_b // d)), min(k_b, max(1, math.floor(rho * C / d * (1 + 1e-9)))))
    if k_b == C:
        h = k_b
    msgs = 2 * ceil_log2(m) + ceil_log2(d)
    words = 4 * k_b * (m - 1) + 2 * h * (d - 1)
    return _cost(msgs, words)


def oktopk(P: int, n: int, k: int, threshold_interval: int = 32, region_interval: int = 64,
           step: int | None = None) -> Cost:
    """Ok-Topk (``spardl.algorithms.oktopk``).

    Every step: split and reduce (P−1 messages), a count all-gather and P−1 balancing messages,
    one all-gather of the balanced chunks: 2P messages; plus one allreduce of the P+1 region
    boundaries every τ (``region_interval``) steps and one all-gather of k magnitudes every τ'
    (``threshold_interval``) steps. With ``step`` the cost of that step (exact messages), else
    the average over steps (2P + 1/τ + 1/τ').

    Words: the paper's bound 6k(P−1)/P (split 2k(P−1)/P with balanced regions, balance at most
    2k(P−1)/P, all-gather 2k(P−1)/P, for about k surviving entries), plus P−1 count words,
    (P+1)·2(P−1)/P boundary words every τ steps and k(P−1) magnitude words every τ' steps.

    Notes
    -----
    Li & Hoefler, arXiv 2201.07598, Sec. 3.1, Eq. 1-3: ≤ (2P + 2 log P)α + 6k(P−1)/P·β; the
    collectives count one message each here, so the messages stay within 2P + 2.
    """
    _check(P, n, k)
    if P == 1:
        return _ZERO
    if step is None:
        regions, thresholds = 1 / region_interval, 1 / threshold_interval
    else:
        regions = float(step % region_interval == 0)
        thresholds = float(step % threshold_interval == 0)
    msgs = 2 * P + regions + thresholds
    words = (6 * k * (P - 1) / P + (P - 1) + regions * 2 * (P + 1) * (P - 1) / P
             + thresholds * k * (P - 1))
    return _cost(msgs, words)


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


def predict(algorithm: str, P: int, n: int, density: float, teams: int = 1,
            alpha: float = NETWORKS["infiniband-100g"]["alpha"],
            beta: float = NETWORKS["infiniband-100g"]["beta"],
            word_bytes: int = 4, **options) -> dict:
    """The α-β cost of one step of ``algorithm`` on P ranks.

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
        d, SparDL's number of teams (must divide P); ignored by the others.
    alpha : float, default 100 Gb/s InfiniBand
        Seconds per message.
    beta : float, default 100 Gb/s InfiniBand
        Seconds per byte.
    word_bytes : int, default 4
        Bytes per word (4: int32 indices and float32 values).
    **options
        Passed to the formula (``threshold_interval``, ``region_interval``, ``step`` for
        Ok-Topk).

    Returns
    -------
    dict
        ``messages``, ``words``, ``bytes`` (words·word_bytes): what one rank sends;
        ``rounds`` and ``seconds`` (rounds·α + path_words·word_bytes·β): the time.

    Raises
    ------
    ValueError, TypeError
        If the algorithm is unknown or an argument is out of range.
    """
    f = FORMULAS.get(algorithm) if isinstance(algorithm, str) else None
    if f is None:
        raise ValueError(f"algorithm must be one of {sorted(FORMULAS)}, got {algorithm!r}")
    for name, v in (("alpha", alpha), ("beta", beta)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ValueError(f"{name} must be a number >= 0, got {v!r}")
    k = budget(density, n)
    if algorithm == "spardl":
        c = f(P, n, k, d=teams, density=density, **options)
    else:
        c = f(P, n, k, **options)
    return {
        "messages": c.messages,
        "words": c.words,
        "bytes": c.words * word_bytes,
        "rounds": c.rounds,
        "seconds": c.seconds(alpha, beta, word_bytes),
    }
