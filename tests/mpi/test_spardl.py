"""SparDL over MPI (docs/design.md §4): against the single-process reference, conservation,
cost, cases.

Runs on every rank under `mpiexec -n P python -m pytest` for P in {1, 2, 3, 4, 5, 6, 8}.
"""

from __future__ import annotations

import math

import naive
import numpy as np
import pytest
from mpiutil import (
    assert_identical_everywhere,
    assert_sparse_equal,
    conservation_error,
    grads_for,
)
from ref_spardl import spardl_step

import spardl
from spardl.algorithms.spardl import next_h
from spardl.schedules import bruck_schedule, num_rounds, srs_schedule

TOL = {np.float32: 1e-6, np.float64: 1e-12}


def _teams(comm, which):
    """d for the symbolic team counts "1", "2", "P"; skip what does not divide P or repeats."""
    P = comm.size
    d = {"1": 1, "2": 2, "P": P}[which]
    if P % d or (which == "2" and P == 2) or (which == "P" and P == 1):
        pytest.skip(f"teams={which} is not a new case at P={P}")
    return d


def _step_and_check(comm, ar, g, density, d, dtype, residual="global"):
    """One call, checked on every rank: identical output, equal to the reference bit for bit
    (same float operations in the same order), conservation. Returns (out, X_r)."""
    P, rank = comm.size, comm.rank
    g_all = comm.allgather(g)
    e_all = comm.allgather(ar.residual.copy())
    wd = np.float32 if np.dtype(dtype) == np.float16 else dtype
    # the base class: x = g.astype(work dtype); x += E_old
    x_all = []
    for gr, er in zip(g_all, e_all, strict=True):
        xr = gr.astype(wd, copy=True)
        xr += er.astype(wd)
        x_all.append(xr)
    out = ar(g)
    assert_identical_everywhere(comm, out)
    assert out.indices.dtype == np.int64 and np.all(np.diff(out.indices) > 0)
    hs = comm.allgather(ar.stats.get("h"))
    m = P // d
    if d > 1:
        # the d owners of one block position always use the same h
        assert all(hs[w] == hs[w % m] for w in range(P))
    ref_i, ref_v, ref_e, _ = spardl_step(
        x_all, density, teams=d, h=hs[:m] if d > 1 else None, residual=residual
    )
    want = (ref_v / ref_v.dtype.type(P) if P > 1 else ref_v).astype(dtype)
    assert_sparse_equal(out, ref_i, want)
    assert out.values.tobytes() == want[want != 0].tobytes()
    assert ar.residual.tobytes() == ref_e[rank].tobytes()
    return out, x_all[rank]


