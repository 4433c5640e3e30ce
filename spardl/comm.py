"""The only module that calls mpi4py.

:class:`Comm` wraps an mpi4py communicator and gives the algorithms what they need: packed sparse
messages (one message per destination per round), dense and small collectives, a cross-rank
consistency check, and exact accounting of messages and bytes per phase.

Accounting rules (``stats``):

* ``messages``: data messages this rank sent. A point-to-point send counts 1; a collective call
  counts 1 (whatever the MPI library does inside it).
* ``bytes_sent`` / ``bytes_received``: payload bytes. For point-to-point messages, the exact size of
  the packed buffer. For collectives, the volume one rank moves under the bandwidth-optimal
  algorithm: all-gather(v) sends and receives everything but its own contribution; allreduce of m
  bytes moves 2·m·(P−1)/P each way (reduce-scatter + all-gather); a broadcast of m bytes counts m
  received on every non-root rank and m·(P−1)/P sent on every rank (scatter + all-gather).
* ``control_messages``: cross-rank consistency checks, not data.
* ``phases``: the same three counters per phase name.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

__all__ = ["Comm", "new_stats", "pack_blocks", "unpack_blocks", "wire_index_dtype"]

_INT32_MAX = np.iinfo(np.int32).max


def new_stats() -> dict:
    """An empty, cumulative statistics mapping (see module docstring)."""
    return {
        "messages": 0,
        "bytes_sent": 0,
        "bytes_received": 0,
        "control_messages": 0,
        "phases": {},
    }


@dataclass
class _Accounting:
    """Mutable state shared by a communicator and the sub-communicators split from it."""

    stats: dict = field(default_factory=new_stats)
    phase: str = "other"
    trace: list | None = None
    step: int = 0

    def _phase_stats(self) -> dict:
        ph = self.stats["phases"].get(self.phase)
        if ph is None:
            ph = self.stats["phases"][self.phase] = {
                "messages": 0,
                "bytes_sent": 0,
                "bytes_received": 0,
            }
        return ph

    def sent(self, nbytes: int, peer: int, kind: str) -> None:
        ph = self._phase_stats()
        self.stats["messages"] += 1
        self.stats["bytes_sent"] += int(nbytes)
        ph["messages"] += 1
        ph["bytes_sent"] += int(nbytes)
        if self.trace is not None:
            self.trace.append((self.step, self.phase, kind, int(peer), int(nbytes)))

    def received(self, nbytes: int) -> None:
        self.stats["bytes_received"] += int(nbytes)
        self._phase_stats()["bytes_received"] += int(nbytes)


def wire_index_dtype(max_block_length: int) -> np.dtype:
    """Index dtype used on the wire: block-relative int32 where every block is shorter than 2^31."""
    return np.dtype(np.int32) if max_block_length <= _INT32_MAX else np.dtype(np.int64)


def _align8(nbytes: int) -> int:
    return (nbytes + 7) & ~7


def pack_blocks(blocks, starts, index_dtype, value_dtype) -> np.ndarray:
    """Pack sparse blocks into one byte buffer: counts, block-relative indices, values.

    Parameters
    ----------
    blocks : sequence of (indices, values)
        Per block, absolute int64 indices (ascending) and their values.
    starts : sequence of int
        The first position of each block; subtracted from its indices on the wire.
    index_dtype : numpy dtype
        Wire dtype of counts and indices (int32 or int64).
    value_dtype : numpy dtype
        Wire dtype of the values.

    Returns
    -------
    ndarray of uint8
        ``[counts | indices | pad to 8 bytes | values]``.
    """
    index_dtype = np.dtype(index_dtype)
    value_dtype = np.dtype(value_dtype)
    nb = len(blocks)
    counts = np.array([len(b[0]) for b in blocks], dtype=np.int64)
    total = int(counts.sum())
    isz, vsz = index_dtype.itemsize, value_dtype.itemsize
    head = _align8((nb + total) * isz)
    buf = np.empty(head + total * vsz, dtype=np.uint8)
    ints = buf[: (nb + total) * isz].view(index_dtype)
    ints[:nb] = counts
    vals = buf[head:].view(value_dtype)
    pos = 0
    for (idx, val), start in zip(blocks, starts, strict=True):
        c = len(idx)
        if c:
            np.subtract(idx, start, out=ints[nb + pos : nb + pos + c], casting="unsafe")
            vals[pos : pos + c] = val
        pos += c
    return buf


def packed_capacity(nblocks: int, max_pairs: int, index_dtype, value_dtype) -> int:
    """Bytes needed to receive ``nblocks`` blocks holding at most ``max_pairs`` pairs in all."""
    isz = np.dtype(index_dtype).itemsize
    return _align8((nblocks + max_pairs) * isz) + max_pairs * np.dtype(value_dtype).itemsize


def unpack_blocks(buf, nblocks, starts, index_dtype, value_dtype):
    """Inverse of :func:`pack_blocks`: a list of (int64 absolute indices, values) per block.

    Raises
    ------
    ValueError
        If the buffer is shorter than its own header says (a corrupt or mismatched message).
    """
    index_dtype = np.dtype(index_dtype)
    value_dtype = np.dtype(value_dtype)
    isz, vsz = index_dtype.itemsize, value_dtype.itemsize
    if len(buf) < nblocks * isz:
        raise ValueError("received message shorter than its block header")
    counts = buf[: nblocks * isz].view(index_dtype).astype(np.int64)
    total = int(counts.sum())
    head = _align8((nblocks + total) * isz)
    if len(buf) != head + total * vsz:
        raise ValueError(
            f"received message of {len(buf)} bytes, header announces {head + total * vsz}"
        )
    rel = buf[nblocks * isz : (nblocks + total) * isz].view(index_dtype)
    vals = buf[head:].view(value_dtype)
    out = []
    pos = 0
    for b in range(nblocks):
        c = int(counts[b])
        idx = rel[pos : pos + c].astype(np.int64)
        idx += int(starts[b])
        out.append((idx, vals[pos : pos + c].copy()))
        pos += c
    return out


def _mpi_op(op: str):
    return {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]


class Comm:
    """A wrapped communicator with message accounting.

    Parameters
    ----------
    mpi_comm : mpi4py.MPI.Comm
        An intracommunicator. It is duplicated (collective) unless ``dup=False``, so the
        allreducer's messages never match the application's.
    dup : bool, default True
        Duplicate the communicator.

    Raises
    ------
    TypeError
        If ``mpi_comm`` is not an mpi4py intracommunicator.
    """

    def __init__(self, mpi_comm, *, dup: bool = True, _acct: _Accounting | None = None):
        if isinstance(mpi_comm, Comm):
            mpi_comm = mpi_comm.mpi
        if not isinstance(mpi_comm, MPI.Intracomm):
            raise TypeError(
                f"comm must be an mpi4py intracommunicator (e.g. MPI.COMM_WORLD), "
                f"got {type(mpi_comm).__name__}"
            )
        self.mpi = mpi_comm.Dup() if dup else mpi_comm
        self._owns = dup
        self.rank = self.mpi.Get_rank()
        self.size = self.mpi.Get_size()
        self._acct = _acct if _acct is not None else _Accounting()

    # -- accounting -------------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        """Cumulative message and byte counters (see module docstring)."""
        return self._acct.stats

    @contextlib.contextmanager
    def phase(self, name: str):
        """Attribute every message inside the ``with`` block to phase ``name``."""
        prev = self._acct.phase
        self._acct.phase = name
        try:
            yield
        finally:
            self._acct.phase = prev

    def start_trace(self) -> None:
        """Record every message as (step, phase, kind, peer, bytes) from now on."""
        self._acct.trace = []

    def stop_trace(self) -> list:
        """Stop recording and return the recorded messages."""
        trace, self._acct.trace = self._acct.trace or [], None
        return trace

    def next_step(self) -> None:
        """Advance the step counter used in traces."""
        self._acct.step += 1

    def split(self, color: int, key: int) -> Comm:
        """Split into sub-communicators that share this one's accounting."""
        sub = self.mpi.Split(color, key)
        c = Comm(sub, dup=False, _acct=self._acct)
        c._owns = True
        return c

    def free(self) -> None:
        """Free the duplicated communicator (idempotent)."""
        if self._owns and self.mpi != MPI.COMM_NULL:
            self.mpi.Free()
            self._owns = False

    # -- point to point ---------------------------------------------------------------------
    def sendrecv_bytes(self, sendbuf: np.ndarray, dest: int, source: int, capacity: int,
                       tag: int = 0) -> np.ndarray:
        """Send ``sendbuf`` to ``dest`` and receive at most ``capacity`` bytes from ``source``.

        The received size is read from the MPI status, so variable-size messages need no count
        message. Returns the received bytes (a view of a fresh buffer).
        """
        recv = np.empty(max(int(capacity), 1), dtype=np.uint8)
        status = MPI.Status()
        self.mpi.Sendrecv(
            [sendbuf, MPI.BYTE], dest, tag, [recv, MPI.BYTE], source, tag, status=status
        )
        nrecv = status.Get_count(MPI.BYTE)
        self._acct.sent(sendbuf.nbytes, dest, "p2p")
        self._acct.received(nrecv)
        return recv[:nrecv]

    def send_bytes(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        """One-way send of a byte buffer to ``dest`` (tree algorithms: a child to its parent)."""
        buf = np.ascontiguousarray(buf, dtype=np.uint8)
        self.mpi.Send([buf, MPI.BYTE], dest, tag)
        self._acct.sent(buf.nbytes, dest, "p2p")

    def recv_bytes(self, source: int, capacity: int, tag: int = 0) -> np.ndarray:
        """Receive at most ``capacity`` bytes from ``source``; the size is read from the status."""
        recv = np.empty(max(int(capacity), 1), dtype=np.uint8)
        status = MPI.Status()
        self.mpi.Recv([recv, MPI.BYTE], source, tag, status=status)
        nrecv = status.Get_count(MPI.BYTE)
        self._acct.received(nrecv)
        return recv[:nrecv]

    def exchange_blocks(self, dest, send_blocks, send_starts, source, recv_starts, max_pairs,
                        index_dtype, value_dtype, tag: int = 0):
        """One packed sparse message each way: send blocks to ``dest``, receive from ``source``.

        Parameters
        ----------
        dest, source : int
            Peer ranks in this communicator.
        send_blocks : list of (indices, values)
            Absolute int64 indices (ascending) and values, one pair per block sent.
        send_starts, recv_starts : sequence of int
            First position of every block sent / received (indices travel block-relative).
        max_pairs : int
            Upper bound on the number of pairs in the received message.
        index_dtype, value_dtype : numpy dtype
            Wire dtypes (see :func:`wire_index_dtype`).

        Returns
        -------
        list of (int64 indices, values)
            One pair per received block, in block order.
        """
        buf = pack_blocks(send_blocks, send_starts, index_dtype, value_dtype)
        cap = packed_capacity(len(recv_starts), max_pairs, index_dtype, value_dtype)
        got = self.sendrecv_bytes(buf, dest, source, cap, tag)
        return unpack_blocks(got, len(recv_starts), recv_starts, index_dtype, value_dtype)

    # -- collectives ------------------------------------------------------------------------
    def allreduce(self, x: np.ndarray, op: str = "sum") -> np.ndarray:
        """Dense allreduce of a contiguous array; returns a new array."""
        x = np.ascontiguousarray(x)
        out = np.empty_like(x)
        self.mpi.Allreduce(x, out, op=_mpi_op(op))
        vol = 2 * x.nbytes * (self.size - 1) // self.size
        self._acct.sent(vol, -1, "allreduce")
        self._acct.received(vol)
        return out

    def allgather_array(self, x: np.ndarray) -> np.ndarray:
        """All-gather equal-size arrays: returns shape (P,) + x.shape."""
        x = np.ascontiguousarray(x)
        out = np.empty((self.size,) + x.shape, dtype=x.dtype)
        self.mpi.Allgather(x, out)
        vol = x.nbytes * (self.size - 1)
        self._acct.sent(vol, -1, "allgather")
        self._acct.received(vol)
        return out

    def allgatherv_bytes(self, buf: np.ndarray) -> list[np.ndarray]:
        """All-gather variable-size byte buffers (sizes first, then the data): 2 messages."""
        sizes = self.allgather_array(np.array([buf.nbytes], dtype=np.int64))[:, 0]
        displs = np.zeros(self.size, dtype=np.int64)
        np.cumsum(sizes[:-1], out=displs[1:])
        total = int(sizes.sum())
        recv = np.empty(max(total, 1), dtype=np.uint8)
        self.mpi.Allgatherv([buf, MPI.BYTE], [recv, (sizes, displs), MPI.BYTE])
        vol = total - int(buf.nbytes)
        self._acct.sent(vol, -1, "allgatherv")
        self._acct.received(vol)
        return [recv[displs[r] : displs[r] + sizes[r]] for r in range(self.size)]

    def allgatherv_sparse(self, indices, values, index_dtype=np.int64):
        """All-gather one sparse vector per rank; returns a list of (int64 indices, values)."""
        buf = pack_blocks([(indices, values)], [0], index_dtype, values.dtype)
        return [
            unpack_blocks(b, 1, [0], index_dtype, values.dtype)[0]
            for b in self.allgatherv_bytes(buf)
        ]

    def bcast(self, x: np.ndarray, root: int) -> np.ndarray:
        """Broadcast a contiguous array from ``root``; every rank passes a buffer of that shape."""
        x = np.ascontiguousarray(x)
        self.mpi.Bcast(x, root=root)
        self._acct.sent(x.nbytes * (self.size - 1) // self.size, -1, "bcast")
        if self.rank != root:
            self._acct.received(x.nbytes)
        return x

    def bcast_bytes(self, buf: np.ndarray | None, root: int) -> np.ndarray:
        """Broadcast a variable-size byte buffer from ``root`` (size first): 2 messages."""
        size = np.array([0 if buf is None else buf.nbytes], dtype=np.int64)
        self.bcast(size, root)
        if self.rank != root:
            buf = np.empty(int(size[0]), dtype=np.uint8)
        return self.bcast(buf, root)

    # -- control ----------------------------------------------------------------------------
    def agree(self, ok: bool, signature) -> tuple[bool, bool]:
        """One small collective: did every rank pass, and do all signatures match?

        Parameters
        ----------
        ok : bool
            This rank's local validation result.
        signature : sequence of int
            Values that must be equal on every rank (hashed names, sizes, counters).

        Returns
        -------
        (all_ok, same)
            Whether every rank passed, and whether every rank gave the same signature.
        """
        sig = np.asarray(signature, dtype=np.int64)
        # max(v) == -max(-v) iff every rank holds the same v: one MAX allreduce answers both.
        v = np.concatenate(([0 if ok else 1], sig, -sig)).astype(np.int64)
        out = np.empty_like(v)
        self.mpi.Allreduce(v, out, op=MPI.MAX)
        self.stats["control_messages"] += 1
        m = len(sig)
        return bool(out[0] == 0), bool(np.all(out[1 : 1 + m] == -out[1 + m :]))

    def allgather_object(self, obj):
        """All-gather small Python objects (error reports); counted as a control message."""
        self.stats["control_messages"] += 1
        return self.mpi.allgather(obj)

    def abort(self, code: int = 1) -> None:
        """Abort every process of the communicator (used when a rank fails mid-collective)."""
        self.mpi.Abort(code)


def name_hash(name: str) -> int:
    """A stable 31-bit hash of a string, for signatures compared across ranks."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


@contextlib.contextmanager
def abort_on_exception(comm, code: int = 1):
    """End the whole job if this rank raises: print the traceback, then ``MPI_Abort``.

    An exception on one rank in the middle of a collective otherwise leaves every other rank
    waiting forever. Wrap the training loop (``with spardl.abort_on_exception(comm): ...``), or
    run the script as ``mpiexec -n P python -m mpi4py script.py``, which does the same for
    unhandled exceptions.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm or Comm
        The communicator to abort (all of its processes end).
    code : int, default 1
        The exit status passed to ``MPI_Abort``.
    """
    try:
        yield
    except BaseException:
        import sys
        import traceback

        rank = comm.rank if isinstance(comm, Comm) else comm.Get_rank()
        sys.stderr.write(f"spardl: rank {rank} failed; aborting every rank\n")
        traceback.print_exc()
        sys.stderr.flush()
        (comm.mpi if isinstance(comm, Comm) else comm).Abort(code)
