"""spardl.cost_model: the closed-form α-β formulas, without MPI."""

from __future__ import annotations

import math

import pytest

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
    """SparDL d = 1 sends ≈ 4k(P−1)/P words, below Ok-Topk's 6k(P−1)/P (DESIGN.md §1)."""
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
    assert (g.messages, g.rounds) == (2, 3)
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
