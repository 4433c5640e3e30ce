"""``spardl.comm.Comm``'s object collectives, barrier and MPI clock: what each returns on every
rank, that they count in ``stats`` only with ``control=True``, and that the clock sees their calls.
The reference is mpi4py's own object collectives on the raw world communicator.

Runs on every rank under `mpiexec -n P` (tests/test_mpi.py).
"""

from __future__ import annotations

import numpy as np

from spardl.comm import Comm


def _counters(c: Comm) -> tuple:
    s = c.stats
    return s["messages"], s["bytes_sent"], s["bytes_received"], s["control_messages"]


def test_object_collectives_match_mpi4py_and_count_only_as_control(comm):
    c = Comm(comm)
    P, r = c.size, c.rank
    root = P - 1
    mine = {"rank": r, "x": np.arange(r + 1)}
    before = _counters(c)
    c.barrier()
    assert c.allgather_object(r, control=False) == comm.allgather(r) == list(range(P))
    everyone = c.allgather_object(mine, control=False)
    assert [o["rank"] for o in everyone] == list(range(P))
    assert [o["x"].tolist() for o in everyone] == [list(range(q + 1)) for q in range(P)]
    got, ref = c.gather_object(r * 10, root), comm.gather(r * 10, root=root)
    assert got == ref == ([10 * q for q in range(P)] if r == root else None)
    assert c.bcast_object(("from", r), root) == ("from", root)
    sent = [("to", q) for q in range(P)] if r == root else None
    assert c.scatter_object(sent, root) == ("to", r)
    if P > 1:  # a token around the ring, from rank 0 and back to it
        if r == 0:
            c.send_object([0], 1, tag=7)
            assert c.recv_object(P - 1, tag=7) == list(range(P))
        else:
            c.send_object(c.recv_object(r - 1, tag=7) + [r], (r + 1) % P, tag=7)
    assert _counters(c) == before  # bookkeeping is not the algorithm's traffic
    c.allgather_object(None)  # the default: a consistency check's reports
    c.bcast_object(None, 0, control=True)
    c.barrier(control=True)
    assert _counters(c) == (*before[:3], before[3] + 3)
    c.free()


def test_bcast_bytes_sent_add_up_to_bytes_received(comm):
    """Over every rank, a broadcast's bytes sent equal its bytes received, (P - 1)·m, for sizes
    that P does not divide and every root."""
    c = Comm(comm)
    P = c.size
    for m in (1, 7, 1000, 1001):
        for root in range(P):
            _, sent0, recv0, _ = _counters(c)
            x = np.full(m, c.rank, np.uint8)
            c.bcast(x, root)
            assert (x == root).all()
            _, sent1, recv1, _ = _counters(c)
            total = comm.allreduce(np.array([sent1 - sent0, recv1 - recv0]))
            assert total[0] == total[1] == (P - 1) * m
    c.free()


def test_mpi_clock_counts_the_calls_of_its_block(comm):
    c = Comm(comm)
    sub = c.split(0, c.rank)  # shares c's accounting, so its calls are clocked too
    with c.mpi_clock() as spent:
        c.barrier()
        c.allgather_object(1, control=False)
        c.allreduce(np.ones(3))
        sub.barrier()
    assert spent[2] == 4 and spent[0] > 0 and spent[1] >= 0
    # Inside a timed trace, the trace's clock goes on counting; the block gets its own share.
    outer = c.start_trace(timed=True)
    c.barrier()
    with c.mpi_clock() as inner:
        c.bcast_object(0, 0)
    c.barrier()
    c.stop_trace()
    assert inner[2] == 1 and outer[2] == 3
    with c.mpi_clock() as idle:
        pass
    assert idle == [0.0, 0.0, 0]
    # A trace started inside a block: the block's end leaves the trace's clock running, and
    # the block counts its calls on both sides of the trace's start and stop.
    with c.mpi_clock() as block:
        c.barrier()
        with c.mpi_clock() as empty:  # an inner block equal in value to nothing but itself
            pass
        live = c.start_trace(timed=True)
        c.barrier()
    c.barrier()
    c.stop_trace()
    assert block[2] == 2 and live[2] == 2 and empty == [0.0, 0.0, 0]
    with c.mpi_clock() as block:
        c.start_trace(timed=True)
        c.stop_trace()
        c.start_trace(timed=False)
        c.barrier()
        c.stop_trace()
    assert block[2] == 1
    sub.free()
    c.free()


