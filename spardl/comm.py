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

Python objects (states, reports, decisions, measurements) travel in the object methods
(``bcast_object``, ``gather_object``, ``allgather_object``, ``scatter_object``,
``send_object`` / ``recv_object``, ``barrier``), pickled on the host and clocked like every other
call; they are not counted in ``stats`` unless the caller asks (``control=True``: one control
message), so an allreducer's stats stay its own traffic. No other module reaches mpi4py through a
:class:`Comm` (tests/test_imports.py).

GPU buffers. Every function here also takes device arrays (Numba device arrays, the CUDA
simulator's, or anything with ``__cuda_array_interface__``) and then returns device arrays:
packing and unpacking run on the device, and only the packed O(k)-byte message crosses to MPI.
When the MPI library is CUDA-aware (:func:`cuda_aware`) the device buffer is handed to MPI
directly; otherwise it goes through pinned host buffers (``numba.cuda.pinned_array``) kept per
:class:`Comm` and grown as needed: one device-to-host copy before the call and one host-to-device
copy after it. The default stream is synchronised before every MPI call that reads or writes
device memory. Accounting is the same for both kinds of buffer.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import math
import os
import time
from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np
from mpi4py import MPI

from spardl_kernels.cpu import wire as wire_codec

from . import _arrays as A
from ._checks import check_bool, check_choice, check_int, check_int_at_least, type_name

__all__ = [
    "Comm",
    "cuda_aware",
    "cuda_aware_reason",
    "float16_allreduce",
    "float16_sum_op",
    "new_stats",
    "pack_blocks",
    "pack_wire",
    "unpack_blocks",
    "unpack_wire",
    "wire_capacity",
    "wire_index_dtype",
    "WIRES",
]

_INT32_MAX = np.iinfo(np.int32).max


def new_stats() -> dict:
    """An empty, cumulative statistics mapping (see module docstring).

    Returns
    -------
    dict
        ``messages``, ``bytes_sent``, ``bytes_received``, ``control_messages`` (int, all 0)
        and ``phases`` (an empty dict, filled per phase name with the first three counters).
    """
    return {
        "messages": 0,
        "bytes_sent": 0,
        "bytes_received": 0,
        "control_messages": 0,
        "phases": {},
    }


class _TimedMPI:
    """An mpi4py communicator whose every method call adds its wall and thread-CPU seconds, and
    one call, to each of ``clocks`` (those running: a timed trace's, :meth:`Comm.mpi_clock`
    blocks')."""

    __slots__ = ("_comm", "_clocks")

    def __init__(self, comm, clocks: tuple):
        self._comm = comm
        self._clocks = clocks

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if not callable(attr):
            return attr
        clocks = self._clocks

        def timed(*args, **kwargs):
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return attr(*args, **kwargs)
            finally:
                wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
                for clock in clocks:
                    clock[0] += wall
                    clock[1] += cpu
                    clock[2] += 1

        return timed


@dataclass
class _Accounting:
    """Mutable state shared by a communicator and the sub-communicators split from it."""

    stats: dict = field(default_factory=new_stats)
    phase: str = "other"
    trace: list | None = None
    step: int = 0
    #: The timed trace's clock, [wall s, thread CPU s, calls] inside MPI calls, or None.
    clock: list | None = None
    #: The clocks of the :meth:`Comm.mpi_clock` blocks running, innermost last. Each block and
    #: the trace keep their own list, so that neither starts, stops nor replaces the other's.
    blocks: list = field(default_factory=list)

    def running_clocks(self) -> tuple:
        """Every clock that counts MPI calls now: the trace's and each block's."""
        return (*self.blocks, self.clock) if self.clock is not None else tuple(self.blocks)

    #: Whether ``wire="compact"`` messages round values to 16 bits (:func:`pack_wire`); shared,
    #: so that one setting covers every sub-communicator an allreducer splits off (SparDL's
    #: teams).
    quantise: bool = True

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
    """Index dtype used on the wire: block-relative int32 where every block is shorter than 2^31.

    Parameters
    ----------
    max_block_length : int
        The length of the longest block (positions).

    Returns
    -------
    numpy.dtype
        int32 when ``max_block_length`` ≤ 2^31 − 1, else int64.

    Raises
    ------
    TypeError
        If ``max_block_length`` is not an integer (Python or NumPy; a bool is not).
    ValueError
        If ``max_block_length`` is negative.
    """
    check_int_at_least("max_block_length", max_block_length, 0)
    return np.dtype(np.int32) if max_block_length <= _INT32_MAX else np.dtype(np.int64)


# -- CUDA-aware MPI ---------------------------------------------------------------------------


def _loaded_mpi_libraries() -> list[str]:
    """Paths of the MPI libraries mapped into this process (Linux: read /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libmpi" in line and "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith("libmpi"))


def _query_cuda_support() -> bool | None:
    """``MPIX_Query_cuda_support()`` of the loaded MPI library, or None where it has none."""
    for path in _loaded_mpi_libraries():
        try:
            fn = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = []
        return bool(fn())
    return None


@functools.cache
def _detect_cuda_aware() -> tuple[bool, str]:
    forced = os.environ.get("SPARDL_CUDA_AWARE", "").strip()
    if forced in ("0", "1"):
        return forced == "1", f"forced by SPARDL_CUDA_AWARE={forced}"
    if forced:
        raise ValueError(f"SPARDL_CUDA_AWARE must be 0 or 1, got {forced!r}")
    lib = MPI.Get_library_version()
    if "MVAPICH" in lib and os.environ.get("MV2_USE_CUDA") == "1":
        return True, "MVAPICH2 with MV2_USE_CUDA=1"
    if "MPICH" in lib and os.environ.get("MPIR_CVAR_ENABLE_GPU") == "0":
        return False, "MPICH with MPIR_CVAR_ENABLE_GPU=0"
    q = _query_cuda_support()
    if q is not None:
        return q, f"MPIX_Query_cuda_support() returned {int(q)}"
    return False, "no MPIX_Query_cuda_support in the MPI library: assumed not CUDA-aware"


def cuda_aware() -> bool:
    """Whether MPI calls may be given device buffers (detected once per process).

    Checked in this order:

    1. ``SPARDL_CUDA_AWARE=0`` or ``1`` in the environment forces the answer;
    2. MVAPICH2 with ``MV2_USE_CUDA=1`` (its documented switch) is CUDA-aware; MPICH with
       ``MPIR_CVAR_ENABLE_GPU=0`` (its documented switch) is not;
    3. ``MPIX_Query_cuda_support()`` of the loaded MPI library, looked up with ctypes (mpi4py
       does not wrap it): Open MPI ≥ 4.0 (``mpi-ext.h``) and MPICH ≥ 4.0 answer at run time
       whether device buffers are supported;
    4. otherwise False: messages are staged through pinned host buffers (always correct).

    Returns
    -------
    bool

    Raises
    ------
    ValueError
        If ``SPARDL_CUDA_AWARE`` is set to anything but 0 or 1.
    """
    return _detect_cuda_aware()[0]


def cuda_aware_reason() -> str:
    """How :func:`cuda_aware` decided (for ``spardl info``).

    Returns
    -------
    str
        One line naming the rule that decided (the environment variable, the MPI library's
        switch, ``MPIX_Query_cuda_support()``'s answer, or its absence).

    Raises
    ------
    ValueError
        If ``SPARDL_CUDA_AWARE`` is set to anything but 0 or 1.
    """
    return _detect_cuda_aware()[1]


def _sync() -> None:
    """Wait for the default stream: MPI must see finished device buffers."""
    from numba import cuda

    cuda.synchronize()


def _mpi_buffer(x):
    """The object handed to mpi4py for buffer ``x``. Device arrays expose
    ``__cuda_array_interface__``, which mpi4py passes to a CUDA-aware MPI as a device pointer;
    the CUDA simulator's arrays live in host memory and are passed as the NumPy array they wrap
    (so the CUDA-aware code path runs under the simulator too)."""
    if type(x).__name__ == "FakeCUDAArray":
        return x._ary
    return x


def _align8(nbytes: int) -> int:
    return (nbytes + 7) & ~7


def _check_block_fits(j: int, count: int, first: int, last: int, start: int, index_dtype):
    """ValueError unless block j of :func:`pack_blocks` fits the integer ``index_dtype`` on the
    wire: its ``count`` (> 0) pairs, and its indices relative to ``start``, which lie between
    its ``first`` and ``last`` (absolute) index since they are ascending (None: the count
    only)."""
    signed, bits = index_dtype.kind == "i", 8 * index_dtype.itemsize
    lo, hi = -signed << (bits - 1), (1 << (bits - signed)) - 1
    if count > hi:
        raise ValueError(
            f"blocks[{j}] holds {count} pairs, more than index_dtype {index_dtype} can count ({hi})"
        )
    if first is None:
        return
    first, last = first - start, last - start
    if first < lo or last > hi:
        raise ValueError(
            f"blocks[{j}]: indices relative to start {start} span {first} … {last}, "
            f"outside the range [{lo}, {hi}] of index_dtype {index_dtype}"
        )


def _check_header_counts(counts: np.ndarray) -> int:
    """The total of a received header's int64 ``counts``; ValueError if it is negative (checked
    before the buffer's length, which a negative total cannot match; :func:`_first_negative_count`
    finds the negative counts that a total of the right length hides)."""
    total = int(counts.sum())
    if total < 0:
        raise ValueError(f"received message's header announces negative counts (total {total})")
    return total


def _first_negative_count(counts: np.ndarray) -> None:
    """ValueError naming the first negative count of a received header, if any."""
    negative = np.flatnonzero(counts < 0)
    if negative.size:
        c = int(counts[negative[0]])
        raise ValueError(f"received message's header announces a negative count ({c})")


def pack_blocks(blocks, starts, index_dtype, value_dtype, *, device_range_check=True) -> np.ndarray:
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
    device_range_check : bool, default True
        Whether the indices of device blocks are checked against ``index_dtype``'s range
        (their first and last, gathered on the device: two kernel launches per block and one
        transfer). The allreducers pass False: they choose ``index_dtype`` to fit. Counts and
        host blocks are always checked (no device work).

    Returns
    -------
    ndarray of uint8
        ``[counts | indices | pad to 8 bytes | values]``. A device array when any block is on
        the device (packed there; the same bytes).

    Raises
    ------
    ValueError
        If ``blocks`` and ``starts`` differ in length, a block's values are not of its indices'
        shape, or (``index_dtype`` an integer dtype) a block's count or block-relative indices
        do not fit ``index_dtype`` (they would wrap on the wire); host and device blocks alike.

    Notes
    -----
    The "coo" wire format of docs/design.md §2.1.

    The checks cost O(number of blocks), never a pass over the data: the range check reads
    each block's first and last index, which bound the block's indices since they are
    ascending. For device blocks those two indices of every non-empty block are gathered on
    the device into one array and copied to the host at once (one small transfer per call,
    whatever the number of blocks). The allreducers choose ``index_dtype`` with
    :func:`wire_index_dtype` from their longest block's length (or n), so their indices always
    fit: they pack with ``device_range_check=False``, which leaves the device alone.
    """
    index_dtype = np.dtype(index_dtype)
    value_dtype = np.dtype(value_dtype)
    for j, (idx, val) in enumerate(blocks):  # host and device blocks alike
        if np.shape(val) != (len(idx),):
            raise ValueError(
                f"blocks[{j}]: values must have the shape of the indices, ({len(idx)},), got "
                f"{np.shape(val)}"
            )
    if any(A.is_device(a) for b in blocks for a in b):
        return _pack_device(blocks, starts, index_dtype, value_dtype, device_range_check)
    nb = len(blocks)
    counts = np.array([len(b[0]) for b in blocks], dtype=np.int64)
    total = int(counts.sum())
    isz, vsz = index_dtype.itemsize, value_dtype.itemsize
    checked = index_dtype.kind in "iu"
    head = _align8((nb + total) * isz)
    buf = np.empty(head + total * vsz, dtype=np.uint8)
    buf[(nb + total) * isz : head] = 0  # the padding: no uninitialised bytes on the wire
    ints = buf[: (nb + total) * isz].view(index_dtype)
    ints[:nb] = counts
    vals = buf[head:].view(value_dtype)
    pos = 0
    for j, ((idx, val), start) in enumerate(zip(blocks, starts, strict=True)):
        c = len(idx)
        if c and checked:  # an ascending block lies between its first and last index
            _check_block_fits(j, c, int(idx[0]), int(idx[-1]), int(start), index_dtype)
        if c:
            np.subtract(idx, start, out=ints[nb + pos : nb + pos + c], casting="unsafe")
            vals[pos : pos + c] = val
        pos += c
    return buf


def packed_capacity(nblocks: int, max_pairs: int, index_dtype, value_dtype) -> int:
    """Bytes needed to receive ``nblocks`` blocks holding at most ``max_pairs`` pairs in all.

    Parameters
    ----------
    nblocks, max_pairs : int
        Blocks in the message, and the most (index, value) pairs they hold together.
    index_dtype, value_dtype : numpy dtype
        The wire dtypes of :func:`pack_blocks`.

    Returns
    -------
    int
        The size in bytes of a :func:`pack_blocks` message of that many pairs (counts,
        indices, padding to 8 bytes, values).

    Raises
    ------
    TypeError
        If ``nblocks`` or ``max_pairs`` is not an integer (Python or NumPy; a bool is not).
    ValueError
        If ``nblocks`` or ``max_pairs`` is negative.
    """
    check_int_at_least("nblocks", nblocks, 0)
    check_int_at_least("max_pairs", max_pairs, 0)
    isz = np.dtype(index_dtype).itemsize
    return _align8((nblocks + max_pairs) * isz) + max_pairs * np.dtype(value_dtype).itemsize


def unpack_blocks(buf, nblocks, starts, index_dtype, value_dtype):
    """Inverse of :func:`pack_blocks`: a list of (int64 absolute indices, values) per block.

    A device ``buf`` is unpacked on the device (one small copy of the counts to the host) and
    gives device arrays.

    Parameters
    ----------
    buf : uint8 array of shape (nbytes,)
        A message of :func:`pack_blocks` (host or device).
    nblocks : int
        The number of blocks it holds (both sides know it).
    starts : sequence of int
        The first position of each block, added to its block-relative indices.
    index_dtype, value_dtype : numpy dtype
        The wire dtypes the sender packed with.

    Returns
    -------
    list of (indices, values)
        ``nblocks`` pairs: int64 absolute indices and the values (``value_dtype``), each of
        shape (count,); new arrays, not views of ``buf``.

    Raises
    ------
    ValueError
        If the buffer's length is not the one its own header announces, or the header
        announces a negative count (a corrupt or mismatched message; host and device ``buf``
        alike, with the same messages); if ``nblocks`` is negative, ``starts`` does not hold
        ``nblocks`` positions, or a host ``buf`` is not 1-D.
    TypeError
        If ``nblocks`` is not an integer, ``starts`` not a sequence, or ``buf`` neither a
        uint8 NumPy array nor a device array.
    """
    index_dtype = np.dtype(index_dtype)
    value_dtype = np.dtype(value_dtype)
    nblocks = check_int_at_least("nblocks", nblocks, 0)
    if not hasattr(starts, "__len__"):
        raise TypeError(f"starts must be a sequence of int, got {type_name(starts)}")
    if len(starts) != nblocks:
        raise ValueError(f"starts must hold nblocks = {nblocks} positions, got {len(starts)}")
    if A.is_device(buf):
        return _unpack_device(buf, nblocks, starts, index_dtype, value_dtype)
    if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8:
        got = f"dtype {buf.dtype}" if isinstance(buf, np.ndarray) else type_name(buf)
        raise TypeError(f"buf must be a uint8 NumPy array or a device array, got {got}")
    if buf.ndim != 1:
        raise ValueError(f"buf must be 1-D, got shape {buf.shape}")
    isz, vsz = index_dtype.itemsize, value_dtype.itemsize
    if len(buf) < nblocks * isz:
        raise ValueError("received message shorter than its block header")
    counts = buf[: nblocks * isz].view(index_dtype).astype(np.int64)
    total = _check_header_counts(counts)
    head = _align8((nblocks + total) * isz)
    if len(buf) != head + total * vsz:
        raise ValueError(
            f"received message of {len(buf)} bytes, header announces {head + total * vsz}"
        )
    _first_negative_count(counts)  # the total may still match the buffer's length
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


def _pack_device(blocks, starts, index_dtype, value_dtype, range_check=True):
    """:func:`pack_blocks` on the device: the same bytes, in one device buffer, after the same
    checks (each block's count, and the first and last index of every non-empty block, copied
    to the host together)."""
    D = A.device_ops()
    isz, vsz = index_dtype.itemsize, value_dtype.itemsize
    nb = len(blocks)
    counts = np.array([int(b[0].shape[0]) for b in blocks], dtype=np.int64)
    total = int(counts.sum())
    if index_dtype.kind in "iu":
        ends = _block_ends(D, blocks, counts, range_check)
        for j, ((first, last), start) in enumerate(zip(ends, starts, strict=True)):
            if counts[j]:
                _check_block_fits(j, int(counts[j]), first, last, int(start), index_dtype)
    head = _align8((nb + total) * isz)
    buf = D.empty(head + total * vsz, np.uint8)
    if head > (nb + total) * isz:
        D.copy_into(buf[(nb + total) * isz : head], D.zeros(head - (nb + total) * isz, np.uint8))
    if nb:
        ints = buf[: (nb + total) * isz].view(index_dtype)
        ints[:nb].copy_to_device(counts.astype(index_dtype))
    pos = 0
    for (idx, val), start in zip(blocks, starts, strict=True):
        c = int(idx.shape[0])
        if c:
            D.shift_into(ints[nb + pos : nb + pos + c], idx, -int(start))
            D.copy_into(buf[head + pos * vsz : head + (pos + c) * vsz].view(value_dtype), val)
        pos += c
    return buf


def _block_ends(D, blocks, counts, device=True) -> list:
    """``(idx[0], idx[-1])`` of every block (``None, None`` for an empty one, and for a device
    block unless ``device``) as Python ints: those of the device blocks gathered on the device
    into one int64 array of two per block (``D.concat`` of one-element views) and copied to the
    host at once."""
    parts, ends = [], []
    for (idx, _), c in zip(blocks, counts.tolist(), strict=True):
        if not c or (not device and A.is_device(idx)):
            ends.append((None, None))
        elif A.is_device(idx):
            v = D.view(idx)
            parts += [v[0:1], v[c - 1 : c]]
            ends.append(None)  # filled in from the gathered array
        else:
            ends.append((int(idx[0]), int(idx[-1])))
    if parts:
        gathered = iter(D.concat(parts, np.int64).copy_to_host().tolist())
        ends = [(next(gathered), next(gathered)) if e is None else e for e in ends]
    return ends


def _unpack_device(buf, nblocks, starts, index_dtype, value_dtype):
    """:func:`unpack_blocks` on the device: device (int64 indices, values) per block."""
    D = A.device_ops()
    buf = D.aligned(buf)
    isz, vsz = index_dtype.itemsize, value_dtype.itemsize
    nbytes = int(buf.shape[0])
    if nbytes < nblocks * isz:
        raise ValueError("received message shorter than its block header")
    counts = np.zeros(nblocks, dtype=np.int64)
    if nblocks:
        counts[:] = buf[: nblocks * isz].copy_to_host().view(index_dtype)
    total = _check_header_counts(counts)
    head = _align8((nblocks + total) * isz)
    if nbytes != head + total * vsz:
        raise ValueError(
            f"received message of {nbytes} bytes, header announces {head + total * vsz}"
        )
    _first_negative_count(counts)  # the total may still match the buffer's length
    out = []
    pos = 0
    for b in range(nblocks):
        c = int(counts[b])
        if c:
            lo = (nblocks + pos) * isz
            rel = buf[lo : lo + c * isz].view(index_dtype)
            vals = buf[head + pos * vsz : head + (pos + c) * vsz].view(value_dtype)
            out.append((D.shift(rel, int(starts[b])), D.copy(vals)))
        else:
            out.append((D.empty(0, np.int64), D.empty(0, value_dtype)))
        pos += c
    return out


# -- wire formats ------------------------------------------------------------------------------

#: The wire formats of sparse messages (docs/design.md §2.1): "coo" is :func:`pack_blocks`
#: (counts, int32/int64 block-relative indices, values in the work dtype: bit for bit);
#: "compact" is :mod:`spardl_kernels.cpu.wire` (delta-coded indices, 16-bit values).
WIRES = ("coo", "compact")


def pack_wire(blocks, starts, index_dtype, value_dtype, wire="coo", quantise=True):
    """Pack sparse blocks in the wire format ``wire``; also return what the receiver will read.

    Parameters
    ----------
    blocks : sequence of (indices, values)
        Per block, absolute int64 indices (strictly ascending) and their values (host or
        device arrays).
    starts : sequence of int
        The first position of each block (indices travel block-relative).
    index_dtype : numpy dtype
        The "coo" index dtype (:func:`wire_index_dtype`); unused by "compact".
    value_dtype : numpy dtype
        The values' dtype (the work dtype: float32 or float64 for "compact").
    wire : {"coo", "compact"}, default "coo"
        The format.
    quantise : bool, default True
        "compact" only: values in 16 bits where they fit (else raw); False sends them raw,
        unrounded (an allreducer at density 1, whose output must be the exact mean).

    Returns
    -------
    buf : uint8 array
        The message. "coo": :func:`pack_blocks` (a device array for device blocks).
        "compact": always a host array (device blocks are copied to the host to be encoded).
    delivered : list of arrays
        Per block, the values as every receiver decodes them, on the blocks' side (host or
        device). For "coo" they are the given value arrays themselves (the same objects: a
        caller tests ``delivered is values`` to know that nothing was rounded); for "compact"
        new arrays, where the 16-bit values differ from the sent ones by the rounding.

    Raises
    ------
    TypeError, ValueError
        "compact": as :func:`spardl_kernels.cpu.wire.encode_blocks` (a dtype it does not take;
        indices not strictly ascending or below their block's start, lengths that differ).
        "coo": ValueError if ``blocks`` and ``starts`` differ in length.

    Notes
    -----
    The wire formats are docs/design.md §2.1. Any ``wire`` other than "coo" is encoded as
    "compact" (the option is checked where the allreducer is built).
    """
    if wire == "coo":
        buf = pack_blocks(blocks, starts, index_dtype, value_dtype, device_range_check=False)
        return buf, [b[1] for b in blocks]
    vdt = np.dtype(value_dtype)
    dev = any(A.is_device(a) for b in blocks for a in b)
    counts = np.array([int(b[0].shape[0]) for b in blocks], dtype=np.int64)
    if len(blocks) == 1:  # no concatenation: the block's own arrays
        idx, vals = A.to_host(blocks[0][0]), np.asarray(A.to_host(blocks[0][1]), vdt)
    else:
        idx = np.empty(int(counts.sum()), np.int64)
        vals = np.empty(idx.shape[0], vdt)
        pos = 0
        for (i, v), c in zip(blocks, counts.tolist(), strict=True):
            idx[pos : pos + c] = A.to_host(i)
            vals[pos : pos + c] = A.to_host(v)
            pos += c
    st = np.array([int(x) for x in starts], dtype=np.int64)
    buf, dec = wire_codec.encode_blocks(idx, vals, counts, starts=st, quantise=quantise)
    ends = np.cumsum(counts).tolist()
    delivered = [dec[e - c : e] for e, c in zip(ends, counts.tolist(), strict=True)]
    if dev:
        delivered = [A.to_device(d) for d in delivered]
    return buf, delivered


def unpack_wire(buf, nblocks, starts, index_dtype, value_dtype, wire="coo", device=False):
    """Inverse of :func:`pack_wire`: a list of (int64 absolute indices, values) per block.

    "coo" is :func:`unpack_blocks` (device arrays for a device ``buf``). "compact" decodes on
    the host and, with ``device``, copies each block to the device.

    Parameters
    ----------
    buf : uint8 array
        The received message (host or device).
    nblocks : int
        The number of blocks it holds.
    starts : sequence of int
        The first position of each block.
    index_dtype, value_dtype : numpy dtype
        As given to :func:`pack_wire` on the sending side.
    wire : {"coo", "compact"}, default "coo"
        The format (any other value is decoded as "compact").
    device : bool, default False
        "compact" only: return device arrays.

    Returns
    -------
    list of (indices, values)
        ``nblocks`` pairs of int64 absolute indices and ``value_dtype`` values.

    Raises
    ------
    ValueError
        If the message is corrupt or does not match its header.
    TypeError
        "compact": if ``value_dtype`` is not float32 or float64
        (:func:`spardl_kernels.cpu.wire.decode_blocks`).
    """
    if wire == "coo":
        return unpack_blocks(buf, nblocks, starts, index_dtype, value_dtype)
    st = np.array([int(x) for x in starts], dtype=np.int64)
    counts, idx, vals = wire_codec.decode_blocks(
        np.ascontiguousarray(A.to_host(buf)), int(nblocks), value_dtype, st
    )
    out = []
    pos = 0
    for c in counts.tolist():
        pair = (idx[pos : pos + c], vals[pos : pos + c])
        out.append((A.to_device(pair[0]), A.to_device(pair[1])) if device else pair)
        pos += c
    return out


def wire_capacity(nblocks: int, max_pairs: int, index_dtype, value_dtype, wire="coo") -> int:
    """Bytes needed to receive ``nblocks`` blocks holding at most ``max_pairs`` pairs in all,
    in the wire format ``wire`` (:func:`packed_capacity` for "coo").

    Parameters
    ----------
    nblocks, max_pairs : int
        Blocks in the message, and the most pairs they hold together.
    index_dtype, value_dtype : numpy dtype
        The wire dtypes ("compact" uses the index dtype's size only, as its bound per gap).
    wire : {"coo", "compact"}, default "coo"
        The format (any other value is taken as "compact").

    Returns
    -------
    int
        Exact for "coo"; for "compact" an upper bound
        (:func:`spardl_kernels.cpu.wire.encoded_capacity`).

    Raises
    ------
    TypeError
        If ``nblocks`` or ``max_pairs`` is not an integer (Python or NumPy; a bool is not);
        "compact": if ``value_dtype`` is not float32 or float64.
    ValueError
        If ``nblocks`` or ``max_pairs`` is negative.
    """
    if wire == "coo":
        return packed_capacity(nblocks, max_pairs, index_dtype, value_dtype)
    check_int_at_least("nblocks", nblocks, 0)
    check_int_at_least("max_pairs", max_pairs, 0)
    isz = np.dtype(index_dtype).itemsize
    return wire_codec.encoded_capacity(nblocks, max_pairs, isz, value_dtype)


def _mpi_op(op: str):
    """The MPI reduction named ``op``; ValueError naming it for another name."""
    ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
    return ops[check_choice("op", op, tuple(ops))]


@functools.cache
def float16_sum_op() -> MPI.Op:
    """MPI's float16 sum as a user operation, reduced by a vectorised kernel.

    MPI libraries built without hardware float16 arithmetic (MPICH's wheels among them) reduce
    float16 one element at a time through software conversions: on this project's machine a
    1 M-element float16 ``Allreduce`` on 4 ranks took 55 ms, the float32 one of twice the bytes
    3.9 ms (docs/performance.md, "The 16-bit dense allreduce's own sum"). This operation gives
    MPI the same sum of each pair, rounded once to float16 (to nearest, ties to even;
    :func:`spardl_kernels.cpu.arrays.sum_half`), in one vectorised pass. It is commutative.
    MPICH reduces a user operation in ``Allreduce`` by recursive doubling (it splits a message
    only for its own operations), which sends n·log2(P) values per rank instead of about 2n;
    :func:`float16_allreduce` uses it in a reduce-scatter and an all-gather instead.

    Returns
    -------
    mpi4py.MPI.Op
        The same operation for every call in a process (``Op.Create`` is local, not
        collective), compiled before it is returned, for buffer calls (``Allreduce``,
        ``Reduce_scatter_block``, ...) on host float16 data (MPI's ``MPIX_C_FLOAT16``, mpi4py's
        typecode ``"e"``) only. Given another datatype (int16 included) the callback raises,
        and mpi4py aborts the job rather than sum the wrong bytes.

    Notes
    -----
    A user operation is called by the MPI library, with the GIL taken by mpi4py; it must not
    be given device memory (a CUDA-aware library would pass device pointers), which
    :meth:`Comm.allreduce` never does.
    """
    from spardl_kernels.cpu.arrays import sum_half

    sum_half(np.zeros(1, np.float16), np.zeros(1, np.float16))  # compiled here, not in MPI
    half = MPI.Datatype.fromcode("e")

    def reduce(inbuf, inoutbuf, datatype) -> None:
        if not datatype == half:  # int16 or uint16 data would be summed as float16 bits
            raise TypeError(f"float16_sum_op: datatype {datatype.Get_name()} is not float16")
        sum_half(np.frombuffer(inbuf, np.uint16), np.frombuffer(inoutbuf, np.uint16))

    return MPI.Op.Create(reduce, commute=True)


def _float16_buffer_error(x, out) -> Exception | None:
    """What is wrong with :func:`float16_allreduce`'s buffers on this rank, or None."""
    for name, v in (("x", x), ("out", out)):
        if not isinstance(v, np.ndarray) or v.dtype != np.float16:
            return TypeError(
                f"{name}: must be a float16 NumPy array, got "
                f"{getattr(v, 'dtype', type(v).__name__)}"
            )
        if v.ndim != 1 or not v.flags.c_contiguous:
            return ValueError(f"{name}: must be 1-D and C-contiguous, got shape {v.shape}")
    if out.shape != x.shape:
        return ValueError(f"out: length {out.shape[0]} does not match x (length {x.shape[0]})")
    if not out.flags.writeable:
        return ValueError("out: array is read-only; float16_allreduce writes the sums into it")
    return None


def float16_allreduce(comm, x: np.ndarray, out: np.ndarray, *, check: bool = True) -> np.ndarray:
    """The 16-bit allreduce: ``out`` = the float16 sum over the ranks of ``x``, as a
    reduce-scatter and an all-gather, each rank sending about 2·n·(P−1)/P values.

    ``x`` is cut into P blocks of ⌈n/P⌉ (zero-padded at the end when P does not divide n):
    ``Reduce_scatter_block`` with :func:`float16_sum_op` leaves each rank the sum of its block,
    ``Allgather`` gives every rank every block. One rank sums each block, so every rank gets
    the same bits. This is the ring allreduce's traffic, where MPICH's ``Allreduce`` with a
    user operation (any float16 sum faster than its software one) takes n·log2(P).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm or Comm
        Every rank calls this on it. A :class:`Comm` counts the agreement as a control
        message, not the data (:meth:`Comm.allreduce` counts that).
    x : ndarray of shape (n,), float16, C-contiguous, host memory
        This rank's values (the same n on every rank).
    out : ndarray of shape (n,), float16, C-contiguous, host memory
        Receives the sums; may be ``x`` itself (in place).
    check : bool, default True
        Agree before the data (one MAX allreduce of three int64, :meth:`Comm.agree_fields`)
        that every rank's buffers are valid and n is the same on every rank, so that a bad
        argument on one rank raises on every rank instead of leaving the others waiting (or,
        for another n with the same ⌈n/P⌉, summing misaligned data). ``False`` spares that
        message, as MPI's own collectives do: the caller vouches for every rank's arguments,
        and a bad one raises on its own rank only.

    Returns
    -------
    ndarray
        ``out``.

    Raises
    ------
    TypeError
        comm not a communicator; x or out not a float16 NumPy array.
    ValueError
        x or out not 1-D and C-contiguous, out read-only or of another length than x; with
        ``check``, n not the same on every rank. With ``check`` raised on every rank (the
        ranks whose own buffers are valid name the first failing rank and its message),
        before any data is sent; without it on the rank given the bad argument.

    Notes
    -----
    Each addition rounds to float16 (nearest, ties to even), in the order MPI's reduce-scatter
    chooses, as MPI's own float16 sum does; a NaN sum is float16's quiet NaN 0x7E00
    (:func:`spardl_kernels.cpu.arrays.sum_half`).
    """
    check_bool("check", check)
    if not callable(getattr(comm, "Reduce_scatter_block", None)) and not isinstance(comm, Comm):
        raise TypeError(
            f"comm: must be an mpi4py intracommunicator or a spardl.comm.Comm, "
            f"got {type(comm).__name__}"
        )
    err = _float16_buffer_error(x, out)
    if check:
        c = comm if isinstance(comm, Comm) else Comm(comm, dup=False)
        n = x.shape[0] if err is None else -1
        ok, same = c.agree_fields(err is None, [n])
        if not ok:  # one all-gather, on failure only: every rank learns the first failing one
            bad = c.allgather_object(None if err is None else (type(err).__name__, str(err)))
            if err is not None:
                raise err
            r, (kind, msg) = next((r, b) for r, b in enumerate(bad) if b is not None)
            exc = TypeError if kind == "TypeError" else ValueError
            raise exc(f"rank {r} rejected its arguments ({kind}: {msg})")
        if not same:
            lengths = c.allgather_object(n)
            raise ValueError(f"x: length differs across ranks (rank r's at index r): {lengths}")
    elif err is not None:
        raise err
    if isinstance(comm, Comm):
        comm = comm._clocked
    P, n = comm.Get_size(), x.shape[0]
    if P == 1:
        if out is not x:
            out[...] = x
        return out
    m = -(-n // P)
    whole = m * P == n
    if whole:
        send = x
    else:
        send = np.zeros(m * P, np.float16)
        send[:n] = x
    block = np.empty(m, np.float16)
    comm.Reduce_scatter_block(send, block, op=float16_sum_op())
    full = out if whole else np.empty(m * P, np.float16)
    comm.Allgather(block, full)  # x is no longer read: out may be x
    if not whole:
        out[...] = full[:n]
    return out


def _checked_out(out, x: np.ndarray) -> np.ndarray:
    """``out``, a host result buffer for ``x`` (:meth:`Comm.allreduce`), checked: an ndarray
    of x's dtype and shape, C-contiguous and writeable; errors name ``out``."""
    if not isinstance(out, np.ndarray) or out.dtype != x.dtype:
        raise TypeError(
            f"out: must be a NumPy array of x's dtype {x.dtype}, got "
            f"{getattr(out, 'dtype', type(out).__name__)}"
        )
    if out.shape != x.shape or not out.flags.c_contiguous:
        raise ValueError(f"out: must be C-contiguous of x's shape {x.shape}, got {out.shape}")
    if not out.flags.writeable:
        raise ValueError("out: array is read-only; allreduce writes the result into it")
    return out


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
        If ``mpi_comm`` is not an mpi4py intracommunicator, or ``dup`` is not a bool.
    """

    def __init__(self, mpi_comm, *, dup: bool = True, _acct: _Accounting | None = None):
        check_bool("dup", dup)
        if isinstance(mpi_comm, Comm):
            mpi_comm = mpi_comm._mpi
        if not isinstance(mpi_comm, MPI.Intracomm):
            raise TypeError(
                f"comm must be an mpi4py intracommunicator (e.g. MPI.COMM_WORLD), "
                f"got {type(mpi_comm).__name__}"
            )
        self._mpi = mpi_comm.Dup() if dup else mpi_comm
        self._owns = dup
        self.rank = self._mpi.Get_rank()
        self.size = self._mpi.Get_size()
        self._acct = _acct if _acct is not None else _Accounting()
        self._pinned: dict = {}  # slot -> pinned host staging buffer (uint8), grown as needed
        self._users = 0  # allreducers built on this communicator so far (:meth:`new_user`)

    def new_user(self) -> int:
        """The number of the allreducer being built on this communicator: 1, 2, ... in the
        order they are built. Building is collective, so the same allreducer has the same
        number on every rank; each call's cross-rank check compares it, so that allreducers
        sharing this communicator called in another order on another rank raise instead of
        exchanging each other's data."""
        self._users += 1
        return self._users

    @property
    def quantise(self) -> bool:
        """Whether ``wire="compact"`` messages round values to 16 bits (:func:`pack_wire`).

        An allreducer sets it for each step: off at density 1, where nothing is dropped and the
        output must be the exact mean. It is shared with every communicator split from this one
        (and the one it was split from), so the setting reaches all of an allreducer's messages.
        """
        return self._acct.quantise

    @quantise.setter
    def quantise(self, value: bool) -> None:
        self._acct.quantise = check_bool("quantise", value)

    @property
    def _clocked(self):
        """The wrapped mpi4py communicator, through a timing proxy while a clock runs
        (:meth:`start_trace` with ``timed=True``, :meth:`mpi_clock`): every MPI call of this
        class goes through it, and nothing outside this module reaches mpi4py."""
        clocks = self._acct.running_clocks()
        return _TimedMPI(self._mpi, clocks) if clocks else self._mpi

    # -- wire buffers -------------------------------------------------------------------------
    # The one place that decides how an array meets MPI; every data method below asks these
    # four. A host array goes to MPI as it is. A device array goes as it is to a CUDA-aware MPI
    # (after the default stream is synchronised), else through this Comm's pinned staging
    # buffers: one device-to-host copy before the call, one host-to-device copy after it. A
    # wire buffer is handed to mpi4py as ``_mpi_buffer(buf)``.
    def _stage(self, slot: str, nbytes: int) -> np.ndarray:
        """A pinned host buffer of at least ``nbytes`` for ``slot`` ("send" or "recv"), reused
        between calls and grown (doubling) when too small."""
        buf = self._pinned.get(slot)
        if buf is None or buf.nbytes < nbytes:
            from numba import cuda

            size = max(int(nbytes), 2 * (0 if buf is None else buf.nbytes), 256)
            buf = self._pinned[slot] = cuda.pinned_array(size, dtype=np.uint8)
        return buf[:nbytes]

    def _send_wire(self, x, slot: str = "send"):
        """What MPI reads for array ``x``: ``x`` itself (a host array, or a device array when
        CUDA-aware), else a pinned host copy of it (this Comm's own: a reduction may overwrite
        it)."""
        if not A.is_device(x):
            return x
        _sync()
        if cuda_aware():
            return x
        h = self._stage(slot, x.nbytes).view(x.dtype)
        x.copy_to_host(h)
        return h

    def _recv_wire(self, count: int, dtype, device: bool, slot: str = "recv"):
        """Where MPI writes ``count`` items of a result: a new host array; for a ``device``
        result a new device array when CUDA-aware, else a pinned host buffer."""
        dtype = np.dtype(dtype)
        if not device:
            return np.empty(count, dtype=dtype)
        if cuda_aware():
            _sync()
            return A.empty(count, dtype, True)
        return self._stage(slot, count * dtype.itemsize).view(dtype)

    def _inplace_wire(self, x, read: bool, slot: str = "send"):
        """Where MPI reads and writes array ``x`` in place (a broadcast's buffer): ``x`` itself
        (a host array, or a device array when CUDA-aware), else a pinned host buffer of its
        size, holding a copy of ``x`` when ``read`` (MPI reads it: a broadcast's root)."""
        if read or not A.is_device(x) or cuda_aware():
            return self._send_wire(x, slot)
        return self._stage(slot, x.nbytes).view(x.dtype)

    @staticmethod
    def _wire_result(buf, device: bool, into=None):
        """The array MPI wrote into wire buffer ``buf``, on the caller's side: ``buf`` itself
        (host, or a device buffer), or for a ``device`` result that was staged a copy on the
        device (into the device array ``into`` when given)."""
        if not (device and isinstance(buf, np.ndarray)):
            return buf
        if into is None:
            return A.to_device(buf)
        into.copy_to_device(buf)
        return into

    # -- accounting -------------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        """Cumulative message and byte counters (see module docstring).

        dict: ``messages``, ``bytes_sent``, ``bytes_received``, ``control_messages`` and
        ``phases`` (:func:`new_stats`), the live mapping, shared with every communicator split
        from this one; never reset by this class.
        """
        return self._acct.stats

    @contextlib.contextmanager
    def phase(self, name: str):
        """Attribute every message inside the ``with`` block to phase ``name``.

        Parameters
        ----------
        name : str
            The phase name, the key of ``stats["phases"]`` and the trace records' ``phase``.

        Yields
        ------
        None
            The previous phase is restored when the block ends (also on an exception). The
            phase is shared with the communicators split from this one.
        """
        prev = self._acct.phase
        self._acct.phase = name
        try:
            yield
        finally:
            self._acct.phase = prev

    @property
    def tracing(self) -> bool:
        """Whether a trace is being recorded on this communicator (or one it shares state with).

        bool: True between :meth:`start_trace` and :meth:`stop_trace`.
        """
        return self._acct.trace is not None

    def start_trace(self, timed: bool = False) -> list | None:
        """Record every message as (step, phase, kind, peer, bytes) from now on.

        With ``timed``, also clock every MPI call of this communicator and of those split from
        it: returns the live list ``[wall seconds, thread-CPU seconds, calls]`` spent inside MPI
        (busy-polling included), summed until :meth:`stop_trace`. Without it returns None.

        A trace already running is discarded and started afresh (:func:`spardl.trace.record`
        refuses to nest).

        Parameters
        ----------
        timed : bool, default False
            Also clock the MPI calls.

        Returns
        -------
        list or None
            The live clock ``[wall seconds (float), thread-CPU seconds (float), calls (int)]``
            when ``timed``, else None.

        Raises
        ------
        TypeError
            If ``timed`` is not a bool.
        """
        check_bool("timed", timed)
        self._acct.trace = []
        self._acct.clock = [0.0, 0.0, 0] if timed else None
        return self._acct.clock

    def stop_trace(self) -> list:
        """Stop recording (and clocking) and return the recorded messages.

        Returns
        -------
        list of tuple
            ``(step, phase, kind, peer, bytes)`` per message this rank sent since
            :meth:`start_trace`, in order (``peer`` −1 for a collective); an empty list when
            no trace was running.
        """
        trace, self._acct.trace = self._acct.trace or [], None
        self._acct.clock = None
        return trace

    @contextlib.contextmanager
    def mpi_clock(self):
        """Clock the MPI calls made inside the ``with`` block (on this communicator and those
        that share its accounting: split from it, or allreducers built on it).

        Yields
        ------
        list
            ``[wall seconds, thread-CPU seconds, calls]`` spent inside MPI calls in the block
            (busy-polling included), filled in when the block ends.

        Notes
        -----
        Inside a timed trace (:meth:`start_trace` with ``timed=True``) or another
        ``mpi_clock`` block, the outer clock goes on counting these calls too; the yielded
        list holds the block's share. A trace started or stopped inside the block neither
        stops nor restarts the block's clock, and the block's end leaves the trace's running.
        """
        blocks = self._acct.blocks
        counting = [0.0, 0.0, 0]
        spent = [0.0, 0.0, 0]
        blocks.append(counting)
        try:
            yield spent
        finally:
            # By identity: list.remove compares values, and another block's may be equal.
            del blocks[next(i for i, b in enumerate(blocks) if b is counting)]
            spent[:] = counting

    def next_step(self) -> None:
        """Advance the step counter used in traces.

        The counter is shared with the communicators split from this one; it starts at 0.
        """
        self._acct.step += 1

    def split(self, color: int, key: int) -> Comm:
        """Split into sub-communicators that share this one's accounting.

        Collective (``MPI_Comm_split``). The new :class:`Comm` shares ``stats``, the phase,
        the trace, the step counter, the clock and :attr:`quantise` with this one, and owns its
        MPI communicator (:meth:`free` frees it).

        Parameters
        ----------
        color : int
            Ranks with the same color end in the same sub-communicator.
        key : int
            Orders the ranks within it.

        Returns
        -------
        Comm
        """
        sub = self._mpi.Split(color, key)
        c = Comm(sub, dup=False, _acct=self._acct)
        c._owns = True
        return c

    @property
    def freed(self) -> bool:
        """Whether the MPI communicator was freed (by :meth:`free`, or outside)."""
        return self._mpi == MPI.COMM_NULL

    def free(self) -> None:
        """Free the duplicated communicator (idempotent).

        Frees the MPI communicator only when this :class:`Comm` made it (a duplicate, or a
        :meth:`split`); one given with ``dup=False`` is left alone.
        """
        if self._owns and self._mpi != MPI.COMM_NULL:
            self._mpi.Free()
            self._owns = False

    # -- point to point ---------------------------------------------------------------------
    def sendrecv_bytes(
        self, sendbuf: np.ndarray, dest: int, source: int, capacity: int, tag: int = 0
    ) -> np.ndarray:
        """Send ``sendbuf`` to ``dest`` and receive at most ``capacity`` bytes from ``source``.

        The received size is read from the MPI status, so variable-size messages need no count
        message. Returns the received bytes (a view of a fresh buffer; a device array when
        ``sendbuf`` is one).

        Parameters
        ----------
        sendbuf : uint8 array
            The bytes to send (contiguous; host or device); ``sendbuf.nbytes`` are counted
            as sent.
        dest, source : int
            The ranks sent to and received from.
        capacity : int
            The most bytes the incoming message may hold.
        tag : int, default 0
            The tag of both messages.

        Returns
        -------
        uint8 array of shape (received bytes,)

        Raises
        ------
        mpi4py.MPI.Exception
            If the incoming message is longer than ``capacity`` (``MPI_ERR_TRUNCATE``, under
            mpi4py's default error handler ``ERRORS_RETURN``).
        """
        device = A.is_device(sendbuf)
        sendbuf = A.view(sendbuf)
        send = self._send_wire(sendbuf)
        recv = self._recv_wire(max(int(capacity), 1), np.uint8, device)
        status = MPI.Status()
        self._clocked.Sendrecv(
            [_mpi_buffer(send), MPI.BYTE],
            dest,
            tag,
            [_mpi_buffer(recv), MPI.BYTE],
            source,
            tag,
            status=status,
        )
        nrecv = status.Get_count(MPI.BYTE)
        self._acct.sent(sendbuf.nbytes, dest, "p2p")
        self._acct.received(nrecv)
        return self._wire_result(recv[:nrecv], device)

    def send_bytes(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        """One-way send of a byte buffer to ``dest`` (tree algorithms: a child to its parent).

        Parameters
        ----------
        buf : array
            A device array (its bytes), or anything NumPy converts to a uint8 array (host).
        dest : int
            The receiving rank.
        tag : int, default 0
            The message tag.
        """
        buf = A.view(buf) if A.is_device(buf) else np.ascontiguousarray(buf, dtype=np.uint8)
        self._clocked.Send([_mpi_buffer(self._send_wire(buf)), MPI.BYTE], dest, tag)
        self._acct.sent(buf.nbytes, dest, "p2p")

    def recv_bytes(
        self, source: int, capacity: int, tag: int = 0, *, device: bool = False
    ) -> np.ndarray:
        """Receive at most ``capacity`` bytes from ``source``; the size is read from the status.
        With ``device``, the bytes are returned as a device array.

        Parameters
        ----------
        source : int
            The sending rank.
        capacity : int
            The most bytes the message may hold.
        tag : int, default 0
            The message tag.
        device : bool, default False
            Return a device array.

        Returns
        -------
        uint8 array of shape (received bytes,)

        Raises
        ------
        mpi4py.MPI.Exception
            If the message is longer than ``capacity`` (``MPI_ERR_TRUNCATE``).
        """
        recv = self._recv_wire(max(int(capacity), 1), np.uint8, device)
        status = MPI.Status()
        self._clocked.Recv([_mpi_buffer(recv), MPI.BYTE], source, tag, status=status)
        nrecv = status.Get_count(MPI.BYTE)
        self._acct.received(nrecv)
        return self._wire_result(recv[:nrecv], device)

    def exchange_blocks(
        self,
        dest,
        send_blocks,
        send_starts,
        source,
        recv_starts,
        max_pairs,
        index_dtype,
        value_dtype,
        tag: int = 0,
        *,
        wire: str = "coo",
        sent: list | None = None,
    ):
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
        wire : {"coo", "compact"}, default "coo"
            The wire format (:func:`pack_wire`); both sides must use the same.
        sent : list, optional
            Extended with one array per sent block: its values as the receiver decodes them
            (for "coo" the sent value arrays themselves; see :func:`pack_wire`).

        Returns
        -------
        list of (int64 indices, values)
            One pair per received block, in block order (device arrays when the sent blocks
            are on the device).

        Raises
        ------
        ValueError
            If the received message does not match its header (:func:`unpack_wire`), or
            ``send_blocks`` and ``send_starts`` differ in length.
        mpi4py.MPI.Exception
            If the incoming message is longer than the capacity ``max_pairs`` gives.
        """
        if wire == "coo":
            buf = pack_blocks(
                send_blocks, send_starts, index_dtype, value_dtype, device_range_check=False
            )
            if sent is not None:
                sent.extend(b[1] for b in send_blocks)
            cap = packed_capacity(len(recv_starts), max_pairs, index_dtype, value_dtype)
            got = self.sendrecv_bytes(buf, dest, source, cap, tag)
            return unpack_blocks(got, len(recv_starts), recv_starts, index_dtype, value_dtype)
        device = any(A.is_device(a) for b in send_blocks for a in b)
        buf, delivered = pack_wire(
            send_blocks, send_starts, index_dtype, value_dtype, wire, quantise=self.quantise
        )
        if sent is not None:
            sent.extend(delivered)
        cap = wire_capacity(len(recv_starts), max_pairs, index_dtype, value_dtype, wire)
        got = self.sendrecv_bytes(buf, dest, source, cap, tag)
        return unpack_wire(
            got, len(recv_starts), recv_starts, index_dtype, value_dtype, wire, device
        )

    # -- collectives ------------------------------------------------------------------------
    def allreduce(
        self, x: np.ndarray, op: str = "sum", out: np.ndarray | None = None
    ) -> np.ndarray:
        """Dense allreduce of a contiguous 1-D array; returns a new array (on the device for a
        device ``x``).

        For a host ``x``, ``out`` (a contiguous host array like ``x``) receives the result
        instead, and is returned; ``out is x`` reduces in place (``MPI_IN_PLACE``: no copy of
        ``x`` and no new buffer). Ignored for a device ``x``.

        Parameters
        ----------
        x : 1-D array
            This rank's contribution (host or device; same shape and dtype on every rank).
        op : {"sum", "max", "min"}, default "sum"
            The reduction.
        out : ndarray, optional
            Host only: where the result goes (``x`` itself for in place).

        Returns
        -------
        array
            The elementwise reduction over the ranks, shape and dtype of ``x``.

        Raises
        ------
        TypeError
            A host ``out`` not an ndarray of ``x``'s dtype (before any message).
        ValueError
            If ``op`` is not one of the three, or a host ``out`` not C-contiguous of ``x``'s
            shape or read-only (before any message).
        """
        mpi_op = _mpi_op(op)
        device = A.is_device(x)
        if device:
            x = A.view(x)
            send = self._send_wire(x)
            if send is x:  # CUDA-aware: into a new device buffer
                recv = self._recv_wire(x.shape[0], x.dtype, True)
            else:  # a staged copy, this Comm's own: reduced in place
                send, recv = MPI.IN_PLACE, send
        elif out is not None and out is x:
            send, recv = MPI.IN_PLACE, x
        else:
            send = x = np.ascontiguousarray(x)
            recv = np.empty_like(x) if out is None else _checked_out(out, x)
        if mpi_op is MPI.SUM and isinstance(recv, np.ndarray) and recv.dtype == np.float16:
            # A host float16 sum: vectorised, not the library's software one.
            flat = recv.reshape(-1)
            src = flat if send is MPI.IN_PLACE else send.reshape(-1)
            float16_allreduce(self._clocked, src, flat, check=False)
        else:
            self._clocked.Allreduce(_mpi_buffer(send), _mpi_buffer(recv), op=mpi_op)
        out = self._wire_result(recv, device)
        vol = 2 * x.nbytes * (self.size - 1) // self.size
        self._acct.sent(vol, -1, "allreduce")
        self._acct.received(vol)
        return out

    def allgather_array(self, x: np.ndarray) -> np.ndarray:
        """All-gather equal-size arrays: returns shape (P,) + x.shape (a device array for a 1-D
        device ``x``).

        Parameters
        ----------
        x : array
            This rank's array (the same shape and dtype on every rank).

        Returns
        -------
        array of shape (P,) + x.shape
            Row r is rank r's ``x``.
        """
        device = A.is_device(x)
        x = A.view(x) if device else np.ascontiguousarray(x)
        send = self._send_wire(x)
        recv = self._recv_wire(self.size * math.prod(x.shape), x.dtype, device)
        self._clocked.Allgather(_mpi_buffer(send), _mpi_buffer(recv))
        out = self._wire_result(recv, device).reshape((self.size, *x.shape))
        vol = x.nbytes * (self.size - 1)
        self._acct.sent(vol, -1, "allgather")
        self._acct.received(vol)
        return out

    def allgatherv_bytes(self, buf: np.ndarray, pad: bool = False) -> list[np.ndarray]:
        """All-gather variable-size byte buffers (sizes first, then the data): 2 messages.
        Device ``buf``: the rows are slices of one device buffer.

        With ``pad`` (host buffers of nearly equal sizes, as compact messages are), every
        buffer is zero-padded to the largest and one fixed-size ``Allgather`` moves them, counted
        as (P−1)·largest bytes sent and received: MPICH's ``Allgatherv`` of uneven sizes took
        15–35× the time of the ``Allgather`` of the padded buffers over shared memory here
        (4 ranks, 0.8–2 MB each).

        Parameters
        ----------
        buf : uint8 array
            This rank's bytes (host or device; any size, 0 included).
        pad : bool, default False
            Host ``buf`` only: pad to the largest and use one ``Allgather`` (ignored for a device
            ``buf``).

        Returns
        -------
        list of P uint8 arrays
            Rank r's bytes at index r (views of one receive buffer).

        Notes
        -----
        docs/design.md §2.1 ("Messages") on the padded all-gather.
        """
        sizes = self.allgather_array(np.array([buf.nbytes], dtype=np.int64))[:, 0]
        if pad and not A.is_device(buf):
            m = max(int(sizes.max()), 1)
            send = np.zeros(m, dtype=np.uint8)
            send[: buf.nbytes] = buf
            recv = np.empty(m * self.size, dtype=np.uint8)
            self._clocked.Allgather([send, MPI.BYTE], [recv, MPI.BYTE])
            vol = m * (self.size - 1)
            self._acct.sent(vol, -1, "allgather")
            self._acct.received(vol)
            return [recv[r * m : r * m + sizes[r]] for r in range(self.size)]
        displs = np.zeros(self.size, dtype=np.int64)
        np.cumsum(sizes[:-1], out=displs[1:])
        total = int(sizes.sum())
        device = A.is_device(buf)
        buf = A.view(buf)
        send = self._send_wire(buf)
        recv = self._recv_wire(max(total, 1), np.uint8, device)
        self._clocked.Allgatherv(
            [_mpi_buffer(send), MPI.BYTE], [_mpi_buffer(recv), (sizes, displs), MPI.BYTE]
        )
        recv = self._wire_result(recv, device)
        vol = total - int(buf.nbytes)
        self._acct.sent(vol, -1, "allgatherv")
        self._acct.received(vol)
        return [recv[displs[r] : displs[r] + sizes[r]] for r in range(self.size)]

    def allgatherv_sparse(self, indices, values, index_dtype=np.int64):
        """All-gather one sparse vector per rank; returns a list of (int64 indices, values).

        One :func:`pack_blocks` block per rank (start 0), moved by :meth:`allgatherv_bytes`
        (2 messages).

        Parameters
        ----------
        indices : int64 array of shape (k,)
            This rank's indices, ascending (each must fit ``index_dtype``).
        values : array of shape (k,)
            Their values; the same dtype on every rank.
        index_dtype : numpy dtype, default int64
            The wire dtype of counts and indices.

        Returns
        -------
        list of P (indices, values)
            Rank r's int64 indices and values at index r (device arrays for device inputs).

        Raises
        ------
        ValueError
            If a received message does not match its header (:func:`unpack_blocks`).
        """
        buf = pack_blocks(
            [(indices, values)], [0], index_dtype, values.dtype, device_range_check=False
        )
        return [
            unpack_blocks(b, 1, [0], index_dtype, values.dtype)[0]
            for b in self.allgatherv_bytes(buf)
        ]

    def bcast(self, x: np.ndarray, root: int) -> np.ndarray:
        """Broadcast a contiguous array from ``root``; every rank passes a buffer of that shape
        (a 1-D device array is received in place on the device).

        Parameters
        ----------
        x : array
            On ``root``, the data; elsewhere the buffer to receive into (same shape and
            dtype).
        root : int
            The sending rank.

        Returns
        -------
        array
            The buffer holding root's data: a contiguous host ``x`` itself (a host ``x`` that
            is not contiguous is received into a contiguous copy, which is returned), or for a
            device ``x`` its zero-copy Numba view.
        """
        device = A.is_device(x)
        x = A.view(x) if device else np.ascontiguousarray(x)
        buf = self._inplace_wire(x, read=self.rank == root)
        self._clocked.Bcast(_mpi_buffer(buf), root=root)
        if self.rank != root:
            self._wire_result(buf, device, into=x)
        # A broadcast moves (P - 1)·m bytes in all; each rank is charged its share, the
        # remainder of the division one byte each to the ranks after the root, so the ranks'
        # bytes sent add up to their bytes received.
        share, extra = divmod(x.nbytes * (self.size - 1), self.size)
        self._acct.sent(share + int((self.rank - root) % self.size < extra), -1, "bcast")
        if self.rank != root:
            self._acct.received(x.nbytes)
        return x

    def bcast_bytes(self, buf: np.ndarray | None, root: int) -> np.ndarray:
        """Broadcast a variable-size byte buffer from ``root`` (size first): 2 messages.

        Parameters
        ----------
        buf : uint8 array or None
            The bytes on ``root`` (required there); ignored elsewhere (None is fine).
        root : int
            The sending rank.

        Returns
        -------
        uint8 array
            Root's bytes: on ``root`` its ``buf``, elsewhere a new host array of that size.

        Raises
        ------
        TypeError
            On every rank, after the size message, if ``buf`` on ``root`` is not a 1-D uint8
            array (root sends a size of -1 instead, so no rank waits for the second message).
        """
        bad = self.rank == root and not (
            isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.ndim == 1
        )
        size = np.array([-1 if bad else (0 if buf is None else buf.nbytes)], dtype=np.int64)
        self.bcast(size, root)
        if size[0] < 0:
            raise TypeError(
                f"bcast_bytes: buf on the root rank {root} must be a 1-D uint8 array"
                + (f", got {type(buf).__name__}" if bad else "")
            )
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
            Values that must be equal on every rank (hashed names, sizes, counters), as many on
            every rank; any value at all is taken (:func:`signature_field`), so no rank fails
            here while the others wait.

        Returns
        -------
        (all_ok, same)
            Whether every rank passed, and whether every rank gave the same signature.
        """
        return self.agree_fields(ok, [signature_field(v) for v in signature])

    def agree_fields(self, ok: bool, sig: list[int]) -> tuple[bool, bool]:
        """:meth:`agree` of a signature already made of :func:`signature_field` values (Python
        ints in (-(2**63), 2**63)), as :func:`spardl.algorithms.base.collective_check` makes
        it: no second conversion on every step.

        One MAX allreduce of 1 + 2·len(sig) int64 (the flag, the fields and their negations),
        counted as one control message.

        Parameters
        ----------
        ok : bool
            This rank's local validation result.
        sig : list of int
            The fields; the same length on every rank.

        Returns
        -------
        (all_ok, same) : (bool, bool)
            Whether every rank passed, and whether every rank gave the same fields.
        """
        # max(v) == -max(-v) iff every rank holds the same v: one MAX allreduce answers both
        # (-2**63, whose negation wraps, never occurs: signature_field's range). A handful of
        # integers: built and compared as Python lists (this runs on every step).
        v = np.array([0 if ok else 1, *sig, *[-f for f in sig]], dtype=np.int64)
        out = np.empty_like(v)
        self._clocked.Allreduce(v, out, op=MPI.MAX)
        self.stats["control_messages"] += 1
        m = len(sig)
        got = out.tolist()
        return got[0] == 0, got[1 : 1 + m] == [-f for f in got[1 + m :]]

    def abort(self, code: int = 1) -> None:
        """Abort every process of the communicator (used when a rank fails mid-collective).

        Parameters
        ----------
        code : int, default 1
            The error code passed to ``MPI_Abort``, and this process's exit status should
            ``MPI_Abort`` return (it never returns: :func:`_mpi_abort`).
        """
        _mpi_abort(self._mpi, code)

    # -- Python objects -----------------------------------------------------------------------
    # Pickled by mpi4py (its lower-case methods), on the host: for states, reports, decisions
    # and measurements, never for an algorithm's data, which travels in the buffer methods above
    # (their accounting and their GPU policy; an array inside an object travels pickled).
    # Clocked like every call here.
    # Not counted in ``stats`` unless ``control`` (one control message per call): what an
    # allreducer's stats count is its own traffic, not the checkpoints or traces around it.
    def _object_call(self, name: str, control: bool, *args, **kwargs):
        if control:
            self.stats["control_messages"] += 1
        return getattr(self._clocked, name)(*args, **kwargs)

    def barrier(self, *, control: bool = False) -> None:
        """Wait until every rank has called it (``MPI_Barrier``).

        Parameters
        ----------
        control : bool, default False
            Count one control message in ``stats``.
        """
        self._object_call("Barrier", control)

    def allgather_object(self, obj, *, control: bool = True):
        """All-gather one picklable Python object per rank.

        Parameters
        ----------
        obj : object
            This rank's object.
        control : bool, default True
            Count one control message in ``stats`` (the default: its callers in the allreducers
            exchange the reports of a cross-rank consistency check); False for bookkeeping.

        Returns
        -------
        list
            P objects, rank r's at index r, on every rank.
        """
        return self._object_call("allgather", control, obj)

    def bcast_object(self, obj, root: int, *, control: bool = False):
        """Broadcast a picklable Python object from ``root``.

        Parameters
        ----------
        obj : object
            The object on ``root``; ignored on the other ranks.
        root : int
            The sending rank.
        control : bool, default False
            Count one control message in ``stats``.

        Returns
        -------
        object
            Root's object, on every rank (a copy on the others).
        """
        return self._object_call("bcast", control, obj, root=root)

    def gather_object(self, obj, root: int, *, control: bool = False) -> list | None:
        """Gather one picklable Python object per rank on ``root``.

        Parameters
        ----------
        obj : object
            This rank's object.
        root : int
            The receiving rank.
        control : bool, default False
            Count one control message in ``stats``.

        Returns
        -------
        list or None
            On ``root``, P objects (rank r's at index r); None on the other ranks.
        """
        return self._object_call("gather", control, obj, root=root)

    def scatter_object(self, objs, root: int, *, control: bool = False):
        """Send ``objs[r]`` from ``root`` to each rank r.

        Parameters
        ----------
        objs : sequence of P objects or None
            On ``root``, one picklable object per rank; ignored on the other ranks.
        root : int
            The sending rank.
        control : bool, default False
            Count one control message in ``stats``.

        Returns
        -------
        object
            This rank's object.
        """
        return self._object_call("scatter", control, objs, root=root)

    def send_object(self, obj, dest: int, tag: int = 0, *, control: bool = False) -> None:
        """Send a picklable Python object to ``dest`` (blocking; :meth:`recv_object` receives
        it).

        Parameters
        ----------
        obj : object
            What to send.
        dest : int
            The receiving rank.
        tag : int, default 0
            The message tag, matched by the receive.
        control : bool, default False
            Count one control message in ``stats``.
        """
        self._object_call("send", control, obj, dest=dest, tag=tag)

    def recv_object(self, source: int, tag: int = 0, *, control: bool = False):
        """Receive the object :meth:`send_object` sent from ``source`` with ``tag``.

        Parameters
        ----------
        source : int
            The sending rank.
        tag : int, default 0
            The message tag.
        control : bool, default False
            Count one control message in ``stats``.

        Returns
        -------
        object
        """
        return self._object_call("recv", control, source=source, tag=tag)


_DIGEST_BASE = -(2**62)


def signature_digest(data) -> int:
    """A 62-bit digest of ``data`` (bytes, or a string) as a signature field: an integer in
    [-(2**63) + 2, -(2**62)], a range that the fields the library sends (sizes, counters,
    hashed names, small differences) never reach, so a digest cannot pass for one of them.

    Parameters
    ----------
    data : bytes or str
        What to digest (a string as its UTF-8 bytes).

    Returns
    -------
    int
        ``-(2**62) - h % (2**62 - 1)`` for ``h`` the 64-bit BLAKE2b digest of ``data``
        (little-endian).
    """
    if isinstance(data, str):
        data = data.encode()
    h = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return _DIGEST_BASE - h % (2**62 - 1)


def signature_field(v) -> int:
    """A value as one int64 field of :meth:`Comm.agree`'s signature: an integer (Python or
    NumPy, not a bool) in (-(2**63), 2**63) as itself, so a field maps to itself; anything else
    (an integer past int64, a bool, a float, a string) as :func:`signature_digest` of its type
    and ``repr``. Equal values give equal fields; different values give different fields (but
    for digest collisions, one in 2**62).

    Parameters
    ----------
    v : object
        Any value.

    Returns
    -------
    int
        A Python int in (-(2**63), 2**63).
    """
    if type(v) is int:  # the common case first: a Python int, not a bool (a subclass)
        if -(2**63) < v < 2**63:
            return v
    elif isinstance(v, (int, np.integer)) and not isinstance(v, bool) and -(2**63) < v < 2**63:
        return int(v)
    return signature_digest(f"{type(v).__qualname__}:{v!r}")


@functools.lru_cache(maxsize=4096)
def name_hash(name: str) -> int:
    """A stable 62-bit hash of a string, in [0, 2**62), for signatures compared across ranks
    (names, option lists: a CRC's 31 bits let two different option lists agree once in about
    two billion; these, once in 4.6·10¹⁸).

    Parameters
    ----------
    name : str
        The string (hashed as its UTF-8 bytes).

    Returns
    -------
    int
        The top 62 bits of its 64-bit BLAKE2b digest (little-endian); cached per string.
    """
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 2


@contextlib.contextmanager
def abort_on_exception(comm, code: int = 1, reraise=()):
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
    reraise : exception type or tuple of them, optional
        Exceptions that pass through without an abort: only those that every rank raises at
        the same point, before or outside any collective (option checks made from the options
        and P alone).

    Raises
    ------
    TypeError
        On entering, if ``comm`` is not an mpi4py communicator or a :class:`Comm`, ``code``
        not an integer, or ``reraise`` not an exception type or a tuple of them: checked
        before the body runs, since a bad ``reraise`` would otherwise fail only when the body
        raises, and end this rank without the abort that frees the others.

    Notes
    -----
    ``SystemExit`` with status 0 or None (a clean ``sys.exit()``) passes through untouched.
    """
    if not isinstance(comm, (Comm, MPI.Comm)):
        raise TypeError(
            f"comm must be an mpi4py communicator or a spardl Comm, got {type_name(comm)}"
        )
    check_int("code", code)
    types = reraise if isinstance(reraise, tuple) else (reraise,)
    if not all(isinstance(t, type) and issubclass(t, BaseException) for t in types):
        raise TypeError(f"reraise must be an exception type or a tuple of them, got {reraise!r}")
    try:
        yield
    except reraise:
        raise
    except SystemExit as e:
        if e.code not in (0, None):
            _abort(comm, code)
        raise
    except BaseException:  # noqa: BLE001 - whatever one rank raises must end the whole job
        _abort(comm, code)


def _abort(comm, code: int) -> NoReturn:
    import sys
    import time
    import traceback

    rank = comm.rank if isinstance(comm, Comm) else comm.Get_rank()
    sys.stdout.flush()
    sys.stderr.flush()
    # The report goes out in one unbuffered write, and the process manager gets a moment to
    # forward it: MPI_Abort tears the job down at once and can drop output still in flight.
    report = f"spardl: rank {rank} failed; aborting every rank\n" + traceback.format_exc()
    os.write(2, report.encode(errors="replace"))
    time.sleep(0.5)
    _mpi_abort(comm._mpi if isinstance(comm, Comm) else comm, code)


def _mpi_abort(mpi_comm, code: int) -> NoReturn:
    """``MPI_Abort`` that never returns: MPICH's may return before its process manager ends the
    job, and the failed rank must not run on meanwhile (into code after the failed block, a
    checkpoint write, a "done" message), so the process then exits with ``code`` at once."""
    try:
        mpi_comm.Abort(code)
    finally:
        os._exit(code)
