"""bench/validate_model.py's predictors on a hand-made measurement (no MPI)."""

from __future__ import annotations

import math

import pytest

from bench import validate_model as vm

FIT = {"alpha": 1e-5, "beta": 1e-9, "gamma": 5e-10, "rows": [[8, 1.2e-5], [1 << 20, 1.1e-3]]}


def _measured(P, work):
    # one step; every rank sends one 1000-byte message, and one control allreduce per call
    traces = [[(1, "srs", "p2p", (r + 1) % P, 1000)] for r in range(P)]
    return {
        "P": P,
        "rows": {
            "spardl": {
                "times": [0.02],
                "traces": traces,
                "messages": [1] * P,
                "local_times": [0.004],
                "control_per_step": 1.0,
                "work": [[w] for w in work],
                "mpi_wall": [[0.001]] * P,
            }
        },
    }


@pytest.mark.parametrize("P", [2, 3, 5, 8])
def test_predictors_follow_their_formulas(P):
    cores = 2
    work = [0.003 + 0.001 * r for r in range(P)]
    (row,) = vm.predict_rows(FIT, {P: _measured(P, work)}, cores)
    s = math.ceil(P / cores)
    control = math.ceil(math.log2(P)) * 2 * FIT["alpha"]  # an allreduce: 2⌈log₂P⌉ rounds
    ab = FIT["alpha"] + 1000 * FIT["beta"]
    assert row["oversubscription"] == s
    assert row["comm_s"] == pytest.approx(ab + 1000 * FIT["gamma"] + control)
    assert row["predicted_s"] == pytest.approx(0.004 + s * row["comm_s"])
    assert row["comm_ab_s"] == pytest.approx(ab + control)
    assert row["predicted_clocked_s"] == pytest.approx(s * (max(work) + ab + control))
    assert row["rel_error_clocked"] == pytest.approx((row["predicted_clocked_s"] - 0.02) / 0.02)


def test_summary_counts_rows_within_30_percent():
    rows = [
        {"algorithm": "spardl", "rel_error": 0.1, "rel_error_clocked": -0.05},
        {"algorithm": "topka", "rel_error": -0.5, "rel_error_clocked": 0.31},
        {"algorithm": "dense", "rel_error": 0.9, "rel_error_clocked": 0.2},
    ]
    lines = vm.summary(rows, FIT)
    assert "(A) a priori: sparse algorithms within ±30%: 1/2" in lines[0]
    assert "dense worst 90%" in lines[0]
    assert "(B) clocked work: sparse algorithms within ±30%: 1/2" in lines[1]
    assert "ping-pong" in lines[-1]


def test_links_use_the_ring_beta_the_job_measured():
    """Across links, (A) and (B) price the bytes with the P-node job's ring-exchange β; the
    ping-pong β's (A) is kept beside it; over shared memory the ping-pong β stays."""
    P, cores = 4, 2
    m = _measured(P, [0.003] * P)
    m["beta_ring"] = 1e-8
    (row,) = vm.predict_rows(FIT, {P: m}, cores, links=True)
    control = math.ceil(math.log2(P)) * 2 * FIT["alpha"]
    assert row["beta"] == 1e-8
    assert row["comm_s"] == pytest.approx(FIT["alpha"] + 1000 * (1e-8 + FIT["gamma"]) + control)
    assert row["comm_ab_s"] == pytest.approx(FIT["alpha"] + 1000 * 1e-8 + control)
    pp = FIT["alpha"] + 1000 * (FIT["beta"] + FIT["gamma"]) + control
    assert row["rel_error_pingpong"] == pytest.approx((0.004 + pp - 0.02) / 0.02)
    (shared,) = vm.predict_rows(FIT, {P: m}, cores, links=False)
    assert shared["beta"] == FIT["beta"]
    assert shared["rel_error_pingpong"] == shared["rel_error"]


def test_links_take_the_local_work_from_the_shared_memory_run():
    """With the shared-memory measurement, (A) is s(P)·W_max(shared memory) + the α-β replay
    with the ring β + control; the t_local form is kept as rel_error_self."""
    P, cores = 4, 2
    links = _measured(P, [0.003] * P)
    links["beta_ring"] = 1e-8
    shared = _measured(P, [0.005, 0.006, 0.004, 0.002])
    (row,) = vm.predict_rows(FIT, {P: links}, cores, links=True, shared={P: shared})
    control = math.ceil(math.log2(P)) * 2 * FIT["alpha"]
    ab = FIT["alpha"] + 1000 * 1e-8 + control
    assert row["predicted_s"] == pytest.approx(2 * 0.006 + ab)
    assert row["rel_error_self"] == pytest.approx((0.004 + row["comm_s"] - 0.02) / 0.02)
    assert row["predicted_clocked_s"] == pytest.approx(2 * 0.003 + ab)
