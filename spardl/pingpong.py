"""Fit the α-β(-γ) model's parameters on the machine at hand.

* α (s/message) and β (s/byte) from a ping-pong between ranks 0 and 1 (``spardl bench pingpong``
  under ``mpiexec -n 2``): for sizes 8 B … 4 MiB, the one-way time t(s) = round trip / 2 (median
  of the repeats), then a least-squares fit t(s) ≈ α + β·s.
* β under load (s/byte) from a ring exchange (:func:`ring_beta`): every rank sends a large
  message to the next rank and receives one from the previous, all at once, as the collectives'
  rounds do; across links whose ends share CPUs (or a switch) this is the rate each rank gets
  when all of them send, which a two-rank ping-pong does not see.
* γ (s/byte merged) from the merge kernel: the time of ``merge_add`` of two sparse vectors per
  byte of (int32 index, float32 value) pairs that go in (every byte that arrives in a sparse
  allreduce is merged once; see :mod:`spardl.cost_model`).

The messages go through :class:`spardl.comm.Comm` (``send_bytes`` / ``recv_bytes``), the same
path the allreducers' one-way messages take.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

__all__ = ["DEFAULT_SIZES", "pingpong", "ring_beta", "fit_alpha_beta", "fit_gamma", "run"]

#: Message sizes in bytes: 8 B, 16 B, ..., 4 MiB.
DEFAULT_SIZES = tuple(8 << i for i in range(20))


def _repeats(size: int, repeat: int | None) -> int:
    # Enough round trips that small messages are not lost in timer noise, few for large ones.
    if repeat is not None:
        return int(repeat)
    return int(min(200, max(5, (1 << 22) // max(size, 1))))


def pingpong(comm, sizes=DEFAULT_SIZES, repeat: int | None = None, warmup: int = 2):
    """One-way message times between ranks 0 and 1 (collective over ``comm``).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm or spardl.comm.Comm
        At least 2 ranks; ranks ≥ 2 only wait at the barriers.
    sizes : sequence of int
        Message sizes in bytes, each ≥ 1.
    repeat : int, optional
        Round trips per size (default: 200 for small sizes down to 5 for 4 MiB).
    warmup : int, default 2
        Untimed round trips per size.

    Returns
    -------
    list of (int, float)
        (size in bytes, median one-way seconds), identical on every rank.

    Raises
    ------
    ValueError
        If the communicator has fewer than 2 ranks, ``sizes`` is empty or holds a size < 1,
        ``repeat`` < 1 or ``warmup`` < 0 (on every rank: the arguments are the same everywhere).
    TypeError
        If a size, ``repeat`` (unless None) or ``warmup`` is not an integer (bool included),
        naming it.
    """
    from .comm import Comm

    _check_pingpong_args(sizes, repeat, warmup)
    if isinstance(comm, Comm):
        return _pingpong(comm, sizes, repeat, warmup)
    c = Comm(comm)
    try:
        return _pingpong(c, sizes, repeat, warmup)
    finally:
        c.free()


def _check_pingpong_args(sizes, repeat, warmup) -> None:
    """The argument checks of :func:`pingpong`, before any communication."""
    from ._checks import check_int

    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"sizes must be a sequence of byte counts, got {type(sizes).__name__}")
    sizes = list(sizes)
    for v in sizes:
        check_int("sizes", v)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes must be positive byte counts, got {sizes}")
    if repeat is not None:
        check_int("repeat", repeat)
        if repeat < 1:
            raise ValueError(f"repeat must be >= 1 (or None), got {repeat}")
    _check_warmup(warmup)


def _check_warmup(warmup) -> None:
    """Untimed rounds of :func:`pingpong` and :func:`ring_beta`: an integer >= 0."""
    from ._checks import check_int

    check_int("warmup", warmup)
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")


def _pingpong(c, sizes, repeat, warmup):
    sizes = [int(s) for s in sizes]
    if c.size < 2:
        raise ValueError(f"pingpong needs at least 2 ranks (run under mpiexec -n 2), got {c.size}")
    out = []
    for size in sizes:
        buf = np.zeros(size, dtype=np.uint8)
        times = []
        for i in range(warmup + _repeats(size, repeat)):
            c.barrier()
            if c.rank == 0:
                t0 = time.perf_counter()
                c.send_bytes(buf, 1)
                c.recv_bytes(1, size)
                if i >= warmup:
                    times.append((time.perf_counter() - t0) / 2)
            elif c.rank == 1:
                c.recv_bytes(0, size)
                c.send_bytes(buf, 0)
        t = float(np.median(times)) if times else 0.0
        out.append((size, t))
    # Rank 0 measured; every rank returns its numbers.
    return [(int(s), float(t)) for s, t in c.bcast_object(out, root=0)]


#: The largest message of :func:`ring_beta`: 1 GiB.
RING_MAX_BYTES = 1 << 30


def ring_beta(comm, size: int = 1 << 22, repeat: int = 5, warmup: int = 1) -> float:
    """Seconds per byte of a ring exchange with every rank sending at once (collective).

    Each rank r sends ``size`` bytes to rank r + 1 and receives as many from rank r − 1 (mod P)
    in one ``Sendrecv``, after a barrier; the time of a round is the slowest rank's, and the
    result is the median round time divided by ``size``. It prices the bytes of a step in which
    all ranks exchange at once (an allreduce's rounds), where the links' ends share CPUs, a
    bridge or a switch: :func:`pingpong` times one pair alone.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm or spardl.comm.Comm
        At least 2 ranks.
    size : int, default 4 MiB
        Bytes each rank sends per round, in [1, :data:`RING_MAX_BYTES`].
    repeat, warmup : int
        Timed and untimed rounds (repeat ≥ 1, warmup ≥ 0).

    Returns
    -------
    float
        β in s/byte, identical on every rank.

    Raises
    ------
    ValueError
        If the communicator has fewer than 2 ranks, or size, repeat or warmup is out of range
        (on every rank: the arguments are the same everywhere).
    TypeError
        If size, repeat or warmup is not an integer (bool included), naming it.
    """
    from ._checks import check_int
    from .comm import Comm

    for name, v, lo, hi in (("size", size, 1, RING_MAX_BYTES), ("repeat", repeat, 1, None)):
        check_int(name, v)
        if v < lo or (hi is not None and v > hi):
            raise ValueError(f"{name} must be in [{lo}, {hi or 'inf'}], got {v}")
    _check_warmup(warmup)
    c = comm if isinstance(comm, Comm) else Comm(comm)
    try:
        if c.size < 2:
            raise ValueError(f"ring_beta needs at least 2 ranks, got {c.size}")
        buf = np.zeros(int(size), dtype=np.uint8)
        right, left = (c.rank + 1) % c.size, (c.rank - 1) % c.size
        times = []
        for i in range(int(warmup) + int(repeat)):
            c.barrier()
            t0 = time.perf_counter()
            c.sendrecv_bytes(buf, right, left, int(size))
            dt = max(c.allgather_object(time.perf_counter() - t0))
            if i >= warmup:
                times.append(dt)
        return float(np.median(times)) / int(size)
    finally:
        if c is not comm:
            c.free()


def fit_alpha_beta(sizes, seconds) -> tuple[float, float]:
    """Least-squares fit of t(s) ≈ α + β·s, weighted by 1/t (relative residuals).

    Plain least squares on absolute times lets the megabyte messages decide everything and
    often gives a negative α; weighting each point by 1/t fits small and large messages alike.

    Parameters
    ----------
    sizes : sequence of int
        Message sizes in bytes (at least two distinct).
    seconds : sequence of float
        One-way times, same length, > 0.

    Returns
    -------
    (alpha, beta)
        Seconds per message and per byte, both ≥ 0 (a negative fitted value is clipped to 0
        and the other refitted).

    Raises
    ------
    ValueError
        If the lengths differ, fewer than two distinct sizes are given or a time is ≤ 0.
    """
    s = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if s.shape != t.shape or s.ndim != 1:
        raise ValueError(f"sizes and seconds must be 1-D of one length, got {s.shape}, {t.shape}")
    if len(np.unique(s)) < 2:
        raise ValueError("sizes must hold at least two distinct values")
    if not np.all(t > 0):
        raise ValueError("seconds must all be > 0")
    w = 1.0 / t
    A = np.stack([np.ones_like(s), s], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    if alpha < 0:
        alpha, beta = 0.0, float(np.sum(w * w * s * t) / np.sum(w * w * s * s))
    if beta < 0:
        alpha, beta = float(np.sum(w * w * t) / np.sum(w * w)), 0.0
    return float(alpha), float(beta)


def fit_gamma(pairs: int = 1 << 18, repeat: int = 5, seed: int = 0) -> float:
    """Seconds per byte merged: ``merge_add`` of two sorted sparse vectors of ``pairs`` pairs.

    The bytes are those of the wire format (int32 index + float32 value = 8 bytes per pair) of
    the vector that arrives, so γ multiplies the same byte counts as β. Local, no MPI.

    Parameters
    ----------
    pairs : int, default 2**18
        (index, value) pairs in each of the two vectors, ≥ 1 (drawn from 64·``pairs``
        coordinates).
    repeat : int, default 5
        Timed merges, ≥ 1.
    seed : int, default 0
        Seed of the random vectors, ≥ 0.

    Returns
    -------
    float
        γ in s/byte: the median over ``repeat`` timed merges (after one untimed, compiling
        call) divided by 8·``pairs``.

    Raises
    ------
    TypeError
        If ``pairs``, ``repeat`` or ``seed`` is not an integer (bool included), naming it.
    ValueError
        If ``pairs`` or ``repeat`` < 1 or ``seed`` < 0, naming it.
    """
    import spardl_kernels as K

    from ._checks import check_int

    for name, v, lo in (("pairs", pairs, 1), ("repeat", repeat, 1), ("seed", seed, 0)):
        check_int(name, v)
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")
    pairs, repeat, seed = int(pairs), int(repeat), int(seed)

    rng = np.random.default_rng(seed)
    n = 64 * pairs
    ia = np.sort(rng.choice(n, pairs, replace=False)).astype(np.int64)
    ib = np.sort(rng.choice(n, pairs, replace=False)).astype(np.int64)
    va = rng.standard_normal(pairs).astype(np.float32)
    vb = rng.standard_normal(pairs).astype(np.float32)
    K.merge_add(ia, va, ib, vb)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        K.merge_add(ia, va, ib, vb)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / (8 * pairs)


def run(args, world) -> int:
    """``spardl bench pingpong``: measure, fit, print on rank 0, optionally write JSON.

    Parameters
    ----------
    args : argparse.Namespace
        ``sizes`` (list of int or None: :data:`DEFAULT_SIZES`), ``repeat`` (int or None),
        ``json`` (a path or None) and ``no_gamma`` (bool: skip :func:`fit_gamma`).
    world : mpi4py.MPI.Intracomm
        At least 2 ranks (collective over it).

    Returns
    -------
    int
        The exit status, 0.

    Raises
    ------
    spardl.cli.common.UsageError
        If ``world`` has fewer than 2 ranks, or rank 0 cannot write ``--json`` (a directory,
        a missing or read-only folder), on every rank.
    TypeError, ValueError
        As :func:`pingpong`, for bad sizes or repeat.
    """
    from .cli.common import UsageError, output_file

    sizes = args.sizes or DEFAULT_SIZES
    if world.Get_size() < 2:
        raise UsageError(
            f"bench pingpong needs at least 2 ranks (run under mpiexec -n 2), got "
            f"{world.Get_size()}"
        )
    if args.json:  # a path rank 0 cannot write fails now, not after the measurement
        problem = None
        if world.Get_rank() == 0:
            try:
                output_file(args.json)
            except argparse.ArgumentTypeError as e:
                problem = str(e)
        problem = world.bcast(problem, root=0)
        if problem is not None:
            raise UsageError(f"--json: {problem}")
    rows = pingpong(world, sizes, repeat=args.repeat)
    alpha, beta = fit_alpha_beta([s for s, _ in rows], [t for _, t in rows])
    gamma = None if args.no_gamma else fit_gamma()
    if world.Get_rank() != 0:
        return 0
    print(f"# ping-pong between ranks 0 and 1 of {world.Get_size()}, host {platform.node()}")
    print(f"{'bytes':>9} {'one-way us':>11} {'fit us':>9} {'MB/s':>9}")
    for s, t in rows:
        fit = alpha + beta * s
        print(f"{s:>9} {t * 1e6:>11.2f} {fit * 1e6:>9.2f} {s / t / 1e6 if t else 0:>9.1f}")
    print(f"alpha = {alpha:.3e} s/message ({alpha * 1e6:.2f} us)")
    if beta:
        print(f"beta  = {beta:.3e} s/byte ({1 / beta / 1e9:.2f} GB/s)")
    else:  # the fit's slope clipped at 0: these sizes do not resolve the link's rate
        print("beta  = 0 s/byte (not resolved by these sizes: add larger ones to --sizes)")
    if gamma is not None:
        print(f"gamma = {gamma:.3e} s/byte merged (merge_add, int32+float32 pairs)")
    if args.json:
        doc = {
            "alpha": alpha,
            "beta": beta,
            "gamma": gamma,
            "host": platform.node(),
            "P": world.Get_size(),
            "rows": [{"bytes": s, "seconds": t} for s, t in rows],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    return 0
