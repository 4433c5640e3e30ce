"""spardl.trace: record under mpiexec, gather, save/load as JSON, replay; counts equal ``stats``.

The file is also the MPI program the test runs (``python tests/test_trace.py OUT.json``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from mpirun import run_mpi

from spardl import cost_model

ALGS = ("spardl", "oktopk", "topka", "gaussiank", "topkdsa", "gtopk", "dense")
N, DENSITY, STEPS = 4_000, 0.02, 3


def _child(out: str) -> None:
    """Under mpiexec: two untraced calls, then STEPS traced ones; rank 0 saves everything."""
    import numpy as np
    from mpi4py import MPI

    import spardl
    import spardl.trace as tr

    comm = MPI.COMM_WORLD
    doc = {}
    for alg in ALGS:
        ar = spardl.make(alg, comm, N, density=DENSITY)
        rng = np.random.default_rng(comm.rank)
        for _ in range(2):
            ar(rng.standard_normal(N).astype(np.float32))
        s0 = (ar.stats["messages"], ar.stats["bytes_sent"])
        with tr.record(ar) as t:
            for _ in range(STEPS):
                ar(rng.standard_normal(N).astype(np.float32))
        delta = (ar.stats["messages"] - s0[0], ar.stats["bytes_sent"] - s0[1])
        traces = tr.gather_traces(comm, t)
        deltas = comm.allgather(delta)
        outside = len(t)
        ar(rng.standard_normal(N).astype(np.float32))  # not recorded once the block ended
        assert len(t) == outside
        if comm.rank == 0:
            path = Path(out).with_suffix(f".{alg}.json")
            tr.save_traces(path, traces, meta={"algorithm": alg, "stats": deltas})
            doc[alg] = str(path)
    # Timed recording, with SparDL's team sub-communicators (d = 2): every MPI call is clocked.
    ar = spardl.make("spardl", comm, N, density=DENSITY, teams=2)
    g = np.random.default_rng(comm.rank).standard_normal(N).astype(np.float32)
    ar(g)
    m0, c0 = ar.stats["messages"], ar.stats["control_messages"]
    with tr.record(ar, timed=True) as t:
        for _ in range(STEPS):
            ar(g)
        live = t.mpi_calls
    timed = {
        "calls": t.mpi_calls,
        "live": live,
        "wall": t.mpi_seconds,
        "cpu": t.mpi_cpu_seconds,
        "messages": ar.stats["messages"] - m0,
        "control": ar.stats["control_messages"] - c0,
        "records": len(t),
    }
    ar(g)  # after the block: no longer clocked
    timed["calls_after"] = t.mpi_calls
    doc_timed = comm.gather(timed, root=0)
    if comm.rank == 0:
        doc["_timed"] = doc_timed
        Path(out).write_text(json.dumps(doc))


@pytest.mark.mpi
def test_recorded_traces_match_stats_and_replay(tmp_path):
    import spardl.trace as tr

    P = 4
    out = tmp_path / "traces.json"
    run_mpi(P, ["tests/test_trace.py", str(out)], timeout=180)
    files = json.loads(out.read_text())
    timed = files.pop("_timed")
    assert len(timed) == P
    for r in timed:  # the clock saw every message (and check) and stopped with the block
        assert r["records"] == r["messages"] > 0, r
        assert r["calls"] >= r["messages"] + r["control"], r
        assert r["live"] == r["calls"] == r["calls_after"], r
        assert r["wall"] > 0 and r["cpu"] >= 0, r
    for alg, path in files.items():
        traces, meta = tr.load_traces(path)
        assert meta["algorithm"] == alg and len(traces) == P
        summary = tr.summarize(traces)
        for r in range(P):
            msgs, sent = meta["stats"][r]
            assert summary[r]["messages"] == msgs, (alg, r)
            assert summary[r]["bytes"] == sent, (alg, r)
            assert summary[r]["steps"] == STEPS, (alg, r)
        steps = cost_model.replay_steps(traces, alpha=1e-5, beta=1e-9)
        assert len(steps) == STEPS
        for r in range(P):  # the replay's per-step counts add up to the stats increments
            assert sum(s["messages"][r] for s in steps) == meta["stats"][r][0], (alg, r)
            assert sum(s["bytes"][r] for s in steps) == meta["stats"][r][1], (alg, r)
        for s in steps:
            assert s["seconds"] == pytest.approx(
                max(r * 1e-5 + b * 1e-9 for r, b in zip(s["rounds"], s["bytes"], strict=True))
            )
        if alg != "oktopk":  # Ok-Topk's extra collectives come every τ, τ' steps
            pred = cost_model.predict(alg, P, N, DENSITY)
            for s in steps:
                per_rank = s["messages"]
                want = pred["messages"]
                assert (max(per_rank) if alg == "gtopk" else per_rank) == (
                    want if alg == "gtopk" else [want] * P
                ), (alg, per_rank, want)
                if alg not in ("gtopk",):
                    assert max(s["rounds"]) == pred["rounds"], (alg, s["rounds"], pred)


def test_record_needs_an_allreducer():
    import spardl.trace as tr

    with pytest.raises(TypeError, match="allreducer"), tr.record(object()):
        pass


def test_recordings_do_not_nest():
    from mpi4py import MPI

    import spardl
    import spardl.trace as tr

    ar = spardl.make("topka", MPI.COMM_SELF, 100, density=0.1)
    with tr.record(ar) as outer:
        with pytest.raises(RuntimeError, match="do not nest"), tr.record(ar):
            pass
        ar(np.ones(100, np.float32))
    assert not ar.comm.tracing and len(outer) == 0  # P = 1 sends nothing, but it was recording


def test_timed_recording_on_one_process():
    """The clock counts this Comm's MPI calls; a Comm built from it meanwhile is a plain one."""
    from mpi4py import MPI

    import spardl.trace as tr
    from spardl.comm import Comm

    c = Comm(MPI.COMM_SELF)
    with tr.record(c, timed=True) as t:
        other = Comm(c)  # wraps the real communicator, not the timing proxy
        out = c.allreduce(np.arange(3.0))
        assert t.mpi_calls == 1 and t.mpi_seconds > 0
        other.allreduce(np.arange(3.0))  # its own accounting: not on this clock
        assert t.mpi_calls == 1
    assert out.tolist() == [0.0, 1.0, 2.0] and len(t) == 1 and not c.tracing
    other.free()
    c.free()