@pytest.mark.parametrize("which", ["1", "2", "P"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n_kind", ["divisible", "1001"])
@pytest.mark.parametrize("density", [0.01, 0.1, 0.5, 1.0])
def test_matches_reference_and_conserves(comm, which, dtype, n_kind, density):
    d = _teams(comm, which)
    P = comm.size
    n = 8 * P * 3 if n_kind == "divisible" else 1001
    ar = spardl.make("spardl", comm, n, density=density, teams=d)
    for step in range(3):
        g = grads_for(comm, n, dtype, seed=10 + step, kind="heavy")[comm.rank]
        out, x = _step_and_check(comm, ar, g, density, d, dtype)
        err = conservation_error(comm, x, out.to_dense(), ar.residual, "mean")
        assert err <= TOL[dtype], f"step {step}: conservation error {err:.3g}"
        if density == 1.0 and step == 0:  # C9: nothing dropped, the exact mean
            want = np.mean(np.stack(comm.allgather(g)).astype(np.float64), axis=0)
            assert out.nnz == np.count_nonzero(want)  # everything but the exact zeros
            np.testing.assert_allclose(out.to_dense(), want, rtol=TOL[dtype], atol=TOL[dtype])
            assert not np.any(ar.residual)


def test_local_residual_loses_mass(comm, capsys):
    """residual="local" (plain error feedback) forgets what was forwarded and then dropped."""
    n, density = 1001, 0.01
    lost = {}
    for mode in ("global", "local"):
        ar = spardl.make("spardl", comm, n, density=density, residual=mode)
        total = 0.0
        for step in range(3):
            g = grads_for(comm, n, np.float64, seed=40 + step)[comm.rank]
            out, x = _step_and_check(comm, ar, g, density, 1, np.float64, residual=mode)
            total += conservation_error(comm, x, out.to_dense(), ar.residual, "mean")
        lost[mode] = total
    if comm.rank == 0:
        with capsys.disabled():
            print(
                f"\n[P={comm.size}] relative mass lost over 3 steps: "
                f"global {lost['global']:.3g}, local {lost['local']:.3g}"
            )
    assert lost["global"] <= 3e-12
    if comm.size > 1:
        assert lost["local"] > 1e-3
    else:
        assert lost["local"] <= 3e-12  # one rank forwards nothing: local = global


def _expected_bytes(P, rank, n, density, isz, vsz):
    """Wire bytes of one step with d = 1 and the exact selector (every block sends exactly k_b)."""
    bounds = naive.uniform_bounds(n, P)
    C = math.ceil(n / P)
    kb = [min(int(bounds[b + 1] - bounds[b]), max(1, math.floor(density * C))) for b in range(P)]

    def msg(items):
        pairs = sum(kb[b] for b in items)
        return ((len(items) + pairs) * isz + 7) // 8 * 8 + pairs * vsz

    rounds = srs_schedule(P, rank) + bruck_schedule(P, rank)
    return sum(msg(r.send) for r in rounds), kb


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cost_one_team(comm, dtype):
    """d = 1: exactly 2⌈log₂P⌉ data messages per rank per step, and ≈ 4k(P−1)/P words."""
    P = comm.size
    n, density, steps = 1001, 0.05, 3
    ar = spardl.make("spardl", comm, n, density=density)
    before = {k: ar.stats[k] for k in ("messages", "bytes_sent")}
    for step in range(steps):
        ar(grads_for(comm, n, dtype, seed=50 + step)[comm.rank])
    R = num_rounds(P)
    assert ar.stats["messages"] - before["messages"] == steps * 2 * R
    phases = ar.stats["phases"]
    if P > 1:
        assert phases["srs"]["messages"] == steps * R
        assert phases["sag_allgather"]["messages"] == steps * R
    vsz = np.dtype(dtype).itemsize
    exact, kb = _expected_bytes(P, comm.rank, n, density, 4, vsz)
    sent = ar.stats["bytes_sent"] - before["bytes_sent"]
    assert sent == steps * exact
    # 4k(P−1)/P words (a pair = 2 words, i.e. 4 + vsz bytes) plus block rounding and headers
    k = ar.k
    words = 4 * max(kb) * (P - 1)
    assert max(kb) * P <= k + P  # k_b = ⌊ρ⌈n/P⌉⌋ rounds up by at most one per block
    header = 2 * (P - 1) * 4 + 2 * R * 7
    assert sent / steps <= words / 2 * (4 + vsz) + header


@pytest.mark.parametrize("which", ["2", "P"])
def test_cost_with_teams(comm, which):
    """d teams: ⌈log₂m⌉ SRS + ⌈log₂d⌉ cross-team + ⌈log₂m⌉ all-gather messages per step."""
    d = _teams(comm, which)
    m = comm.size // d
    ar = spardl.make("spardl", comm, 1001, density=0.05, teams=d)
    for step in range(2):
        ar(grads_for(comm, 1001, np.float32, seed=60 + step)[comm.rank])
    assert ar.stats["messages"] == 2 * (2 * num_rounds(m) + num_rounds(d))
    assert ar.stats["phases"]["sag_teams"]["messages"] == 2 * num_rounds(d)


@pytest.mark.parametrize("which", ["1", "P"])
def test_threshold_selector_conserves(comm, which):
    d = _teams(comm, which)
    n, density = 1001, 0.05
    ar = spardl.make(
        "spardl", comm, n, density=density, teams=d, selector="threshold", threshold_interval=3
    )
    for step in range(7):
        g = grads_for(comm, n, np.float32, seed=70 + step, kind="heavy")[comm.rank]
        x = g + ar.residual
        out = ar(g)
        assert_identical_everywhere(comm, out)
        assert conservation_error(comm, x, out.to_dense(), ar.residual, "mean") <= TOL[np.float32]
        assert out.nnz >= 1


@pytest.mark.parametrize("which", ["1", "2", "P"])
def test_state_dict_resume_with_threshold_and_teams(comm, which):
    d = _teams(comm, which)
    n, kw = 501, {"density": 0.05, "teams": d, "selector": "threshold", "threshold_interval": 2}
    a = spardl.make("spardl", comm, n, **kw)
    grads = [grads_for(comm, n, np.float64, seed=80 + s, kind="heavy")[comm.rank] for s in range(6)]
    for g in grads[:3]:
        a(g)
    b = spardl.make("spardl", comm, n, **kw)
    b.load_state_dict(a.state_dict())
    for g in grads[3:]:
        oa, ob = a(g), b(g)
        np.testing.assert_array_equal(oa.indices, ob.indices)
        assert oa.values.tobytes() == ob.values.tobytes()
        assert a.residual.tobytes() == b.residual.tobytes()


def test_next_h_rule():
    # the union was smaller than k_b (overlap): h grows, at least by one
    assert next_h(10, 15, 40, 2) > 10
    # too big: h shrinks, never below max(1, ⌊k_b/d⌋) nor above k_b
    assert next_h(20, 40, 20, 2) == 15  # half-way to h* = 10
    assert next_h(3, 100, 20, 2) == 10
    assert next_h(50, 1, 20, 4) == 20
    assert next_h(5, 0, 20, 4) > 5
    assert next_h(0, 0, 0, 4) == 0  # an empty block
    # a fixed point where the union just fills k_b
    assert next_h(10, 20, 20, 2) == 10


# -- the collective cases of docs/design.md §9, for spardl ----------------------------------


def test_c1_one_rank_output_is_the_top_selection(comm):
    if comm.size != 1:
        pytest.skip("C1 is the P = 1 case")
    g = grads_for(comm, 100, np.float64, seed=1)[0]
    out = spardl.make("spardl", comm, 100, density=0.05)(g)
    want_i, want_v = naive.topk_abs(g, 5)
    np.testing.assert_array_equal(out.indices, want_i)
    assert out.values.tobytes() == want_v.tobytes()


@pytest.mark.parametrize("which", ["1", "P"])
def test_c2_a_rank_with_nothing_to_send(comm, which):
    d = _teams(comm, which)
    g = grads_for(comm, 50, np.float64, seed=2)[comm.rank]
    if comm.rank == 1:
        g[:] = 0
    ar = spardl.make("spardl", comm, 50, density=0.1, teams=d)
    for _ in range(2):
        out, x = _step_and_check(comm, ar, g, 0.1, d, np.float64)
        assert conservation_error(comm, x, out.to_dense(), ar.residual, "mean") <= 1e-13


@pytest.mark.parametrize("which", ["1", "2", "P"])
def test_c3_uneven_n13(comm, which):
    d = _teams(comm, which)
    g = grads_for(comm, 13, np.float32, seed=3)[comm.rank]
    ar = spardl.make("spardl", comm, 13, density=0.5, teams=d)
    out, x = _step_and_check(comm, ar, g, 0.5, d, np.float32)
    assert conservation_error(comm, x, out.to_dense(), ar.residual, "mean") <= 1e-6


@pytest.mark.parametrize("which", ["1", "2", "P"])
def test_c4_single_nonzero_is_reduced(comm, which):
    d = _teams(comm, which)
    g = np.zeros(100, np.float32)
    g[0] = comm.rank + 1
    out = spardl.make("spardl", comm, 100, density=0.01, teams=d)(g)
    assert_identical_everywhere(comm, out)
    dense = out.to_dense()
    assert dense[0] == np.float32((comm.size + 1) / 2)
    assert not np.any(dense[1:])


def test_c5_budget_from_density(comm):
    ar = spardl.make("spardl", comm, 1000, density=0.01)
    assert comm.allgather(ar.k) == [10] * comm.size
    C = math.ceil(1000 / comm.size)
    assert comm.allgather(ar.k_b) == [ar.k_b] * comm.size
    assert max(ar.k_b) == max(1, math.floor(0.01 * C))


def test_c6_float16_mean_does_not_overflow(comm):
    g = np.full(16, 60000.0, np.float16)
    out = spardl.make("spardl", comm, 16, density=1.0)(g)
    assert out.values.dtype == np.float16
    np.testing.assert_array_equal(out.to_dense(), g)


def test_c7_mismatched_n_raises_everywhere(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    n = 100 if comm.rank == 0 else 101
    with pytest.raises(ValueError, match="n"):
        spardl.make("spardl", comm, n, density=0.1)


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"teams": 0}, ValueError, "teams"),
        ({"teams": "P+1"}, ValueError, "teams"),
        ({"teams": 1.0}, TypeError, "teams"),
        ({"selector": "sampling"}, ValueError, "selector"),
        ({"selector": 5}, TypeError, "selector must be a string"),
        ({"threshold_interval": 0}, ValueError, "threshold_interval"),
        ({"threshold_interval": 8}, ValueError, "threshold_interval applies to"),
        ({"selector": "exact", "threshold_interval": 8}, ValueError, "selector='threshold' only"),
        ({"bogus": 1}, TypeError, "bogus"),
    ],
)
def test_bad_options_raise_everywhere(comm, kwargs, err, match):
    kwargs = {k: (comm.size + 1 if v == "P+1" else v) for k, v in kwargs.items()}
    with pytest.raises(err, match=match):
        spardl.make("spardl", comm, 100, **kwargs)


