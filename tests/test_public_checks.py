"""Bad arguments to public functions raise a ValueError or TypeError naming the argument: the
cost model's closed forms, predict and replay, pingpong.fit_gamma, auto.candidate_names and
auto.explain, the selectors and dtypes.work_dtype. No MPI."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from spardl import cost_model as cm
from spardl.algorithms.auto import candidate_names, explain
from spardl.dtypes import work_dtype
from spardl.pingpong import fit_gamma
from spardl.selection import ExactSelector, ThresholdSelector

# -- cost_model: the closed forms ----------------------------------------------------------------
CLOSED_FORMS = [cm.dense, cm.topka, cm.gaussiank, cm.topkdsa, cm.gtopk, cm.spardl, cm.oktopk]


@pytest.mark.parametrize("f", CLOSED_FORMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    ("args", "error", "name"),
    [
        ((0, 100, 10), ValueError, "P"),
        ((-3, 100, 10), ValueError, "P"),
        ((2.0, 100, 10), TypeError, "P"),
        ((True, 100, 10), TypeError, "P"),
        (("4", 100, 10), TypeError, "P"),
        ((4, 0, 1), ValueError, "n"),
        ((4, 100.0, 10), TypeError, "n"),
        ((4, 100, 0), ValueError, "k"),
        ((4, 100, 101), ValueError, "k"),
        ((4, 100, 2.5), TypeError, "k"),
        ((4, 100, True), TypeError, "k"),
    ],
)
def test_closed_forms_check_P_n_k(f, args, error, name):
    with pytest.raises(error, match=rf"^{name} must"):
        f(*args)


@pytest.mark.parametrize("f", CLOSED_FORMS, ids=lambda f: f.__name__)
def test_closed_forms_are_zero_at_one_rank(f):
    assert f(1, 100, 10) == cm.Cost(0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"threshold_interval": 0}, ValueError, "threshold_interval"),
        ({"threshold_interval": -5}, ValueError, "threshold_interval"),
        ({"threshold_interval": 2.5}, TypeError, "threshold_interval"),
        ({"threshold_interval": True}, TypeError, "threshold_interval"),
        ({"region_interval": 0}, ValueError, "region_interval"),
        ({"region_interval": -1}, ValueError, "region_interval"),
        ({"region_interval": "64"}, TypeError, "region_interval"),
        ({"step": -1}, ValueError, "step"),
        ({"step": 1.0}, TypeError, "step"),
        ({"step": False}, TypeError, "step"),
    ],
)
def test_oktopk_checks_its_options(kwargs, error, name):
    with pytest.raises(error, match=rf"^{name} must"):
        cm.oktopk(4, 1000, 10, **kwargs)
    with pytest.raises(error, match=rf"^{name} must"):
        cm.oktopk(1, 1000, 10, **kwargs)  # checked at P = 1 too, where nothing is sent
    with pytest.raises(error, match=rf"^{name} must"):
        cm.predict("oktopk", 4, 1000, 0.01, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"d": "2"}, TypeError, "d"),
        ({"d": 2.0}, TypeError, "d"),
        ({"d": True}, TypeError, "d"),
        ({"d": 0}, ValueError, "d"),
        ({"d": 3}, ValueError, "d"),
        ({"density": "0.1"}, TypeError, "density"),
        ({"density": 0.0}, ValueError, "density"),
        ({"density": math.nan}, ValueError, "density"),
        ({"sag_budget": 1}, TypeError, "sag_budget"),
        ({"sag_budget": "min"}, ValueError, "sag_budget"),
    ],
)
def test_spardl_checks_its_options(kwargs, error, name):
    with pytest.raises(error, match=rf"^{name} must"):
        cm.spardl(4, 1000, 10, **kwargs)


def test_spardl_takes_a_numpy_density():
    assert cm.spardl(4, 1000, 10, density=np.float32(0.01)) == cm.spardl(4, 1000, 10, density=0.01)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"word_bytes": -4}, ValueError, "word_bytes"),
        ({"word_bytes": 0}, ValueError, "word_bytes"),
        ({"word_bytes": math.inf}, ValueError, "word_bytes"),
        ({"word_bytes": math.nan}, ValueError, "word_bytes"),
        ({"word_bytes": "4"}, TypeError, "word_bytes"),
        ({"word_bytes": True}, TypeError, "word_bytes"),
        ({"alpha": "1e-6"}, TypeError, "alpha"),
        ({"beta": None}, TypeError, "beta"),
        ({"gamma": True}, TypeError, "gamma"),
        ({"alpha": -1.0}, ValueError, "alpha"),
        ({"beta": math.inf}, ValueError, "beta"),
        ({"gamma": math.nan}, ValueError, "gamma"),
        ({"P": 0}, ValueError, "P"),
        ({"P": 2.7}, TypeError, "P"),
        ({"n": "100"}, TypeError, "n"),
        ({"teams": 0}, ValueError, "teams"),
        ({"teams": "2"}, TypeError, "teams"),
        ({"teams": 3, "algorithm": "spardl"}, ValueError, "teams"),
        ({"algorithm": 3}, TypeError, "algorithm"),
        ({"algorithm": "nope"}, ValueError, "algorithm"),
        ({"wire": None}, TypeError, "wire"),
        ({"wire": "fp16"}, ValueError, "wire"),
        ({"density": "0.1"}, TypeError, "density"),
    ],
)
def test_predict_checks_its_arguments(kwargs, error, name):
    args = {"algorithm": "topka", "P": 4, "n": 100, "density": 0.1, **kwargs}
    with pytest.raises(error, match=rf"^{name} must"):
        cm.predict(**args)


def test_predict_word_bytes_may_be_fractional():
    """``auto`` prices an int64 index beside a float32 value at 6 bytes a word, and may pass
    any positive real."""
    p = cm.predict("topka", 4, 1000, 0.01, word_bytes=6.0)
    assert p["bytes"] == p["words"] * 6.0 > 0


@pytest.mark.parametrize(
    ("args", "error", "name"),
    [
        (("1e-6", 1e-9, 0.0), TypeError, "alpha"),
        ((1e-6, -1e-9, 0.0), ValueError, "beta"),
        ((1e-6, 1e-9, 0.0, -4), ValueError, "word_bytes"),
        ((1e-6, 1e-9, 0.0, "4"), TypeError, "word_bytes"),
    ],
)
def test_cost_seconds_checks_its_arguments(args, error, name):
    c = cm.topka(4, 100, 10)
    alpha, beta, gamma, *wb = args
    with pytest.raises(error, match=rf"^{name} must"):
        c.seconds(alpha, beta, *wb, gamma=gamma)


def test_check_rates_names_a_wrong_type():
    with pytest.raises(TypeError, match="^alpha must be a float"):
        cm._check_rates("1e-6", 1e-9, 0.0)


@pytest.mark.parametrize(
    ("P", "error"), [(0, ValueError), (-5, ValueError), (2.5, TypeError), (True, TypeError)]
)
def test_ceil_log2_and_collective_rounds_check_P(P, error):
    with pytest.raises(error, match="^P must"):
        cm.ceil_log2(P)
    for kind in ("p2p", "allgather", "allreduce"):
        with pytest.raises(error, match="^P must"):
            cm.collective_rounds(kind, P)


def test_one_rank_collective_costs_nothing():
    assert cm.ceil_log2(1) == 0
    assert cm.collective_rounds("allreduce", 1) == cm.collective_rounds("bcast", 1) == 0
    assert cm.collective_rounds("p2p", 1) == 1


@pytest.mark.parametrize(("kind", "error"), [(None, TypeError), (3, TypeError), ("x", ValueError)])
def test_collective_rounds_checks_kind(kind, error):
    with pytest.raises(error, match="^kind must"):
        cm.collective_rounds(kind, 4)


TRACE = [[(0, "p", "p2p", 1, 100)], [(0, "p", "p2p", 0, 100)]]


@pytest.mark.parametrize("f", [cm.replay, cm.replay_steps], ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    ("P", "error"),
    [(2.7, TypeError), (True, TypeError), ("4", TypeError), (0, ValueError), (-1, ValueError)],
)
def test_replay_checks_P(f, P, error):
    with pytest.raises(error, match="^P must"):
        f(TRACE, 1e-6, 1e-9, P=P)


@pytest.mark.parametrize("f", [cm.replay, cm.replay_steps], ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    ("traces", "error", "match"),
    [
        ([], ValueError, r"^traces must"),
        (None, TypeError, r"^traces must"),
        ((t for t in TRACE), TypeError, r"^traces must"),
        ([5], TypeError, r"^traces\[0\] must"),
        ([[(0, "p", "p2p", 1)]], ValueError, r"^traces\[0\]: a trace record is"),
        ([[{"step": 0, "phase": "p", "kind": "p2p", "peer": 1}]], ValueError, r"lacks \['bytes'\]"),
        ([[(0.5, "p", "p2p", 1, 100)]], TypeError, r"trace record step must"),
        ([[(0, "p", "p2p", 1, "100")]], TypeError, r"trace record bytes must"),
        ([[(0, "p", "p2p", True, 100)]], TypeError, r"trace record peer must"),
        ([[(0, 7, "p2p", 1, 100)]], TypeError, r"trace record phase must"),
        ([[(-1, "p", "p2p", 1, 100)]], ValueError, r"trace record step must"),
        ([[(0, "p", "p2p", 1, -100)]], ValueError, r"trace record bytes must"),
        ([[(0, "p", "gather", 1, 100)]], ValueError, r"trace record kind must"),
    ],
)
def test_replay_checks_its_traces(f, traces, error, match):
    with pytest.raises(error, match=match):
        f(traces, 1e-6, 1e-9)


def test_replay_takes_numpy_record_fields():
    rec = (np.int64(0), "p", "p2p", np.int32(1), np.int64(100))
    assert cm.replay([[rec]], 1e-6, 1e-9) == pytest.approx(1e-6 + 100e-9)


# -- pingpong.fit_gamma ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"repeat": 0}, ValueError, "repeat"),
        ({"repeat": -2}, ValueError, "repeat"),
        ({"repeat": 2.0}, TypeError, "repeat"),
        ({"pairs": 0}, ValueError, "pairs"),
        ({"pairs": True}, TypeError, "pairs"),
        ({"pairs": "8"}, TypeError, "pairs"),
        ({"seed": -1}, ValueError, "seed"),
        ({"seed": 0.5}, TypeError, "seed"),
    ],
)
def test_fit_gamma_checks_its_arguments(kwargs, error, name):
    with pytest.raises(error, match=rf"^{name} must"):
        fit_gamma(**kwargs)


def test_fit_gamma_of_one_pair_is_finite():
    g = fit_gamma(pairs=1, repeat=1)
    assert math.isfinite(g) and g >= 0


# -- auto.candidate_names -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("P", "error"),
    [(0, ValueError), (-4, ValueError), (4.5, TypeError), (True, TypeError), ("4", TypeError)],
)
def test_candidate_names_checks_P(P, error):
    with pytest.raises(error, match="^P must"):
        candidate_names(P)


def test_candidate_names_at_one_rank_keeps_every_default():
    assert candidate_names(1) == ["spardl:d=1", "oktopk", "topka", "dense"]
    assert candidate_names(np.int64(2))[:2] == ["spardl:d=1", "spardl:d=2"]


# -- selection -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("slack", "error"),
    [(math.inf, ValueError), (math.nan, ValueError), (-0.5, ValueError), ("0.1", TypeError)],
)
def test_threshold_selector_slack_is_finite(slack, error):
    with pytest.raises(error, match="^slack must"):
        ThresholdSelector(slack=slack)


def test_a_huge_slack_bounds_counts_exactly():
    sel = ThresholdSelector(slack=1e308)
    assert sel.max_count(2) == math.ceil(2 * (1 + Fraction(1e308)))
    assert sel.max_count(0) == 0


@pytest.mark.parametrize("sel", [ExactSelector(), ThresholdSelector()], ids=lambda s: s.kind)
@pytest.mark.parametrize(("k", "error"), [(-1, ValueError), (2.7, TypeError), ("4", TypeError)])
def test_max_count_checks_k(sel, k, error):
    with pytest.raises(error, match="^k must"):
        sel.max_count(k)


@pytest.mark.parametrize("sel", [ExactSelector(), ThresholdSelector()], ids=lambda s: s.kind)
@pytest.mark.parametrize(
    ("n", "k", "error", "name"),
    [
        (-1, 0, ValueError, "n"),
        (10.0, 2, TypeError, "n"),
        (10, 11, ValueError, "k"),
        (10, -1, ValueError, "k"),
        (10, True, TypeError, "k"),
    ],
)
def test_planned_checks_n_and_k(sel, n, k, error, name):
    with pytest.raises(error, match=rf"^{name} must"):
        sel.planned(n, k)


def _trained():
    sel = ThresholdSelector(interval=4)
    x = np.linspace(-1, 1, 100).astype(np.float32)
    sel.select(x, 5, key=(1, 2))
    sel.select(x, 5, key=7)
    return sel


def _without(state, field):
    return {k: v for k, v in state.items() if k != field}


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: _without(s, "keys"), r"selector state is missing key\(s\) \['keys'\]"),
        (lambda s: _without(s, "slack"), r"selector state is missing key\(s\) \['slack'\]"),
        (lambda s: {**s, "keys": 5}, "selector state keys must be a list"),
        (lambda s: {**s, "keys": [(7,)]}, "selector state keys: an entry"),
        (lambda s: {**s, "keys": [([[1], 2], [1.0, 1, 5, 100])]}, "not hashable"),
        (lambda s: {**s, "keys": [(7, [1.0, 1, 5])]}, r"selector state key 7: \[threshold"),
        (lambda s: {**s, "keys": [(7, ["x", 1, 5, 100])]}, "selector state threshold must"),
        (lambda s: {**s, "keys": [(7, [1.0, -1, 5, 100])]}, "selector state calls must"),
        (lambda s: {**s, "keys": [(7, [1.0, 1.5, 5, 100])]}, "selector state calls must"),
        (lambda s: {**s, "keys": [(7, [1.0, 1, True, 100])]}, "selector state k must"),
        (lambda s: {**s, "keys": [(7, [1.0, 1, 500, 100])]}, "k=500 > n=100"),
    ],
)
def test_threshold_state_malformed_is_a_value_error_and_loads_nothing(edit, match):
    sel = _trained()
    before = sel.state_dict()
    fresh = ThresholdSelector(interval=4)
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(edit(sel.state_dict()))
    with pytest.raises(ValueError, match="state"):
        sel.load_state_dict(edit(sel.state_dict()))
    assert sel.state_dict() == before  # all or nothing
    assert fresh.state_dict()["keys"] == []


def test_threshold_state_round_trips_with_list_keys_and_numpy_counters():
    sel = _trained()
    state = sel.state_dict()
    state["keys"] = [
        (list(k) if isinstance(k, tuple) else k, [np.float64(v[0]), *map(np.int64, v[1:])])
        for k, v in state["keys"]
    ]
    other = ThresholdSelector(interval=4)
    other.load_state_dict(state)
    assert other.state_dict() == sel.state_dict()


@pytest.mark.parametrize("sel", [ExactSelector(), ThresholdSelector()], ids=lambda s: s.kind)
def test_a_selector_state_that_is_no_dict_is_a_type_error(sel):
    with pytest.raises(TypeError, match="selector state must be a dict"):
        sel.load_state_dict([("kind", sel.kind)])


# -- dtypes.work_dtype ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "error"),
    [
        ("foo", ValueError),
        (np.int32, ValueError),
        ("complex64", ValueError),
        (np.dtype(">f4") if np.little_endian else np.dtype("<f4"), ValueError),
        (None, TypeError),
        (3.5, TypeError),
    ],
)
def test_work_dtype_checks_its_dtype(dtype, error):
    with pytest.raises(error, match="^dtype must"):
        work_dtype(dtype)


@pytest.mark.parametrize(
    ("dtype", "want"),
    [(np.float16, np.float32), ("float32", np.float32), (np.dtype(np.float64), np.float64)],
)
def test_work_dtype_of_the_gradient_dtypes(dtype, want):
    got = work_dtype(dtype)
    assert isinstance(got, np.dtype) and got == want


@pytest.mark.parametrize(
    ("report", "error", "says"),
    [
        ({}, ValueError, "stats['auto'], which holds choice"),
        ({"choice": "topka"}, ValueError, "which holds phase"),
        ([], TypeError, "report must be a dict"),
    ],
)
def test_explain_names_a_report_that_is_not_one(report, error, says):
    """explain({}) was a raw KeyError: 'choice'."""
    with pytest.raises(error) as info:
        explain(report)
    assert says in str(info.value)