def test_bcast_bytes_refuses_a_missing_root_buffer_on_every_rank(comm):
    """A root without its bytes is a TypeError on every rank, after the size message and
    before the second, which no rank then waits for; the Comm stays usable."""
    import pytest

    c = Comm(comm)
    root = c.size - 1
    for bad in (None, np.zeros(3, np.float32), np.zeros((2, 2), np.uint8)):
        with pytest.raises(TypeError, match=f"buf on the root rank {root} must be a 1-D uint8"):
            c.bcast_bytes(bad if c.rank == root else None, root)
    got = c.bcast_bytes(np.arange(5, dtype=np.uint8) if c.rank == root else None, root)
    assert got.tolist() == [0, 1, 2, 3, 4]
    c.free()


def test_ring_beta_is_one_positive_number_everywhere(comm):
    """``spardl.pingpong.ring_beta``: a positive s/byte, the same on every rank (P >= 2); one
    clear ValueError on every rank at P = 1 or with bad arguments; a Comm given is left usable."""
    import pytest

    from spardl.pingpong import ring_beta

    c = Comm(comm)
    if c.size == 1:
        with pytest.raises(ValueError, match="at least 2 ranks"):
            ring_beta(c, size=64)
    else:
        b = ring_beta(c, size=1 << 16, repeat=2)
        assert b > 0 and c.allgather_object(b) == [b] * c.size
    for kwargs, exc, match in (
        ({"size": 0}, ValueError, "^size must be in"),
        ({"size": 1 << 31}, ValueError, "^size must be in"),
        ({"repeat": 0}, ValueError, "^repeat must be in"),
        ({"warmup": -1}, ValueError, "^warmup must be >= 0"),
        ({"size": 2.5}, TypeError, "^size must be an integer"),
        ({"repeat": True}, TypeError, "^repeat must be an integer"),
        ({"warmup": 0.5}, TypeError, "^warmup must be an integer"),
    ):
        with pytest.raises(exc, match=match):
            ring_beta(c, **kwargs)
    assert c.allreduce(np.ones(2)).tolist() == [c.size, c.size]
    c.free()


