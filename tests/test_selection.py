"""spardl.selection: exact and threshold-reusing top-k selectors, against tests/naive.py."""

from __future__ import annotations

import math

import naive
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from spardl.selection import ExactSelector, ThresholdSelector, make_selector


def _drift(rng, n, steps, dtype=np.float32):
    """A slowly changing heavy-tailed stream, like successive gradients of one block."""
    base = rng.standard_t(3, n)
    for _ in range(steps):
        base = 0.9 * base + 0.1 * rng.standard_t(3, n)
        yield base.astype(dtype)


@settings(deadline=None, max_examples=60)
@given(
    x=arrays(
        np.float32,
        st.integers(0, 300),
        elements=st.one_of(
            st.floats(-1e3, 1e3, width=32),
            st.sampled_from([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0]),
        ),
    ),
    data=st.data(),
)
def test_exact_matches_naive(x, data):
    k = data.draw(st.integers(0, x.shape[0]))
    idx, vals = ExactSelector().select(x, k, key=3)
    want_i, want_v = naive.topk_abs(x, k)
    assert idx.dtype == np.int64
    np.testing.assert_array_equal(idx, want_i)
    assert vals.tobytes() == want_v.tobytes()


def test_exact_max_count():
    assert ExactSelector().max_count(17) == 17
    assert ExactSelector().max_count(0) == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_threshold_first_call_and_interval_are_exact(dtype):
    rng = np.random.default_rng(0)
    sel = ThresholdSelector(interval=4)
    for step, x in enumerate(_drift(rng, 2000, 9, dtype)):
        idx, vals = sel.select(x, 50, key="b")
        if step % 4 == 0:
            want_i, want_v = naive.topk_abs(x, 50)
            np.testing.assert_array_equal(idx, want_i)
            assert vals.tobytes() == want_v.tobytes()


@pytest.mark.parametrize("slack", [0.0, 0.25, 1.0])
def test_threshold_counts_bounded_and_values_consistent(slack):
    rng = np.random.default_rng(1)
    sel = ThresholdSelector(interval=32, slack=slack)
    k = 40
    for x in _drift(rng, 3000, 40):
        idx, vals = sel.select(x, k, key=0)
        assert len(idx) <= sel.max_count(k) == math.ceil(k * (1 + slack))
        assert np.all(np.diff(idx) > 0)
        assert vals.tobytes() == x[idx].tobytes()
        # what it returns is always a top set: every unselected |x| is below every selected one
        if len(idx):
            rest = np.delete(np.abs(x), idx)
            assert rest.size == 0 or rest.max() <= np.abs(vals).min()


def test_threshold_reuse_is_select_above_and_stays_near_k():
    rng = np.random.default_rng(2)
    sel = ThresholdSelector(interval=1000)
    k = 100
    counts = []
    for step, x in enumerate(_drift(rng, 20000, 30)):
        t_before = sel.state_dict()["keys"][0][1][0] if step else None
        idx, vals = sel.select(x, k, key=0)
        if step and len(idx) <= sel.max_count(k):
            want_i, _ = naive.select_above(x, t_before)
            if len(want_i) <= sel.max_count(k):
                np.testing.assert_array_equal(idx, want_i)
        counts.append(len(idx))
    # the nudge keeps the count near k (not collapsing to 0 or always falling back)
    assert 0.5 * k <= np.median(counts[1:]) <= sel.max_count(k)


def test_threshold_falls_back_when_count_explodes():
    sel = ThresholdSelector(interval=100, slack=0.25)
    x = np.arange(1, 1001, dtype=np.float64)
    sel.select(x, 10, key=0)  # exact: threshold = 991
    y = np.full(1000, 5000.0)  # everything above the old threshold
    idx, _ = sel.select(y, 10, key=0)
    np.testing.assert_array_equal(idx, naive.topk_abs(y, 10)[0])
    assert sel.state_dict()["keys"][0][1][0] == 5000.0


def test_threshold_keys_are_independent_and_k_change_resets():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal(500), rng.standard_normal(500) * 100
    sel = ThresholdSelector(interval=8)
    sel.select(a, 5, key=0)
    sel.select(b, 5, key=1)
    st0 = dict(sel.state_dict()["keys"])
    assert st0[0][0] == float(naive.kth_largest_abs(a, 5))
    assert st0[1][0] == float(naive.kth_largest_abs(b, 5))
    idx, _ = sel.select(a, 7, key=0)  # k changed: exact again
    np.testing.assert_array_equal(idx, naive.topk_abs(a, 7)[0])


