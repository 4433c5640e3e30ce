"""spardl.cost_model: the closed-form α-β formulas, without MPI."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from spardl import cost_model as cm

NAMES = sorted(cm.FORMULAS)


@pytest.mark.parametrize("algorithm", NAMES)
def test_one_rank_sends_nothing(algorithm):
    p = cm.predict(algorithm, 1, 10_000, 0.01)
    assert p["messages"] == p["words"] == p["bytes"] == p["seconds"] == 0


@pytest.mark.parametrize("algorithm", NAMES)
def test_costs_grow_with_P(algorithm):
    """More ranks never cost less time, and never fewer messages (d = 1, fixed n and ρ)."""
    n, rho = 1 << 20, 0.01
    prev = None
    for P in (1, 2, 3, 4, 8, 16, 64, 256, 1024):
        p = cm.predict(algorithm, P, n, rho)
        if prev is not None:
            assert p["seconds"] >= prev["seconds"], P
            assert p["messages"] >= prev["messages"], P
            assert p["rounds"] >= prev["rounds"], P
        prev = p


def test_spardl_one_team_is_4k_and_below_oktopk_bound():
    """SparDL d = 1 sends ≈ 4k(P−1)/P words, below Ok-Topk's 6k(P−1)/P (docs/design.md §1)."""
    n, rho = 1 << 20, 0.01
    k = cm.budget(rho, n)
    for P in (2, 4, 8, 16, 32, 64):
        s = cm.spardl(P, n, k, d=1, density=rho)
        assert s.messages == 2 * math.ceil(math.log2(P))
        assert s.words == pytest.approx(4 * k * (P - 1) / P, rel=2 * P / k + 1e-9)
        o = cm.oktopk(P, n, k)
        assert s.words < 6 * k * (P - 1) / P <= o.words


def test_spardl_teams_messages():
    """d = P: ⌈log₂P⌉ messages; d = 1: 2⌈log₂P⌉; between: 2⌈log₂m⌉ + ⌈log₂d⌉."""
    n, rho, P = 1 << 20, 0.01, 16
    k = cm.budget(rho, n)
    costs = {d: cm.spardl(P, n, k, d=d, density=rho) for d in (1, 2, 4, 8, 16)}
    assert costs[16].messages == 4 and costs[1].messages == 8
    assert costs[4].messages == 2 * 2 + 2  # 2⌈log₂m⌉ + ⌈log₂d⌉ with m = 4
    for d, c in costs.items():
        m = P // d
        assert c.messages == 2 * math.ceil(math.log2(m)) + math.ceil(math.log2(d))


def test_oktopk_messages_within_the_paper_bound():
    """Every step of Ok-Topk stays within (2P + 2 log₂P) messages (Li & Hoefler, Eq. 3)."""
    n, k = 100_000, 1000
    for P in (2, 3, 4, 5, 8, 64, 1000):
        for step in (0, 1, 32, 64):
            c = cm.oktopk(P, n, k, step=step)
            assert c.messages <= 2 * P + 2 * math.log2(P)
        assert cm.oktopk(P, n, k, step=1).messages == 2 * P
        assert cm.oktopk(P, n, k, step=0).messages == 2 * P + 2
        avg = cm.oktopk(P, n, k, threshold_interval=32, region_interval=64)
        assert avg.messages == pytest.approx(2 * P + 1 / 32 + 1 / 64)


def test_known_values():
    """Hand-computed formulas at P = 4, n = 1000, k = 10."""
    assert cm.dense(4, 1000).words == 1500
    assert cm.topka(4, 1000, 10).words == 60
    assert cm.topkdsa(4, 1000, 10).words == pytest.approx(15 + 3 * 20)
    g = cm.gtopk(4, 1000, 10)
    assert (g.messages, g.rounds) == (2, 2 + 2)  # 2 tree rounds + a 2-round broadcast
    assert g.path_words == pytest.approx(2 * 10 * 2 + 15)


def test_sparse_beats_dense_at_low_density_on_slow_networks():
    net = cm.NETWORKS["ethernet-10g"]
    n, P = 25_000_000, 16
    dense = cm.predict("dense", P, n, 0.01, **net)["seconds"]
    for name in ("spardl", "oktopk", "topkdsa", "gtopk"):
        assert cm.predict(name, P, n, 0.01, **net)["seconds"] < dense, name


