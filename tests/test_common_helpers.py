"""Single-process tests of the peers' pure helpers and of the references themselves."""

from __future__ import annotations

import math
from statistics import NormalDist

import naive
import numpy as np
import pytest
from ref_peers import ref_gaussiank, ref_gtopk, ref_topka, ref_topkdsa

from spardl.algorithms.common import error_feedback, sent_reached
from spardl.algorithms.gaussiank import folded_normal_tail_quantile
from spardl.algorithms.gtopk import tree_rounds
from spardl.algorithms.topkdsa import sparse_is_smaller


def test_sent_reached():
    sent = np.array([1, 4, 7, 9], dtype=np.int64)
    out = np.array([0, 4, 9, 12], dtype=np.int64)
    np.testing.assert_array_equal(sent_reached(sent, out), [False, True, False, True])
    assert sent_reached(sent, out[:0]).tolist() == [False] * 4
    assert sent_reached(sent[:0], out).shape == (0,)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_error_feedback_modes(dtype):
    x = np.arange(1, 11, dtype=dtype)
    sent = np.array([2, 5, 8], dtype=np.int64)
    out = np.array([0, 5, 6], dtype=np.int64)
    e = error_feedback(x.copy(), sent, "local")
    np.testing.assert_array_equal(e, np.where(np.isin(np.arange(10), sent), 0, x))
    e = error_feedback(x.copy(), sent, "global", out_indices=out)
    np.testing.assert_array_equal(e, np.where(np.arange(10) == 5, 0, x))
    e = error_feedback(x.copy(), sent, "global")  # everything reached the output
    np.testing.assert_array_equal(e, np.where(np.isin(np.arange(10), sent), 0, x))
    y = x.copy()
    assert error_feedback(y, sent, "none") is y
    with pytest.raises(ValueError, match="mode"):
        error_feedback(x.copy(), sent, "bogus", out_indices=out)


@pytest.mark.parametrize("q", [1e-4, 0.01, 0.1, 0.5, 0.9])
@pytest.mark.parametrize("sigma", [1e-3, 1.0, 7.5])
def test_folded_normal_quantile_centred(q, sigma):
    # μ = 0: P(|Y| ≥ t) = q  ⇔  t = σ·Φ⁻¹(1 − q/2).
    want = NormalDist(0, sigma).inv_cdf(1 - q / 2)
    assert math.isclose(folded_normal_tail_quantile(q, 0.0, sigma), want, rel_tol=1e-9)


@pytest.mark.parametrize("mu", [-2.0, 0.3, 5.0])
def test_folded_normal_quantile_shifted(mu):
    nd = NormalDist(mu, 1.5)
    for q in (0.01, 0.2, 0.7):
        t = folded_normal_tail_quantile(q, mu, 1.5)
        assert math.isclose((1 - nd.cdf(t)) + nd.cdf(-t), q, rel_tol=1e-7)
    assert folded_normal_tail_quantile(1.0, mu, 1.5) == 0.0
    assert folded_normal_tail_quantile(0.3, mu, 0.0) == abs(mu)


@pytest.mark.parametrize(
    "q, mu, sigma, error, match",
    [
        (0.0, 0.0, 1.0, ValueError, "q must be in"),
        (-0.1, 0.0, 1.0, ValueError, "q must be in"),
        (1.5, 0.0, 1.0, ValueError, "q must be in"),
        (math.nan, 0.0, 1.0, ValueError, "q must be in"),
        ("0.1", 0.0, 1.0, TypeError, "q must be a float"),
        (0.1, math.inf, 1.0, ValueError, "mu must be finite"),
        (0.1, 0.0, -1.0, ValueError, "sigma must be finite and ≥ 0"),
        (0.1, 0.0, math.nan, ValueError, "sigma must be finite"),
        (0.1, None, 1.0, TypeError, "mu must be a float"),
    ],
)
def test_folded_normal_quantile_refuses_values_outside_its_ranges(q, mu, sigma, error, match):
    with pytest.raises(error, match=match):
        folded_normal_tail_quantile(q, mu, sigma)


def test_break_even_rule():
    # float64 with int32 indices: 12 bytes a pair against 8 a dense value -> switch at 2/3·len.
    assert sparse_is_smaller(66, 100, 4, 8)
    assert not sparse_is_smaller(67, 100, 4, 8)
    # float32: switch at half.
    assert sparse_is_smaller(49, 100, 4, 4)
    assert not sparse_is_smaller(50, 100, 4, 4)


def test_tree_rounds():
    assert [tree_rounds(P) for P in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]


def _xs(P, n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n) for _ in range(P)]


@pytest.mark.parametrize("P", [1, 3, 5])
def test_references_agree_at_density_one(P):
    xs = _xs(P, 17)
    want = np.sum(np.stack(xs), axis=0)
    for ref in (ref_topka, ref_gaussiank, ref_topkdsa):
        idx, val, res = ref(xs, 17)
        np.testing.assert_array_equal(idx, np.arange(17))
        np.testing.assert_allclose(val, want, rtol=1e-12)
        assert all(not np.any(e) for e in res)
    idx, val, res, dropped = ref_gtopk(xs, 17)
    np.testing.assert_allclose(val, want, rtol=1e-12)
    assert dropped == 0.0


@pytest.mark.parametrize("P", [2, 3, 6])
def test_reference_gtopk_keeps_k_and_loses_mass(P):
    xs = _xs(P, 50, seed=P)
    idx, val, res, dropped = ref_gtopk(xs, 5)
    assert len(idx) == 5 and dropped > 0
    # Not conserved: Σ X − out − Σ E misses exactly partial sums dropped at surviving coordinates
    # (never more mass than was dropped).
    gap = np.sum(np.stack(xs), axis=0) - naive.scatter_add(np.zeros(50), idx, val) - sum(res)
    assert np.sum(np.abs(gap)) <= dropped + 1e-12


@pytest.mark.parametrize("P", [1, 2, 4])
def test_reference_topka_conserves(P):
    xs = _xs(P, 40, seed=9)
    idx, val, res = ref_topka(xs, 6)
    lhs = np.sum(np.stack(xs), axis=0)
    rhs = naive.scatter_add(np.zeros(40), idx, val) + sum(res)
    np.testing.assert_allclose(lhs, rhs, atol=1e-12)
    assert len(idx) <= 6 * P