def test_threshold_zero_data_and_k_zero():
    sel = ThresholdSelector(interval=4)
    z = np.zeros(50, np.float32)
    for _ in range(5):
        idx, vals = sel.select(z, 3, key=0)
        assert len(idx) <= sel.max_count(3)
    idx, vals = sel.select(z, 0, key=9)
    assert idx.dtype == np.int64 and len(idx) == 0 and vals.dtype == np.float32


def test_threshold_selects_everything_when_k_is_n():
    """k = len(x) (density 1) is exact on every call: a reused threshold would drop entries
    smaller than the last step's smallest."""
    sel = ThresholdSelector(interval=8)
    rng = np.random.default_rng(3)
    for _ in range(5):
        x = rng.standard_normal(20).astype(np.float32) * rng.choice([1e-3, 1.0, 1e3])
        idx, vals = sel.select(x, 20)
        np.testing.assert_array_equal(idx, np.arange(20))
        np.testing.assert_array_equal(vals, x)


def test_threshold_nan_is_selected():
    sel = ThresholdSelector(interval=2)
    x = np.linspace(-1, 1, 100)
    sel.select(x, 5, key=0)
    y = x.copy()
    y[17] = np.nan
    idx, _ = sel.select(y, 5, key=0)
    assert 17 in idx


def test_state_round_trip_continues_bit_for_bit():
    rng = np.random.default_rng(4)
    xs = list(_drift(rng, 1000, 12))
    a = ThresholdSelector(interval=5)
    for x in xs[:6]:
        a.select(x, 20, key=(1, 2))
        a.select(-x, 20, key=7)
    b = make_selector("threshold", interval=5)
    b.load_state_dict(a.state_dict())
    for x in xs[6:]:
        for key, y in (((1, 2), x), (7, -x)):
            ia, va = a.select(y, 20, key=key)
            ib, vb = b.select(y, 20, key=key)
            np.testing.assert_array_equal(ia, ib)
            assert va.tobytes() == vb.tobytes()
    e = make_selector("exact")
    e.load_state_dict(e.state_dict())
    with pytest.raises(ValueError, match="threshold"):
        e.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="interval"):
        ThresholdSelector(interval=6).load_state_dict(a.state_dict())


def test_make_selector_errors():
    assert isinstance(make_selector("exact"), ExactSelector)
    assert make_selector("threshold", interval=3).interval == 3
    with pytest.raises(ValueError, match="selector"):
        make_selector("sampling")
    with pytest.raises(ValueError, match="selector"):
        make_selector(None)
    with pytest.raises(ValueError, match="interval"):
        make_selector("threshold", interval=0)
    with pytest.raises(TypeError, match="interval"):
        make_selector("threshold", interval=2.5)
    with pytest.raises(ValueError, match="slack"):
        make_selector("threshold", slack=-0.1)
    with pytest.raises(ValueError, match="nudge"):
        make_selector("threshold", nudge=2.0)
    with pytest.raises(TypeError, match="bogus"):
        make_selector("threshold", bogus=1)
    with pytest.raises(TypeError, match="exact"):
        make_selector("exact", interval=3)


def test_select_argument_errors():
    for sel in (ExactSelector(), ThresholdSelector()):
        with pytest.raises(ValueError, match="k"):
            sel.select(np.zeros(3), 4)
        with pytest.raises(ValueError, match="x"):
            sel.select(np.zeros((2, 2)), 1)
        with pytest.raises(TypeError, match="k"):
            sel.select(np.zeros(3), 1.0)


@settings(deadline=None, max_examples=60)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(20, 400),
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
)
def test_threshold_fallback_selects_from_what_passed_exactly(seed, n, dtype):
    """When a reused threshold passes more than max_count entries, the exact top-k is taken from
    those entries: bit for bit ``topk_abs(x, k)``, ties to the lower index and NaN first, and the
    new threshold its k-th largest magnitude."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, max(2, n // 5)))
    sel = ThresholdSelector(interval=100, slack=0.0)
    first = rng.standard_normal(n).astype(dtype)
    sel.select(first, k, key=0)  # exact: t = the k-th largest |first|
    # every entry at or above the old threshold, with ties, NaN and infinities among them
    x = (rng.integers(1, 4, n) * float(np.abs(first).max() + 1)).astype(dtype)
    x[rng.random(n) < 0.1] = np.nan
    x[rng.random(n) < 0.05] = -np.inf
    idx, vals = sel.select(x, k, key=0)
    want_i, want_v = naive.topk_abs(x, k)
    np.testing.assert_array_equal(idx, want_i)
    assert vals.tobytes() == want_v.tobytes()
    t = sel.state_dict()["keys"][0][1][0]
    want_t = float(naive.kth_largest_abs(x, k))
    assert t == want_t or (math.isnan(t) and math.isnan(want_t))