def test_seconds_is_rounds_alpha_plus_bytes_beta():
    p = cm.predict("topka", 8, 4000, 0.01, alpha=2.0, beta=0.5, word_bytes=4)
    assert p["seconds"] == pytest.approx(p["rounds"] * 2.0 + p["bytes"] * 0.5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"algorithm": "nope"}, "algorithm"),
        ({"density": 0.0}, "density"),
        ({"P": 0}, "P"),
        ({"n": 0}, "n"),
        ({"algorithm": "spardl", "teams": 3}, "d"),
        ({"alpha": -1.0}, "alpha"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"algorithm": "topka", "P": 4, "n": 100, "density": 0.1, **kwargs}
    with pytest.raises(ValueError, match=match):
        cm.predict(**args)


def test_networks_have_alpha_and_beta():
    for name, net in cm.NETWORKS.items():
        assert set(net) == {"alpha", "beta"}, name
        assert 0 < net["alpha"] < 1e-3 and 0 < net["beta"] < 1e-8, name


def test_collectives_cost_their_algorithmic_latency():
    """messages count a collective once (as stats do); rounds at ⌈log₂P⌉ / 2⌈log₂P⌉."""
    n, rho = 1 << 20, 0.01
    for P in (2, 3, 8, 1000):
        R = math.ceil(math.log2(P))
        assert cm.collective_rounds("p2p", P) == 1
        assert cm.collective_rounds("allgather", P) == cm.collective_rounds("bcast", P) == R
        assert cm.collective_rounds("allreduce", P) == 2 * R
        assert cm.predict("dense", P, n, rho)["rounds"] == 2 * R
        assert cm.predict("topka", P, n, rho)["rounds"] == R
        assert cm.predict("gaussiank", P, n, rho)["rounds"] == 2 * R
        assert cm.predict("topkdsa", P, n, rho)["rounds"] == P - 1 + 2 * R
        assert cm.predict("oktopk", P, n, rho, step=1)["rounds"] == 2 * (P - 1) + 2 * R
        assert cm.predict("oktopk", P, n, rho, step=0)["rounds"] == 2 * (P - 1) + 5 * R
        assert cm.predict("spardl", P, n, rho)["rounds"] == 2 * R  # all point-to-point
        assert cm.predict("topka", P, n, rho)["messages"] == 1
    with pytest.raises(ValueError, match="kind"):
        cm.collective_rounds("gather", 4)


def test_gamma_charges_every_byte_once():
    base = cm.predict("spardl", 16, 100_000, 0.01, alpha=1e-6, beta=1e-9)
    with_g = cm.predict("spardl", 16, 100_000, 0.01, alpha=1e-6, beta=1e-9, gamma=2e-9)
    assert with_g["seconds"] - base["seconds"] == pytest.approx(base["bytes"] * 2e-9)
    with pytest.raises(ValueError, match="gamma"):
        cm.predict("spardl", 4, 100, 0.1, gamma=-1.0)


def test_sag_budget_max_bounds_start():
    n, rho, P = 1 << 20, 0.01, 64
    k = cm.budget(rho, n)
    assert cm.spardl(P, n, k, d=1, sag_budget="max") == cm.spardl(P, n, k, d=1)
    for d in (2, 8, 64):
        lo = cm.spardl(P, n, k, d=d, density=rho, sag_budget="start")
        hi = cm.spardl(P, n, k, d=d, density=rho, sag_budget="max")
        assert lo.messages == hi.messages and lo.words < hi.words
    with pytest.raises(ValueError, match="sag_budget"):
        cm.spardl(P, n, k, d=2, sag_budget="min")


def _synthetic(P, alg_records):
    return [
        [(0, "x", kind, peer, nbytes) for kind, peer, nbytes in alg_records(r)] for r in range(P)
    ]