def test_load_rejects_other_files(tmp_path):
    import spardl.trace as tr

    p = tmp_path / "x.json"
    p.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="spardl-trace"):
        tr.load_traces(p)


GOOD_RECORD = [0, "srs", "p2p", 1, 4096]


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"P": 1}, "'ranks' must be a list"),
        ({"P": 1, "ranks": 5}, "'ranks' must be a list"),
        ({"P": 1, "ranks": ["abc"]}, "'ranks' must be a list"),
        ({"P": 1, "ranks": [[7]]}, "a trace record is"),
        ({"P": 1, "ranks": [[[0, "srs"]]]}, "a trace record is"),
        ({"P": 1, "ranks": [[[0, "srs", "p2p", 1, -4096]]]}, "bytes must be >= 0"),
        ({"P": 1, "ranks": [[[0, "srs", "p2p", 1, "4096"]]]}, "bytes must be an integer"),
        ({"P": 1, "ranks": [[[0, "srs", "p2p", 1, 4.9]]]}, "bytes must be an integer"),
        ({"P": 1, "ranks": [[[0, "srs", "p2p", 1, True]]]}, "bytes must be an integer"),
        ({"P": 1, "ranks": [[[0, "srs", "pigeon", 1, 8]]]}, "kind must be one of"),
        ({"P": 1, "ranks": [[[0, "srs", "p2p", 1, 10**400]]]}, "bytes must fit in int64"),
        ({"P": True, "ranks": [[GOOD_RECORD]]}, "P=True but 1 ranks"),
        ({"P": 1, "ranks": [[GOOD_RECORD]], "meta": [1, 2]}, "'meta' must be an object"),
    ],
)
def test_load_checks_every_record_as_replay_does(tmp_path, doc, match):
    """A malformed trace file is a ValueError naming what is wrong, never a raw KeyError or
    TypeError, nor totals that summarize() would add up from nonsense."""
    import spardl.trace as tr

    p = tmp_path / "t.json"
    p.write_text(json.dumps({"format": tr.FORMAT, **doc}))
    with pytest.raises(ValueError, match=match):
        tr.load_traces(p)


def test_load_of_a_file_nested_past_the_parsers_stack_is_a_value_error(tmp_path):
    import spardl.trace as tr

    p = tmp_path / "deep.json"
    p.write_text("[" * 100_000)
    with pytest.raises(ValueError, match="nested too deep"):
        tr.load_traces(p)


def test_summarize_checks_its_records():
    import spardl.trace as tr

    good = tr.summarize([[tuple(GOOD_RECORD)], []])
    assert good[0]["bytes"] == 4096 and good[1]["messages"] == 0
    with pytest.raises(ValueError, match=r"traces\[0\]: trace record bytes must be >= 0"):
        tr.summarize([[(0, "srs", "p2p", 1, -1)]])
    with pytest.raises(TypeError, match="traces must be a list"):
        tr.summarize("abc")


def test_gather_traces_takes_an_mpi4py_or_spardl_communicator():
    from mpi4py import MPI

    import spardl.trace as tr
    from spardl.comm import Comm

    recs = [(0, "srs", "p2p", 0, 8)]
    assert tr.gather_traces(MPI.COMM_SELF, recs) == [recs]
    c = Comm(MPI.COMM_SELF)
    assert tr.gather_traces(c, tr.Trace(rank=0, size=1, records=recs)) == [recs]
    assert c.stats["control_messages"] == 0  # metadata: not counted
    c.free()
    with pytest.raises(TypeError, match="mpi4py or spardl communicator, got object"):
        tr.gather_traces(object(), recs)


if __name__ == "__main__":
    _child(sys.argv[1])
