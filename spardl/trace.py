"""Message traces: record every message an allreducer sends, gather them, save them, replay them.

A trace is, per rank, the list of messages that rank sent, in order, as records
``(step, phase, kind, peer, bytes)`` (:meth:`spardl.comm.Comm.start_trace`):

* ``step``: the allreducer call it belongs to (the communicator's call counter);
* ``phase``: the algorithm's phase ("srs", "sag_allgather", "split_reduce", "allgather", ...);
* ``kind``: "p2p" for a point-to-point message, else the collective ("allgather",
  "allgatherv", "bcast", "allreduce");
* ``peer``: the destination rank in the communicator that sent it (a sub-communicator's rank for
  SparDL's teams), −1 for a collective;
* ``bytes``: the payload; for a collective, the volume :mod:`spardl.comm` accounts for this rank.

The records are exactly what ``stats`` counts: one record per ``stats["messages"]`` increment,
and their bytes add up to the ``stats["bytes_sent"]`` increment. Recording costs nothing when it
is off (one ``is None`` test per message).

Typical use, under ``mpiexec``::

    ar = spardl.make("spardl", MPI.COMM_WORLD, n, density=0.01)
    with spardl.trace.record(ar) as t:
        for g in grads:
            ar(g)
    traces = spardl.trace.gather_traces(MPI.COMM_WORLD, t)    # collective
    if rank == 0:
        spardl.trace.save_traces("trace.json", traces, meta={"algorithm": "spardl", "n": n})
        print(spardl.cost_model.replay(traces, alpha=25e-6, beta=0.8e-9))
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Trace", "record", "gather_traces", "save_traces", "load_traces", "summarize", "FORMAT"]

#: The ``format`` tag of a saved trace file.
FORMAT = "spardl-trace/1"
_FIELDS = ("step", "phase", "kind", "peer", "bytes")


@dataclass
class Trace:
    """One rank's recorded messages.

    Attributes
    ----------
    rank : int
        The recording rank in the allreducer's communicator.
    size : int
        P, the communicator's size.
    records : list of tuple
        ``(step, phase, kind, peer, bytes)`` per message sent, in order; filled when the
        :func:`record` block ends.
    mpi_seconds, mpi_cpu_seconds : float
        With ``record(..., timed=True)``: wall-clock and thread-CPU seconds this rank spent
        inside MPI calls (transfers, waiting for peers, busy-polling), live during the block.
        0.0 when not timed.
    mpi_calls : int
        The number of MPI calls clocked (0 when not timed).
    """

    rank: int
    size: int
    records: list = field(default_factory=list)
    clock: list | None = field(default=None, repr=False)

    @property
    def mpi_seconds(self) -> float:
        """Wall-clock seconds this rank spent inside MPI calls while recording.

        float: element 0 of the live clock of ``record(..., timed=True)`` (it grows during the
        block and stays fixed after it); 0.0 when the recording is not timed.
        """
        return 0.0 if self.clock is None else float(self.clock[0])

    @property
    def mpi_cpu_seconds(self) -> float:
        """Thread-CPU seconds this rank spent inside MPI calls while recording.

        float: element 1 of the live clock of ``record(..., timed=True)`` (busy-polling
        included, waiting without the CPU excluded); 0.0 when the recording is not timed.
        """
        return 0.0 if self.clock is None else float(self.clock[1])

    @property
    def mpi_calls(self) -> int:
        """The number of MPI calls clocked while recording.

        int: element 2 of the live clock of ``record(..., timed=True)``; 0 when the recording
        is not timed.
        """
        return 0 if self.clock is None else int(self.clock[2])

    def __len__(self) -> int:
        return len(self.records)


def _comm_of(obj):
    """The :class:`spardl.comm.Comm` of an allreducer, or the object itself if it is one."""
    comm = getattr(obj, "comm", obj)
    if not all(hasattr(comm, a) for a in ("start_trace", "stop_trace", "rank", "size")):
        raise TypeError(
            "record() needs an allreducer (spardl.make(...)) or a spardl.comm.Comm, "
            f"got {type(obj).__name__}"
        )
    return comm


@contextlib.contextmanager
def record(allreducer, timed: bool = False):
    """Record every message ``allreducer`` sends inside the ``with`` block.

    Parameters
    ----------
    allreducer : spardl.Allreducer or spardl.comm.Comm
        What to record (its communicator, including SparDL's team sub-communicators, which
        share its accounting).
    timed : bool, default False
        Also clock every MPI call (two clock reads per call): the trace's ``mpi_seconds`` and
        ``mpi_cpu_seconds``. A step's thread-CPU time minus its ``mpi_cpu_seconds`` is the
        rank's local work (selection, packing, merging), free of waiting and of time other
        processes held the core.

    Yields
    ------
    Trace
        Empty inside the block; holds this rank's records once the block ends (also when it
        ends with an exception).

    Raises
    ------
    TypeError
        If ``allreducer`` has no spardl communicator.
    RuntimeError
        If a recording is already running on it (recordings do not nest).

    Notes
    -----
    Local: no message is sent to start or stop recording.
    """
    comm = _comm_of(allreducer)
    if getattr(comm, "tracing", False):
        raise RuntimeError(
            "record(): a recording is already running on this allreducer; recordings do not nest"
        )
    t = Trace(rank=int(comm.rank), size=int(comm.size))
    t.clock = comm.start_trace(timed=True) if timed else comm.start_trace()
    try:
        yield t
    finally:
        t.records = [tuple(r) for r in comm.stop_trace()]


def gather_traces(comm, trace) -> list[list[tuple]]:
    """Every rank's records, on every rank (collective over ``comm``).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, spardl.comm.Comm or spardl.Allreducer
        The communicator the trace was recorded on (every rank must call).
    trace : Trace or list of records
        This rank's trace.

    Returns
    -------
    list of P lists of (step, phase, kind, peer, bytes)
        Index r holds rank r's records, ready for :func:`spardl.cost_model.replay`.

    Raises
    ------
    TypeError
        If ``comm`` is not a communicator.
    """
    from .comm import Comm

    comm = getattr(comm, "comm", comm)  # an allreducer
    if not isinstance(comm, Comm):
        try:
            comm = Comm(comm, dup=False)  # an mpi4py communicator, wrapped as it is
        except TypeError:
            raise TypeError(
                f"comm must be an mpi4py or spardl communicator, got {type(comm).__name__}"
            ) from None
    records = trace.records if isinstance(trace, Trace) else list(trace)
    # Not counted in the allreducer's stats: a trace is metadata, not a message of the algorithm.
    gathered = comm.allgather_object([tuple(r) for r in records], control=False)
    return [[tuple(r) for r in recs] for recs in gathered]


def save_traces(path, traces, meta: dict | None = None) -> Path:
    """Write gathered traces as JSON.

    Parameters
    ----------
    path : str or Path
        Output file.
    traces : list of P lists of records
        From :func:`gather_traces`.
    meta : dict, optional
        JSON-serialisable facts to keep beside them (algorithm, n, density, machine, ...).

    Returns
    -------
    Path
        The written file. Its layout: ``{"format": "spardl-trace/1", "P": P, "fields": [...],
        "meta": {...}, "ranks": [[[step, phase, kind, peer, bytes], ...], ...]}``.

    Raises
    ------
    TypeError
        If ``meta`` or a record holds a value JSON cannot encode (:func:`json.dumps`).
    OSError
        If the file cannot be written.
    """
    path = Path(path)
    doc = {
        "format": FORMAT,
        "P": len(traces),
        "fields": list(_FIELDS),
        "meta": meta or {},
        "ranks": [[list(r) for r in recs] for recs in traces],
    }
    path.write_text(json.dumps(doc))
    return path


def load_traces(path) -> tuple[list[list[tuple]], dict]:
    """Read a file written by :func:`save_traces`.

    Parameters
    ----------
    path : str or Path
        The file.

    Returns
    -------
    (traces, meta)
        The per-rank records as tuples, and the saved metadata.

    Raises
    ------
    ValueError
        If the file is not JSON (:class:`json.JSONDecodeError`), not a spardl trace of a known
        format, its ``ranks`` are not lists of records, a record is malformed (as
        :func:`spardl.cost_model.replay` checks it: integers within int64, step and bytes ≥ 0,
        a string phase, a known kind), its ``P`` is not its number of ranks, or its
        ``meta`` is not an object.
    OSError
        If the file cannot be read.
    """
    from .cost_model import _record

    try:
        doc = json.loads(Path(path).read_text())
    except RecursionError:  # nesting deeper than the parser's stack: no trace file
        raise ValueError(f"{path}: not a {FORMAT} file (nested too deep)") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} file")
    ranks, P, meta = doc.get("ranks"), doc.get("P"), doc.get("meta", {})
    if not isinstance(ranks, list) or not all(isinstance(recs, list) for recs in ranks):
        raise ValueError(f"{path}: 'ranks' must be a list of per-rank lists of records")
    try:
        traces = [
            [_record(rec, f"{path}: rank {r}") for rec in recs] for r, recs in enumerate(ranks)
        ]
    except TypeError as e:  # a field of the wrong type: the file's content, not an argument
        raise ValueError(str(e)) from None
    if type(P) is not int or P != len(traces):
        raise ValueError(f"{path}: P={P!r} but {len(traces)} ranks of records")
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: 'meta' must be an object, got {type(meta).__name__}")
    return traces, meta


def summarize(traces) -> list[dict]:
    """Per rank: messages and bytes sent, in total and per phase and kind.

    Parameters
    ----------
    traces : list of P lists of records
        ``(step, phase, kind, peer, bytes)`` records per rank (:func:`gather_traces`,
        :func:`load_traces`).

    Returns
    -------
    list of dict
        ``traces[r]`` summarized as ``{"messages", "bytes", "steps", "phases": {phase:
        {"messages", "bytes"}}, "kinds": {kind: messages}}``; ``steps`` is the number of
        distinct step numbers in the rank's records.

    Raises
    ------
    TypeError, ValueError
        If ``traces`` is not a list of per-rank record sequences or a record is malformed
        (checked as :func:`spardl.cost_model.replay` checks it), naming the rank.
    """
    from .cost_model import _check_traces, _record

    _check_traces(traces)
    traces = [[_record(rec, f"traces[{r}]") for rec in recs] for r, recs in enumerate(traces)]
    out = []
    for recs in traces:
        s = {
            "messages": 0,
            "bytes": 0,
            "steps": len({r[0] for r in recs}),
            "phases": {},
            "kinds": {},
        }
        for _step, phase, kind, _peer, nbytes in recs:
            s["messages"] += 1
            s["bytes"] += int(nbytes)
            ph = s["phases"].setdefault(phase, {"messages": 0, "bytes": 0})
            ph["messages"] += 1
            ph["bytes"] += int(nbytes)
            s["kinds"][kind] = s["kinds"].get(kind, 0) + 1
        out.append(s)
    return out