def test_replay_of_synthetic_traces():
    alpha, beta, gamma = 2e-6, 1e-9, 5e-10
    P = 8
    # A ring step: every rank sends 1000 B to its right neighbour, rank 3 also 5000 B more.
    traces = _synthetic(
        P, lambda r: [("p2p", (r + 1) % P, 1000)] + ([("p2p", 0, 5000)] if r == 3 else [])
    )
    (step,) = cm.replay_steps(traces, alpha, beta, gamma)
    assert step["rank"] == 3 and step["messages"][3] == 2 and step["messages"][0] == 1
    assert step["seconds"] == pytest.approx(2 * alpha + 6000 * (beta + gamma))
    # One all-gather and one allreduce per rank: ⌈log₂8⌉ = 3 and 6 rounds.
    coll = _synthetic(P, lambda r: [("allgather", -1, 700), ("allreduce", -1, 300)])
    (step,) = cm.replay_steps(coll, alpha, beta)
    assert step["rounds"] == [9] * P
    assert step["seconds"] == pytest.approx(9 * alpha + 1000 * beta)
    # Projected to 1024 ranks' latency: log₂1024 = 10 rounds per all-gather.
    assert cm.replay_steps(coll, alpha, beta, P=1024)[0]["rounds"][0] == 30
    # Two steps average; dict records are accepted too.
    two = [
        [
            {"step": s, "phase": "p", "kind": "p2p", "peer": 1, "bytes": 100 * (s + 1)}
            for s in range(2)
        ],
        [],
    ]
    assert cm.replay(two, alpha, beta) == pytest.approx(alpha + 150 * beta)
    assert cm.replay([[]], alpha, beta) == 0.0  # P = 1: nothing sent
    with pytest.raises(ValueError, match="kind"):
        cm.replay([[(0, "p", "gather", -1, 10)]], alpha, beta)


def test_replay_equals_closed_form_for_a_spardl_like_trace():
    """A trace with SparDL's d = 1 schedule (2⌈log₂P⌉ point-to-point messages carrying the
    formula's words) replays to the closed form's time."""
    P, n, rho = 8, 80_000, 0.01
    c = cm.spardl(P, n, cm.budget(rho, n), d=1, density=rho)
    R = cm.ceil_log2(P)
    per_msg = round(c.words * 4 / (2 * R))  # equal-size messages, the same total bytes
    traces = _synthetic(P, lambda r: [("p2p", 0, per_msg)] * (2 * R))
    assert cm.replay(traces, 1e-5, 1e-9) == pytest.approx(c.seconds(1e-5, 1e-9), rel=1e-4)


def test_acceptance_bert_base_on_10g_ethernet():
    """n = 110 M, ρ = 1%, 10 GbE, P = 256: SparDL ≤ 0.6× Ok-Topk and ≤ 0.1× dense."""
    net = cm.NETWORKS["ethernet-10g"]
    t = {
        a: cm.predict(a, 256, 110_000_000, 0.01, **net)["seconds"]
        for a in ("spardl", "oktopk", "dense")
    }
    assert t["spardl"] <= 0.6 * t["oktopk"]
    assert t["spardl"] <= 0.1 * t["dense"]


@pytest.mark.parametrize(
    ("density", "n", "k"),
    [
        (0.01, 1000, 10),  # 0.01 is above 1/100 in binary
        (0.29, 100, 29),  # 0.29 is below 29/100: 28.999999999999998 must count as 29
        (0.07, 100, 7),
        (1 / 3, 6, 2),
        (0.473724, 869_044, 411_686),  # 411686.9998: no rounding up of a real fraction
        (0.01, 10**11, 10**9),  # large n: the tolerance is relative to ρ, not to ρ·n
        (0.5, 2 * 10**9, 10**9),
        (0.01, 10**12, 10**10),
        (1e-9, 10, 1),  # at least one
        (1.0, 5, 5),
        (2 / 3, 3, 2),  # a ratio: 0.6666666666666666·3 falls short of 2, and 2/3 is ρ itself
        (0.882037037, 5_000_027, 4_410_208),  # 4410208.999999999: no tolerance on ρ·n
        (0.999, 999_999_999_999_100, 998_999_999_999_100),
        (0.9999999999999999, 10**15, 10**15 - 1),
    ],
)
def test_budget_is_the_floor_of_rho_n_at_every_size(density, n, k):
    from spardl.algorithms.base import budget

    assert cm.budget(density, n) == budget(density, n) == k