def _mpi_float16_reduce_scatter_allgather(comm, x):
    """MPI's own float16 SUM as a reduce-scatter of P zero-padded blocks and an all-gather."""
    from mpi4py import MPI

    P, n = comm.size, x.shape[0]
    m = -(-n // P)
    pad = np.zeros(m * P, np.float16)
    pad[:n] = x
    block, full = np.empty(m, np.float16), np.empty(m * P, np.float16)
    comm.Reduce_scatter_block(pad, block, op=MPI.SUM)
    comm.Allgather(block, full)
    return full[:n]


def test_a_float16_sum_is_mpis_own_reduce_scatter_and_all_gather(comm, monkeypatch):
    """``Comm.allreduce`` sums float16 with :func:`spardl.comm.float16_allreduce` (a
    reduce-scatter by :func:`spardl.comm.float16_sum_op`, a vectorised reduction, and an
    all-gather), and only float16: the bits of the same two collectives with MPI's own float16
    SUM, which rounds every addition (MPICH orders a user operation's reduce-scatter as its
    own), the same on every rank, and within float16's rounding of the exact sum; for values
    from subnormal to past float16's range, ±inf and NaN, new or in place, n that P does not
    divide or smaller than P; NaN exactly where MPI's sum is NaN (payloads not compared)."""
    from mpi4py import MPI

    import spardl.comm

    c = Comm(comm)
    P, r = c.size, c.rank
    op = spardl.comm.float16_sum_op()
    assert spardl.comm.float16_sum_op() is op
    calls = []
    real = spardl.comm.float16_allreduce
    monkeypatch.setattr(
        spardl.comm, "float16_allreduce", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    assert c.allreduce(np.ones(3, np.float32), "sum").tolist() == [P] * 3 and not calls
    rng = np.random.default_rng(100 + r)
    for n, scale in ((1, 1.0), (7, 1e-6), (1001, 1.0), (40003, 3e3), (40004, 1e-5)):
        x = (rng.standard_normal(n) * scale).astype(np.float16)
        if n > 10:
            x[:4] = [np.inf, -np.inf, np.nan, 60000.0] if r == P - 1 else [1.0, 2.0, 3.0, 60000.0]
        want = _mpi_float16_reduce_scatter_allgather(comm, x)
        exact = np.empty(n, np.float64)
        comm.Allreduce(x.astype(np.float64), exact, op=MPI.SUM)
        bound = np.empty(n, np.float64)  # each of the P − 1 additions: half an ulp of ≤ Σ|x|
        comm.Allreduce(np.abs(x.astype(np.float64)), bound, op=MPI.SUM)
        for got in (c.allreduce(x.copy(), "sum"), c.allreduce(y := x.copy(), "sum", out=y)):
            assert got.dtype == np.float16 and got.shape == (n,)
            nan = np.isnan(want)
            assert np.array_equal(np.isnan(got), nan)
            assert got[~nan].tobytes() == want[~nan].tobytes(), (n, scale)
            assert comm.allgather(got.tobytes()) == [got.tobytes()] * P
            fine = np.isfinite(got) & (np.abs(exact) < 65504)
            err = np.abs(got[fine].astype(np.float64) - exact[fine])
            assert np.all(err <= P * (2.0**-11 * bound[fine] + 2.0**-25)), (n, scale)
    assert len(calls) == 10
    c.free()


def test_float16_allreduce_refuses_bad_buffers_before_any_data(comm):
    """Every rank given the same bad buffer raises the same error naming it, before any data
    (the next collective still matches); nothing is written. Without ``check`` it raises
    before any message at all."""
    import pytest

    from spardl.comm import float16_allreduce

    h = np.ones(6, np.float16)
    ro = np.ones(6, np.float16)
    ro.flags.writeable = False
    for x, out, exc, match in (
        (np.ones(6, np.float32), h, TypeError, "^x: must be a float16"),
        (h, [1.0] * 6, TypeError, "^out: must be a float16"),
        (np.ones((2, 3), np.float16), h, ValueError, "^x: must be 1-D"),
        (h, np.ones(12, np.float16)[::2], ValueError, "^out: must be 1-D and C-contiguous"),
        (h, np.ones(5, np.float16), ValueError, "^out: length 5 does not match x"),
        (h, ro, ValueError, "^out: array is read-only"),
    ):
        for check in (True, False):
            with pytest.raises(exc, match=match):
                float16_allreduce(comm, x, out, check=check)
    assert (h == 1).all()
    assert comm.allreduce(comm.rank) == comm.size * (comm.size - 1) // 2


def test_float16_allreduce_raises_on_every_rank_for_one_ranks_bad_argument(comm):
    """A bad buffer, or another n, on the last rank only: every rank raises (the last rank its
    own error, the others one naming it) instead of waiting in the reduce-scatter or summing
    misaligned blocks; nothing is written and the next call works. A spardl ``Comm`` is taken
    as the communicator; anything else raises a TypeError naming ``comm``."""
    import pytest

    from spardl.comm import float16_allreduce

    P, last = comm.size, comm.rank == comm.size - 1
    h = lambda n=6: np.ones(n, np.float16)  # noqa: E731
    ro = h()
    ro.flags.writeable = False
    cases = [
        ((np.ones(6, np.float32), h()), TypeError, "x: must be a float16"),
        ((h(), ro), ValueError, "out: array is read-only"),
        ((h(), h(5)), ValueError, "out: length 5"),
    ]
    if P > 1:  # n = 5 against 6: the same ⌈n/P⌉ blocks from P = 6 up, misaligned sums before
        cases.append(((h(5), h(5)), ValueError, "x: length differs across ranks"))
    for bad, exc, match in cases:
        x, out = bad if last else (h(), h())
        with pytest.raises(exc, match=match):
            float16_allreduce(comm, x, out)
        assert (out == 1).all()  # nothing written, on any rank
    c = Comm(comm)
    for cm in (comm, c):
        assert float16_allreduce(cm, h(), out := h()) is out and (out == P).all()
    for bad_comm in (None, "world", object()):
        with pytest.raises(TypeError, match="^comm: must be an mpi4py intracommunicator"):
            float16_allreduce(bad_comm, h(), h())
    c.free()


def test_comm_allreduce_names_a_bad_out(comm):
    """``Comm.allreduce``'s host ``out`` of another dtype, shape or layout, or read-only: an
    error naming ``out`` before any message (float16 and float32 alike); a 2-D float16 ``x``
    is summed like a 2-D float32 one."""
    import pytest

    c = Comm(comm)
    for dtype in (np.float16, np.float32):
        x = np.ones(4, dtype)
        other = np.float32 if dtype == np.float16 else np.float16
        ro = np.ones(4, dtype)
        ro.flags.writeable = False
        for out, exc, match in (
            (np.ones(4, other), TypeError, "^out: must be a NumPy array of x's dtype"),
            ([1.0] * 4, TypeError, "^out: must be a NumPy array"),
            (np.ones(5, dtype), ValueError, "^out: must be C-contiguous of x's shape"),
            (np.ones(8, dtype)[::2], ValueError, "^out: must be C-contiguous"),
            (ro, ValueError, "^out: array is read-only"),
        ):
            with pytest.raises(exc, match=match):
                c.allreduce(x, "sum", out=out)
        got = c.allreduce(np.ones((2, 3), dtype), "sum")
        assert got.shape == (2, 3) and got.dtype == dtype and (got == c.size).all()
    assert comm.allreduce(1) == c.size  # no rank left a message behind
    c.free()