def test_teams_differ_between_ranks_raises_everywhere(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    d = 1 if comm.rank == 0 else comm.size
    with pytest.raises(ValueError, match="teams"):
        spardl.make("spardl", comm, 100, teams=d)


def test_c8_nan_raises_everywhere_and_applies_nothing(comm):
    g = grads_for(comm, 64, np.float32, seed=8)[comm.rank]
    if comm.rank == 0:
        g[5] = np.nan
    ar = spardl.make("spardl", comm, 64, density=0.1)
    with pytest.raises(spardl.NonFiniteError):
        ar(g)
    assert not np.any(ar.residual)


def test_c10_per_block_budget_of_one(comm):
    """C10: ρ·C < 1 gives k_b = 1 per block; it runs and matches the reference."""
    P = comm.size
    n, density = 100 * P, 0.001  # C = 100, ρ·C = 0.1
    for which in ("1", "P"):
        d = {"1": 1, "P": P}[which]
        ar = spardl.make("spardl", comm, n, density=density, teams=d)
        assert ar.k_b == [1] * (P // d)
        g = grads_for(comm, n, np.float64, seed=10)[comm.rank]
        out, x = _step_and_check(comm, ar, g, density, d, np.float64)
        assert out.nnz == P // d
        assert conservation_error(comm, x, out.to_dense(), ar.residual, "mean") <= 1e-12


def test_tiny_n_with_empty_blocks(comm):
    """n < P: some blocks are empty (k_b = 0); still identical and conserving."""
    n = 3
    g = grads_for(comm, n, np.float64, seed=11)[comm.rank]
    ar = spardl.make("spardl", comm, n, density=0.5)
    out, x = _step_and_check(comm, ar, g, 0.5, 1, np.float64)
    assert conservation_error(comm, x, out.to_dense(), ar.residual, "mean") <= 1e-12