@given(st.integers(1, 10**9), st.integers(1, 10**15))
def test_budget_of_a_decimal_density_is_its_exact_floor(billionths, n):
    """ρ written with up to nine decimals, as users write it: k = ⌊ρ·n⌋ of the decimal
    itself, for any n up to 10¹⁵ (unless that ρ is also the float of (k + 1)/n: then the
    float cannot tell the two apart, and the ratio's k + 1 is taken)."""
    k = max(1, billionths * n // 10**9)
    got = cm.budget(billionths / 10**9, n)
    assert got == k or (got == k + 1 and (k + 1) / n == billionths / 10**9)


@given(st.integers(1, 10**6), st.integers(1, 10**6))
def test_budget_of_a_ratio_is_its_numerator(m, n):
    """ρ = m/n computed in floats gives back k = m entries of n."""
    if m <= n:
        assert cm.budget(m / n, n) == m


@pytest.mark.parametrize(
    ("density", "error"),
    [(math.nan, ValueError), (1.5, ValueError), (-1.0, ValueError), ("0.1", TypeError)],
)
def test_the_allreducers_budget_checks_its_density(density, error):
    """``spardl.algorithms.budget`` is public: a density that is not a real number in (0, 1]
    raises naming it (NaN once gave "Invalid literal for Fraction")."""
    from spardl.algorithms.base import budget

    with pytest.raises(error, match="density"):
        budget(density, 100)


@pytest.mark.parametrize(
    ("density", "error"),
    [
        (np.longdouble("1e-4000"), ValueError),  # in (0, 1] as a longdouble, 0.0 as a float
        (10**400, ValueError),  # too large for a float
        (math.inf, ValueError),
        (True, TypeError),
        (None, TypeError),
    ],
)
def test_a_density_is_checked_as_the_float_it_is_stored_as(density, error):
    """Every density check (the allreducers', their loaded states', the cost model's) is
    ``check_density``: it returns ρ as a Python float and checks the range on that float."""
    from spardl._checks import check_density

    with pytest.raises(error, match="rho must be"):
        check_density("rho", density)
    with pytest.raises(error, match="density"):
        cm.budget(density, 100)


def test_an_allreducer_rejects_a_density_that_underflows():
    from mpi4py import MPI

    import spardl

    with pytest.raises(ValueError, match="density must be in"):
        spardl.make("topka", MPI.COMM_SELF, 100, density=np.longdouble("1e-4000"))
    ar = spardl.make("topka", MPI.COMM_SELF, 100, density=0.5)
    with pytest.raises(ValueError, match="density must be in"):
        ar.set_density(np.longdouble("1e-4000"))
    assert ar.density == 0.5 and ar.k == 50
    state = ar.state_dict()
    state["density"] = np.longdouble("1e-4000")
    with pytest.raises(ValueError, match="state density must be in"):
        ar.load_state_dict(state)
    from spardl._checks import check_density

    assert check_density("rho", np.float32(0.5)) == 0.5
    assert type(check_density("rho", np.float32(0.5))) is float


@pytest.mark.parametrize(
    ("n", "error"),
    [(0, ValueError), (-5, ValueError), (True, TypeError), (2.5, TypeError), (None, TypeError)],
)
def test_budget_checks_its_length(n, error):
    with pytest.raises(error, match="n must be"):
        cm.budget(0.5, n)


def test_a_refused_density_is_shown_in_its_own_precision():
    from spardl._checks import check_density

    with pytest.raises(ValueError, match=r"got np.longdouble\('1e-4000'\)"):
        check_density("rho", np.longdouble("1e-4000"))
    with pytest.raises(ValueError, match="got an integer of 401 digits"):
        check_density("rho", 10**400)
    with pytest.raises(ValueError, match=r"got 1\.5$"):
        check_density("rho", 1.5)


@pytest.mark.parametrize("algorithm", sorted(cm.FORMULAS))
def test_one_rank_costs_nothing_even_at_the_largest_finite_rates(algorithm):
    """P = 1 sends nothing: 0 seconds, never 0·inf = NaN where β + γ overflows."""
    huge = {"alpha": 1e308, "beta": 1e308, "gamma": 1e308}
    got = cm.predict(algorithm, 1, 10, 1.0, **huge)
    assert got["seconds"] == 0.0 and got["bytes"] == 0.0
    assert cm.predict(algorithm, 2, 10, 1.0, **huge)["seconds"] == math.inf
