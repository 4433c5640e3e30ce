"""PyTorch integration: start ``torch.distributed`` from MPI, a DDP communication hook, and a
gradient reducer for plain training loops.

The sparse allreduce always runs over an mpi4py communicator (duplicated inside), never over the
torch process group: DDP (or the caller) owns the process group, spardl owns its MPI messages, and
the two never mix.

>>> import spardl.torch as st                                             # doctest: +SKIP
>>> reducer = st.SparseGradientReducer(model.parameters(), MPI.COMM_WORLD,
...                                    algorithm="spardl", density=0.01)  # doctest: +SKIP
>>> loss.backward(); reducer.reduce(); optimizer.step()                   # doctest: +SKIP

Importing this module imports torch; ``import spardl`` alone does not.
"""

# No `from __future__ import annotations`: DDP checks the hook's return annotation as an object.
import copy
import functools
import math
import os
import queue
import threading
import weakref

import numpy as np
import torch

from . import _arrays as A
from . import make
from ._checks import (
    check_bool,
    check_counter,
    check_counter_room,
    check_density,
    check_float,
    check_int,
    check_int_at_least,
    is_count,
    load_error,
    type_name,
)
from ._checks import raise_if as _raise_if
from ._checks import restored_error as _restored_error
from ._checks import undo_or_break as _undo_or_break
from .algorithms.base import agree_on_load, collective_check, error_report, raise_rejected
from .comm import Comm, name_hash, new_stats

__all__ = [
    "SparseGradientReducer",
    "SparseHookState",
    "init_process_group_from_mpi",
    "sparse_allreduce_hook",
    "warmup_density_at",
]


def _start_numba_threads() -> None:
    """Start Numba's thread pool now, keeping torch's intra-op thread count.

    Numba's OpenMP threading layer sets the process's OpenMP thread count to its own pool size
    (NUMBA_NUM_THREADS, one per core by default) when the pool starts, and torch reads the same
    OpenMP setting: a job that set ``torch.set_num_threads(1)`` because P ranks share the cores
    then ran its forward and backward passes on every core of every rank from the first
    threaded kernel call on (measured: the language model's step with Gaussian-k took 5x as
    long). Started here, once, the pool does not touch the setting again, and torch's count is
    put back as it was.
    """
    import numba

    threads = torch.get_num_threads()
    numba.get_num_threads()  # starts the pool
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


_start_numba_threads()


def _world():
    # Only the default of the convenience helpers below; everything else takes the communicator
    # as an argument.
    from mpi4py import MPI

    return MPI.COMM_WORLD


#: The ``torch.distributed`` backends :func:`init_process_group_from_mpi` takes.
_BACKENDS = ("gloo", "nccl", "mpi")


def _check_backend(backend) -> None:
    """TypeError or ValueError naming ``backend`` where this process cannot use it."""
    import torch.distributed as dist

    if backend is None:
        return
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string or None, got {type_name(backend)}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(_BACKENDS)} or None, got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() == 0:
        raise ValueError('backend="nccl" needs a CUDA device, and none is visible: use "gloo"')
    if backend == "mpi" and not dist.is_mpi_available():
        raise ValueError('backend="mpi" needs a PyTorch built with MPI, and this one is not')


def _rendezvous_store(c: Comm, addr: str, timeout):
    """The ``torch.distributed`` key-value store of the job, opened once on every rank.

    Rank 0 listens on ``MASTER_PORT``, or on port 0 (the kernel picks a free one and the socket
    stays bound: no other process can take the port between its choice and its use), and
    broadcasts the port it got; the other ranks then connect. A rank 0 that cannot listen makes
    every rank raise, not only rank 0 while the others wait.
    """
    import torch.distributed as dist

    wait = dist.constants.default_pg_timeout if timeout is None else timeout
    port = np.full(1, -1, dtype=np.int64)
    store, err = None, None
    if c.rank == 0:
        asked = os.environ.get("MASTER_PORT") or "0"
        try:
            store = dist.TCPStore(
                addr, int(asked), c.size, True, timeout=wait, wait_for_workers=False
            )
            port[0] = store.port
        except (RuntimeError, ValueError, OSError) as e:  # DistNetworkError is a RuntimeError
            err = e
    c.bcast(port, 0)
    if port[0] < 0:
        where = f"{addr}:{os.environ.get('MASTER_PORT') or '(a free port)'}"
        msg = f"rank 0 could not open the rendezvous store at {where} (MASTER_ADDR, MASTER_PORT)"
        raise RuntimeError(msg + (f": {err}" if err is not None else "")) from err
    if store is None:
        store = dist.TCPStore(addr, int(port[0]), c.size, False, timeout=wait)
    return store


def _local_rank(rank: int) -> int:
    for var in (
        "MPI_LOCALRANKID",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_RANK",
        "SLURM_LOCALID",
        "LOCAL_RANK",
    ):
        if var in os.environ:
            return int(os.environ[var])
    return rank


def _refuse_torchrun(mpi_world_size: int) -> None:
    """ValueError if ``torchrun`` started this process for more processes than MPI's world has.

    Under ``torchrun`` every process is an MPI job of one, so a process group made from MPI would
    be P groups of one, each training alone, with no error anywhere. ``torchrun`` (torch's
    elastic agent) marks its processes with ``TORCHELASTIC_RUN_ID`` and their number with
    ``WORLD_SIZE``.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    try:
        launched = int(os.environ.get("WORLD_SIZE", ""))
    except ValueError:
        return
    if launched != mpi_world_size:
        raise ValueError(
            f"this process was started by torchrun for {launched} processes (WORLD_SIZE), but "
            f"MPI's world has {mpi_world_size}: each would train alone. Launch with "
            f"mpiexec -n {launched} python ... instead (spardl's allreduce talks over MPI)"
        )


def init_process_group_from_mpi(comm=None, backend: str | None = None, timeout=None) -> tuple:
    """Initialise ``torch.distributed`` from an MPI communicator, so one ``mpiexec`` starts the job.

    Rank and world size come from ``comm``. The rendezvous address is ``MASTER_ADDR`` (default
    127.0.0.1); the port is ``MASTER_PORT`` if set, else a free port that rank 0's store listens
    on from the moment it is picked (no other process can take it), broadcast over MPI.
    Collective over ``comm``.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, optional
        The communicator whose ranks become the process group; default ``MPI.COMM_WORLD``.
    backend : {"gloo", "nccl", "mpi"}, optional
        Default "nccl" when CUDA is available (each rank then uses device local_rank mod the
        number of devices), else "gloo".
    timeout : datetime.timedelta, optional
        Passed to :func:`torch.distributed.init_process_group`.

    Returns
    -------
    (rank, world_size) : tuple of int

    Raises
    ------
    RuntimeError
        If a process group is already initialised with another rank or size, or rank 0 cannot
        listen on ``MASTER_ADDR:MASTER_PORT`` (raised on every rank).
    TypeError
        If ``comm`` is not an mpi4py intracommunicator, or ``backend`` not a string or None (on
        every rank, as the errors below).
    ValueError
        If ``backend`` is not "gloo", "nccl", "mpi" or None, differs between ranks, is "nccl" where
        a node has no CUDA device or "mpi" where PyTorch lacks MPI, or the process was started
        by ``torchrun`` for a job of more processes than MPI's world holds (each process is
        then an MPI job of one: launch with ``mpiexec -n P`` instead).
    """
    import torch.distributed as dist

    c = Comm(_world() if comm is None else comm)
    try:
        rank, size = c.rank, c.size
        _refuse_torchrun(_world().Get_size())
        err = None
        try:
            _check_backend(backend)
        except (TypeError, ValueError) as e:
            err = e
        # Every rank the same backend, or an error on every rank: a bad one on some ranks
        # left the others waiting in the rendezvous.
        collective_check(c, err, [name_hash(repr(backend))], {"backend": repr(backend)})
        if dist.is_initialized():
            if dist.get_rank() != rank or dist.get_world_size() != size:
                raise RuntimeError(
                    f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}, but comm gives rank {rank} of {size}"
                )
            return rank, size
        addr = os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        store = _rendezvous_store(c, addr, timeout)
        os.environ["MASTER_PORT"] = str(store.port)
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(_local_rank(rank) % torch.cuda.device_count())
        kwargs = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, **kwargs)
        return rank, size
    finally:
        c.free()


def _check_warmup(warmup_steps) -> int:
    check_int("warmup_steps", warmup_steps)
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    return int(warmup_steps)


class _Techniques:
    """The convergence techniques of Deep Gradient Compression (arXiv 1712.01887 §3.2-3.3),
    validated: momentum correction, momentum factor masking, local gradient clipping and the
    exponential density warm-up; and ``dense_numel`` (small parameters reduced dense). See
    :class:`SparseGradientReducer` for their definitions."""

    def __init__(
        self,
        momentum_correction=None,
        factor_masking=True,
        clip_norm=None,
        density_warmup=0,
        warmup_density=None,
        *,
        dense_numel=0,
        density=None,
        residual="global",
    ):
        d = check_int("dense_numel", dense_numel)
        if d < 0:
            raise ValueError(f"dense_numel must be >= 0, got {d}")
        self.dense_numel = int(d)
        m = check_float("momentum_correction", momentum_correction, or_none=True)
        if m is not None:
            if not 0 <= m < 1:
                raise ValueError(f"momentum_correction must be in [0, 1), got {m}")
            if residual == "none":
                raise ValueError(
                    "momentum_correction needs error feedback (residual='global' or 'local'): "
                    "the residual holds the accumulated velocity's unsent part"
                )
            m = float(m)
        check_bool("factor_masking", factor_masking)
        if not factor_masking and m is None:
            raise ValueError("factor_masking=False applies with momentum_correction only")
        c = check_float("clip_norm", clip_norm, or_none=True)
        if c is not None:
            if not (c > 0 and np.isfinite(c)):
                raise ValueError(f"clip_norm must be a finite number > 0, got {c}")
            c = float(c)
        w = check_int("density_warmup", density_warmup)
        if w < 0:
            raise ValueError(f"density_warmup must be >= 0, got {w}")
        r0 = check_density("warmup_density", 0.25 if warmup_density is None else warmup_density)
        if warmup_density is not None and w == 0:
            raise ValueError("warmup_density applies with density_warmup > 0 only")
        if (
            w > 0
            and isinstance(density, (int, float, np.floating, np.integer))
            and not isinstance(density, bool)
            and 0 < float(density) <= 1
            and r0 < float(density)  # both as the floats they are stored as
        ):
            raise ValueError(
                f"warmup_density ({r0}) must be >= density ({density}): the warm-up starts "
                "denser and falls to the target density"
            )
        self.momentum = m
        self.factor_masking = factor_masking
        self.clip_norm = c
        self.density_warmup = int(w)
        self.warmup_density = float(r0)

    def as_dict(self) -> dict:
        return {
            "momentum_correction": self.momentum,
            "factor_masking": self.factor_masking,
            "clip_norm": self.clip_norm,
            "density_warmup": self.density_warmup,
            "warmup_density": self.warmup_density,
            "dense_numel": self.dense_numel,
        }


def warmup_density_at(step: int, warmup: int, start: float, target: float) -> float:
    """The density of sparse step ``step`` (0-based) of an exponential density warm-up.

    ρ_s = start · (target/start)^(s/W) for s < W = ``warmup``, and ``target`` from step W on: the
    density falls by the same factor every step, from ``start`` to ``target``. Deep Gradient
    Compression (Lin et al., arXiv 1712.01887, §3.3 "Warm-up Training") lowers the density
    exponentially over the first epochs (75%, 93.75%, 98.4375%, 99.6%, 99.9% sparsity, i.e.
    25%, 6.25%, ... density, a factor 4 per epoch); here the factor is spread over the steps.

    Parameters
    ----------
    step : int
        Sparse steps completed before this one (dense warm-up steps not counted).
    warmup : int
        W, the number of warm-up steps (0: always ``target``).
    start, target : float
        The densities at step 0 and from step W on, in (0, 1].

    Returns
    -------
    float
        ρ_s, in (0, 1]: between ``start`` and ``target``.

    Raises
    ------
    TypeError
        If ``step`` or ``warmup`` is not an integer, or ``start`` or ``target`` not a float.
    ValueError
        If ``step`` or ``warmup`` is negative, or ``start`` or ``target`` outside (0, 1].
    """
    step, warmup = check_int_at_least("step", step, 0), check_int_at_least("warmup", warmup, 0)
    start, target = check_density("start", start), check_density("target", target)
    if step >= warmup:
        return float(target)
    return float(start * (target / start) ** (step / warmup))


def _vector(t: torch.Tensor):
    """The array an allreducer is handed for a 1-D tensor, zero-copy and on the tensor's side: a
    NumPy view of a CPU tensor, a Numba device array on a CUDA tensor's memory (through its
    ``__cuda_array_interface__``; the allreducer then keeps its buffers on the device)."""
    t = t.detach()
    return A.view(t) if t.is_cuda else t.numpy()


def _tensor(a, like: torch.Tensor) -> torch.Tensor:
    """A torch view of an allreducer's array (a residual) on ``like``'s device: zero-copy when
    it is already there (a host array for a CPU tensor, a device array for a CUDA one), else a
    copy (a host residual before the first GPU call)."""
    if A.is_device(a):
        return torch.as_tensor(a, device=like.device)
    t = torch.from_numpy(np.asarray(a))
    return t if like.device.type == "cpu" else t.to(like.device)


def _own_tensor(a, like: torch.Tensor) -> torch.Tensor:
    """A torch view of an allreducer's array ``a`` where it lives, never a copy (unlike
    :func:`_tensor`, whose copy of a host residual for a CUDA ``like`` would take no write):
    on ``like``'s device for a device array, else on the host."""
    if A.is_device(a):
        return torch.as_tensor(a, device=like.device)
    return torch.from_numpy(np.asarray(a))


def _sync(t: torch.Tensor) -> None:
    """Wait for the device's queued work when ``t`` is a CUDA tensor (no-op on the CPU)."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def _host_kernels_take(*tensors: torch.Tensor) -> bool:
    """Whether the host kernels of :mod:`spardl_kernels.cpu.arrays` take these tensors: all on
    the host, all float32 or float64 (else torch's own passes do the work)."""
    return all(
        t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) for t in tensors
    )


def _mask_sent(u: torch.Tensor, res: torch.Tensor, x: torch.Tensor) -> None:
    """Factor masking: ``u`` zeroed where ``res == 0`` and ``x != 0`` (the velocity where this
    rank's accumulation X was sent), in one pass on the host
    (:func:`spardl_kernels.cpu.arrays.mask_sent`), with torch's ops on a device or for a
    float16 velocity."""
    if _host_kernels_take(u, res, x):
        from spardl_kernels.cpu.arrays import mask_sent

        mask_sent(u.numpy(), res.numpy(), x.numpy())
        return
    # masked_fill_: no index list, where boolean indexing builds one
    u.masked_fill_(torch.logical_and(res == 0, x != 0), 0)


#: The allreducers' default density (spardl.Allreducer's ``density``).
_DEFAULT_DENSITY = 0.01

#: The options every allreducer accepts (spardl.Allreducer's keywords).
_COMMON_OPTIONS = ("density", "op", "residual", "nonfinite", "check", "wire")


def _validate_options(
    ctl: Comm, algorithm, options: dict, err=None, hook=False, agreed=None
) -> None:
    """Collective: every rank raises the same error if any rank's algorithm or options are bad,
    or if the ranks' algorithm, option names or ``agreed`` (the reducer's own settings:
    ``warmup_steps``, the DGC techniques, the parameter layout) differ. The options' values are
    agreed by :func:`spardl.make` (its own cross-rank check), after their local checks.

    Unknown options are named with the full list of accepted ones (common and the algorithm's
    own). For the hook (whose n is known only at its first call) the values are then checked by
    building a small allreducer with :func:`spardl.make`, so the messages are make's own; the
    reducer builds its real allreducer right after this.
    """
    from . import ALGORITHMS
    from .algorithms.auto import Auto

    cls = ALGORITHMS.get(algorithm) if isinstance(algorithm, str) else None
    if algorithm == "auto":
        cls = Auto
    if err is None and cls is not None:
        accepted = set(_COMMON_OPTIONS) | set(cls.options)
        if hook:
            accepted.discard("op")
        unknown = sorted(set(options) - accepted - ({"op"} if hook else set()))
        if hook and "op" in options:
            err = TypeError("op is fixed to 'mean' for a DDP hook; do not pass it")
        elif unknown:
            err = TypeError(
                f"{algorithm}: unknown option(s) {unknown}; accepted: {sorted(accepted)}"
            )
    described = {
        "algorithm": repr(algorithm),
        "options": repr(sorted(options)),  # their values: make's own checks and agreement
        **{k: _plain(v) for k, v in (agreed or {}).items()},
    }
    collective_check(ctl, err, [name_hash(repr(sorted(described.items())))], described)
    if not hook:
        return
    # The values: make's own checks and messages (unknown algorithm included), on every rank.
    make(algorithm, ctl, max(1, ctl.size), op="mean", **options).close()


def _plain(v):
    """A NumPy scalar as the Python number it holds (its repr then matches a plain number's)."""
    return v.item() if isinstance(v, np.generic) else v


def _layout(names, params) -> str:
    """The parameters' layout in words: total n, count, and a hash of the names and shapes."""
    shapes = repr([(k, tuple(p.shape)) for k, p in zip(names, params, strict=True)])
    n = sum(p.numel() for p in params)
    return f"n={n}, {len(params)} tensors, layout hash {name_hash(shapes)}"


def _named_trainable(params) -> tuple[list, list]:
    """The (name, parameter) pairs of ``params`` with ``requires_grad``, named by their position
    unless given as (name, parameter) pairs, and those of the others (frozen).

    Raises
    ------
    TypeError
        If ``params`` is a single tensor, a module (not its ``parameters()``) or not iterable,
        holds something else than tensors or (name, tensor) pairs with a str name, or a
        trainable parameter is not floating point.
    ValueError
        If ``params`` holds a tuple that is not a pair, a parameter twice, two under one name
        (its state is kept by name), none with ``requires_grad`` or none of them with
        elements.

    A trainable tensor that is not a leaf of the autograd graph (the result of an operation,
    such as ``w * 2``) gets no ``.grad`` from ``backward()``: a TypeError too.
    """
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params must be an iterable of parameters (model.parameters()), got a "
            "single Tensor; pass [tensor]"
        )
    if isinstance(params, torch.nn.Module) and not isinstance(params, torch.nn.ParameterList):
        raise TypeError(
            "params must be an iterable of parameters, got the module "
            f"{type(params).__name__}; pass model.parameters() or model.named_parameters()"
        )
    try:
        items = iter(params)
    except TypeError:
        raise TypeError(
            "params must be an iterable of parameters (model.parameters()), got "
            f"{type(params).__name__}"
        ) from None
    named, frozen = [], []
    seen, names = {}, set()
    for i, item in enumerate(items):
        if not isinstance(item, tuple):
            name, p = str(i), item
        elif len(item) != 2:
            raise ValueError(
                f"params must hold parameters or (name, parameter) pairs, got a tuple of "
                f"{len(item)} at position {i}"
            )
        else:
            name, p = item
            if not isinstance(name, str):
                raise TypeError(
                    f"params: a (name, parameter) pair's name must be a str, got "
                    f"{type(name).__name__} at position {i}"
                )
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params must hold tensors, got {type(p).__name__}")
        if id(p) in seen:
            raise ValueError(f"params holds the same parameter twice ({seen[id(p)]} and {name})")
        if name in names:
            raise ValueError(
                f"params holds two parameters named {name!r} (residuals and velocities are "
                "kept by name)"
            )
        seen[id(p)] = name
        names.add(name)
        if p.requires_grad and not p.is_leaf:
            raise TypeError(
                f"params must hold leaf tensors (parameters), got {name}, the result of an "
                f"operation ({type(p.grad_fn).__name__}), which backward() gives no .grad"
            )
        (named if p.requires_grad else frozen).append((name, p))
    if not named:
        raise ValueError("params holds no parameter with requires_grad=True")
    if not any(p.numel() for _, p in named):
        empty = ", ".join(name for name, _ in named)
        raise ValueError(
            f"params holds no parameter with elements (every trainable one has 0: {empty}); "
            "there is nothing to reduce"
        )
    bad = sorted({str(p.dtype) for _, p in named if not p.dtype.is_floating_point})
    if bad:
        raise TypeError(f"params must be floating point, got dtype(s) {bad}")
    return named, frozen


_ANNOUNCED = False


def _kernels_cached() -> bool:
    """Whether Numba's on-disk cache holds compiled spardl kernels (any signature)."""
    import glob

    import spardl_kernels

    roots = [os.path.dirname(spardl_kernels.__file__)]
    if os.environ.get("NUMBA_CACHE_DIR"):
        roots.append(os.environ["NUMBA_CACHE_DIR"])
    return any(glob.glob(os.path.join(r, "**", "*.nbi"), recursive=True) for r in roots)


def _announce_compile(rank: int) -> None:
    """Say once, on rank 0, that the first call compiles the kernels (it looks like a hang)."""
    global _ANNOUNCED
    if _ANNOUNCED:
        return
    _ANNOUNCED = True
    if rank == 0 and not _kernels_cached():
        import sys

        print(
            "spardl: compiling kernels, first run only (about 30 s; cached afterwards)",
            file=sys.stderr,
            flush=True,
        )


def _flat_dtype(dtypes) -> torch.dtype:
    """The dtype of the flat buffer: the parameters' one dtype if NumPy has it; for a mixed
    model float64 if one of them is float64 (a float64 gradient reduced in float32 lost its
    low bits, and a finite one past 3.4e38 became Inf), else float32 (bfloat16, and float16
    beside other dtypes, accumulate in float32)."""
    dtypes = set(dtypes)
    if torch.float64 in dtypes:
        return torch.float64
    if dtypes == {torch.float16}:
        return torch.float16
    return torch.float32


def _version(t) -> int:
    """The tensor's in-place write counter (a fast "written since" test). It is not public
    torch API: where a build lacks it, 0, and the values compared afterwards decide alone."""
    return getattr(t, "_version", 0)


def _may_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (``expand``: a stride 0), so that it
    cannot be written in place. Conservative: True unless, with its dimensions ordered by
    stride, each dimension steps past the whole extent of the ones before it."""
    extent = 1
    dims = zip(t.stride(), t.shape, strict=True)
    for stride, size in sorted((st, sz) for st, sz in dims if sz > 1):
        if stride < extent:
            return True
        extent = stride * size
    return False


def _future(buf: torch.Tensor) -> torch.futures.Future:
    """The future a DDP hook returns for ``buf``, allowed to hold it on its device."""
    return torch.futures.Future(devices=[buf.device]) if buf.is_cuda else torch.futures.Future()


def _check_overlap(momentum_correction, clip_norm) -> None:
    """What overlap mode needs: MPI callable from a second thread, techniques that work bucket by
    bucket."""
    from mpi4py import MPI

    for name, value in (("clip_norm", clip_norm), ("momentum_correction", momentum_correction)):
        if value is not None:
            raise ValueError(
                f"{name} needs the whole gradient; overlap=True reduces bucket by bucket "
                f"(use overlap=False with {name})"
            )
    level = MPI.Query_thread()
    if level < MPI.THREAD_SERIALIZED:
        names = {MPI.THREAD_SINGLE: "THREAD_SINGLE", MPI.THREAD_FUNNELED: "THREAD_FUNNELED"}
        raise RuntimeError(
            f"overlap=True calls MPI from a communication thread, which needs MPI initialised "
            f"with at least MPI.THREAD_SERIALIZED; it was initialised with "
            f"MPI.{names.get(level, level)} (set mpi4py.rc.thread_level = 'multiple' or "
            "'serialized' before importing mpi4py.MPI, or use overlap=False)"
        )


def _checked_state(state, algorithm: str) -> dict:
    """A ``state_dict()`` output as NumPy data, checked for its type, its keys ``algorithm`` and
    ``step``, and the algorithm it was saved with (``TypeError`` / ``ValueError``)."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict (from state_dict()), got {type(state).__name__}")
    state = from_torch_state(state)
    missing = [k for k in ("algorithm", "step") if k not in state]
    if missing:
        raise ValueError(f"state is missing key(s) {missing} (not a state_dict() output?)")
    if state["algorithm"] != algorithm:
        raise ValueError(
            f"state was saved with algorithm={state['algorithm']!r}, this one has {algorithm!r}"
        )
    return state


def _loaded_velocity(saved) -> dict:
    """A state's momentum-correction velocities (``velocity``: parameter key → vector) as
    one-dimensional host arrays, copied (floats in their dtype, integers as float64); {} for
    None or an empty one. Their keys and
    lengths are checked against the layout by :meth:`_Core.check_pending_velocity`.

    Raises
    ------
    TypeError
        If ``saved`` is not a dict, or a velocity is not a one-dimensional real vector (a
        NumPy array, a tensor, a list of numbers), naming its parameter.
    """
    if saved is None:
        return {}
    if not isinstance(saved, dict):
        raise TypeError(f"state velocity must be a dict, got {type_name(saved)}")
    out = {}
    for k, v in saved.items():
        if isinstance(v, torch.Tensor):
            v = v.detach().cpu().numpy()
        try:
            a = np.asarray(v)
        except (TypeError, ValueError):
            a = None
        if (
            a is None
            or a.ndim != 1
            or not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer))
        ):
            what = type_name(v) if a is None else f"{a.dtype} array of shape {a.shape}"
            raise TypeError(
                f"the state's velocity of parameter {k!r} must be a one-dimensional real "
                f"vector, got {what}"
            )
        out[k] = np.array(a, dtype=a.dtype if a.dtype.kind == "f" else np.float64)
    return out


def _loaded_stats(saved, live: dict) -> dict:
    """A state's saved message counters (``stats``) as the live ones (``live``) take them.

    Over the live keys, their counters at zero (a state without ``stats``, or None, starts
    them at zero; a counter it lacks, such as the ``steps`` an allreducer adds, starts at
    zero), and every counter the messages count must be an integer in [0, 2**63), ``phases`` a
    dict of such per-phase counters, a sum a step adds to a finite real number: checked before
    anything is loaded, so a bad one on any rank fails the load on every rank instead of the
    next message's count on that rank alone. Other keys (reports such as ``stats["auto"]``)
    are taken as saved.

    Raises
    ------
    TypeError
        If ``saved`` is not a dict (or None), ``phases`` is not a dict of dicts with the three
        message counters, or a counter or sum is not a number of its kind, naming it.
    ValueError
        If a counter is negative (or 2**63 or more) or a sum is not finite, naming it.
    """
    base = {
        k: 0 if is_count(v) else {} if k == "phases" else copy.deepcopy(v) for k, v in live.items()
    }
    for k, v in new_stats().items():
        base.setdefault(k, v)
    if saved is None:
        return base
    if not isinstance(saved, dict):
        raise TypeError(f"state stats must be a dict, got {type(saved).__name__}")
    out = {**base, **copy.deepcopy(saved)}
    for key, value in out.items():
        name = f"state stats[{key!r}]"
        if key == "phases":
            if not isinstance(value, dict) or not all(
                isinstance(ph, dict)
                and all(c in ph for c in ("messages", "bytes_sent", "bytes_received"))
                for ph in value.values()
            ):
                raise TypeError(
                    f"{name} must map each phase to a dict of its messages, bytes_sent and "
                    f"bytes_received, got {value!r}"
                )
            # Every field a count (nothing else a count would break), as a Python integer: a
            # NumPy one of a narrow type would wrap or overflow later.
            out[key] = {
                phase: {c: check_counter(f"{name}[{phase!r}][{c!r}]", v) for c, v in ph.items()}
                for phase, ph in value.items()
            }
        elif key in _COUNTERS or is_count(base.get(key)):
            out[key] = check_counter(name, value)
        elif key in _SUMS or isinstance(base.get(key), float):
            value = check_float(name, value)
            try:
                finite = math.isfinite(value)  # an int past a float raises OverflowError
            except OverflowError:
                finite = False
            if not finite:
                raise ValueError(f"{name} must be finite, got {value!r}")
            out[key] = float(value)
    return out


#: The counters of ``stats`` that the messages and the allreducers' steps count (``+= 1``).
_COUNTERS = frozenset(
    {"messages", "bytes_sent", "bytes_received", "control_messages", "steps", "skipped_steps"}
    | {"selected", "dense_regions"}
)
#: The real-valued sums of ``stats`` that the allreducers' steps add to (``+=``).
_SUMS = frozenset({"dropped_mass"})


def _raise_after_backward(err: BaseException) -> None:
    """Raise ``err`` from the running backward pass once DDP has finished it, or at once
    outside a backward pass (a direct call of the hook).

    An exception raised inside a communication hook leaves DDP's reducer in the middle of its
    iteration: the next forward pass then fails inside DDP (an internal assertion) and the
    model cannot train on. So the hook completes every future (the caller zeroes what was not
    reduced) and raises through the autograd engine's final callbacks instead: DDP queues its
    own (which finishes the iteration) after the last bucket's hook returns, and callbacks
    queued while callbacks run go to the end of the list, so a callback that queues the raise
    runs it after DDP's."""
    engine = torch.autograd.Variable._execution_engine

    def reraise():
        raise err

    try:
        engine.queue_callback(lambda: engine.queue_callback(reraise))
    except RuntimeError:  # not inside a backward pass
        raise err from None


def _check_frozen_everywhere(names, frozen: np.ndarray, P: int) -> None:
    """Raise (on every rank: ``frozen`` is a reduced count) if a parameter is frozen on some
    ranks and not on others: the ranks that froze it would keep their own gradient while the
    others apply the mean, and the replicas drift apart.

    Raises
    ------
    ValueError
        Naming the first such parameter and on how many of the P ranks it is frozen.
    """
    some = np.flatnonzero((frozen > 0) & (frozen < P))
    if some.size:
        i = int(some[0])
        raise ValueError(
            f"parameter {names[i]} is frozen (requires_grad=False) on {int(frozen[i])} of "
            f"{P} ranks: freeze or unfreeze it on every rank"
        )


def _step_control(
    ctl: Comm, err, local: np.ndarray, check: bool, what: str, *more: int
) -> np.ndarray:
    """The control allreduce that starts a step: ``local`` summed over the ranks (from entry 1
    on, which parameters some rank used), raising ``err`` on its rank and the same type,
    naming that rank, on the others.

    With ``check`` (the allreducers' ``check`` option, on by default), every rank first agrees
    that it passed its own checks and is in the same step (``what``, ``more`` and the number of
    parameters), in the fixed size of every agreement (:func:`collective_check`): a rank that
    is elsewhere on the control communicator (loading a state while the others step, say) then
    makes every rank raise, where a sum of another size ended in a truncated message or summed
    unrelated numbers. Without it, one allreduce: entry 0 counts the ranks that failed, and a
    mismatched call may hang, as with plain MPI."""
    if check:
        collective_check(
            ctl, err, [name_hash(what), *more, len(local)], {what: [*more, len(local) - 1]}
        )
        return ctl.allreduce(local)
    local[0] = err is not None
    total = ctl.allreduce(local)
    if total[0]:
        raise_rejected(err, ctl.allgather_object(error_report(err)))
    return total


class _Core:
    """What the hook and the reducer share: the parameters' layout in one flat vector (keyed by
    parameter), the sparse and dense allreducers over it, the step and checkpoints.

    ``comm`` carries the allreducers' messages (``stats``); ``ctl`` the small control messages
    (option checks, which parameters some rank used), kept out of the counters.
    """

    def __init__(self, comm, algorithm, warmup_steps: int, options: dict, tech=None, comms=None):
        # ``comms``: (comm, ctl) Comm objects shared with other cores (overlap mode's buckets).
        self.comm, self.ctl = comms if comms is not None else (Comm(comm), Comm(comm))
        self.owns_comms = comms is None
        self.tech = tech if tech is not None else _Techniques()
        self.velocity = None  # momentum correction: this rank's u, laid out like flat
        self.pending_velocity = None  # loaded velocities by key, used at the next step
        self.target_density = None
        self.algorithm = algorithm
        self.warmup_steps = warmup_steps
        self.options = dict(options)
        self.sparse = None
        self.dense = None
        self.created = 0
        self.step = 0
        self.pending = None  # a loaded state, applied when the sparse allreducer exists
        self.keys = None  # parameter keys in flat order
        self.numels = None
        self.offsets = None
        self.n = 0
        self.flat = None
        self.small = []  # (start, end) of the parameters reduced dense (tech.dense_numel)
        self.all_small = False  # every parameter reduced dense: every step is a dense one
        self.small_dense = None  # their dense allreducer
        self._small_idx = None  # the small slices' indices, one after the other (_result)
        self._spare_velocity = None  # the buffer the next step's velocity is written into
        self.broken = None  # the error of a failed step's undo (_undo_or_break), if one raised

    @property
    def stats(self) -> dict:
        return self.comm.stats

    def restored_error(self) -> RuntimeError | None:
        """The RuntimeError of a failed step that could not be undone (:func:`_restored_error`),
        by this core or by one of its allreducers (their own rollback)."""
        ars = [getattr(self, name) for name in _ALLREDUCERS]
        return _restored_error([self, *(ar for ar in ars if ar is not None)])

    def drain(self) -> None:
        """Nothing to wait for: a core's steps run on the caller's thread (overlap mode's
        :meth:`_Buckets.drain` waits for its communication thread)."""

    def close(self) -> None:
        """Free the allreducers' communicators, and this core's own (collective)."""
        for ar in (self.sparse, self.dense, self.small_dense):
            if ar is not None:
                ar.close()
        if self.owns_comms:
            self.comm.free()
            self.ctl.free()

    def set_layout(self, keys, numels, dtype: torch.dtype, device=None) -> None:
        """The flat buffer, on ``device`` (the parameters' or the bucket's; default CPU)."""
        self.keys = list(keys)
        self.numels = [int(m) for m in numels]
        self.offsets = np.cumsum([0, *self.numels]).tolist()
        self.n = int(self.offsets[-1])
        self.flat = torch.zeros(self.n, dtype=dtype, device=device)
        o, limit = self.offsets, self.tech.dense_numel
        # A parameter of no elements is in no slice (a dense allreducer of n = 0 would fail).
        self.small = [(o[i], o[i + 1]) for i, m in enumerate(self.numels) if 0 < m <= limit]
        # Every parameter small (a whole model, or one DDP bucket in overlap mode): nothing is
        # left to sparsify, and the whole vector is reduced dense on every step.
        self.all_small = self.n > 0 and all(m <= limit for m in self.numels)
        if self.all_small:
            self.small = []
        self._small_idx = None

    def allreducer(self, dense: bool):
        if dense:
            if self.dense is None:
                # The warm-up's steps judge a non-finite gradient as the sparse ones do.
                same = {k: self.options[k] for k in ("nonfinite", "check") if k in self.options}
                self.dense = make(
                    "dense", self.comm, self.n, op=self.options.get("op", "mean"), **same
                )
            return self.dense
        if self.sparse is None:
            _announce_compile(self.comm.rank)
            opts = {"op": "mean", **self.options}
            self.sparse = make(self.algorithm, self.comm, self.n, **opts)
            self.target_density = self.sparse.density
            self.created += 1
            if self.pending is not None:
                # Collective: a loaded state that does not fit on some rank raises on every rank.
                fresh, err = self.sparse._snapshot(), None
                try:
                    self._apply(self.pending)
                except Exception as e:  # noqa: BLE001 - every rank must hear of any failure
                    err = load_error(e)
                self.pending = None
                try:
                    # Every rank's loaded allreducer state agrees (counters, ρ, the algorithm's
                    # schedule state), as a direct load_state_dict checks.
                    agree_on_load(
                        self.ctl,
                        err,
                        [name_hash("apply loaded state")],
                        {"loaded state": self.algorithm},
                        loaded=self.sparse,
                    )
                except BaseException as e:
                    _undo_or_break(self, lambda: self.sparse._restore(fresh), e)
                    raise
        return self.sparse

    def run(self, unused, undo: list | None = None) -> object:
        """Reduce ``self.flat`` in place; the slices ``unused`` (no rank used those parameters,
        their result is discarded) keep their residual (and velocity) as they were.

        An unused slice takes no part in the step: its input is zeroed (a DDP bucket may hold
        a stale gradient there) and its residual set aside before the allreduce (so it competes
        for none of the k places of the used parameters and is neither sent nor clipped) and
        put back after it, whether the step is applied, skipped or raises; the result holds no
        entries there.

        With the techniques of :class:`_Techniques`, in this order: the density of this step
        (warm-up schedule), local clipping of the gradient, the velocity u ← m·u + g (which
        becomes the allreducer's input), the allreduce, and factor masking of u.

        Parameters
        ----------
        unused : list of (int, int)
            The slices of ``flat`` that no rank used.
        undo : list, optional
            When the step is applied, ``(holder, kept, folded)`` is appended to it if the step
            wrote into the residual it started from (set aside, folded into a dense part):
            with the allreducer's snapshot from before the step, :meth:`_unstep` puts that
            residual back as it was (overlap mode: an iteration is undone when a later bucket
            of it fails). A step replaces its residual, never writes into it, so these slices
            are the only changes to the old one.

        Raises
        ------
        OverflowError
            Before anything changes, when ``step`` is 2**63 - 1 (a state loaders take no more).
        """
        check_counter_room("step", self.step)
        for a, b in unused:
            self.flat[a:b].zero_()
        dense = self.step < self.warmup_steps or self.all_small
        ar = self.allreducer(dense)
        before_density = self._warm_density(ar, dense)
        try:
            if self.tech.clip_norm is not None:
                self._clip()
            u_before, x_in = self._accumulate_velocity(ar, unused, dense)
        except BaseException as e:  # the velocity is set only at its end: the density back
            self._undo(ar, None, before_density, [], e)
            raise
        holder = self.sparse if not dense or self.all_small else None  # the residual's owner
        # Set aside first: an unused parameter's residual is neither folded into the dense part
        # below nor selected by the sparse one.
        kept = self._set_aside(holder, unused)
        error = None
        try:
            # A residual on what is now reduced dense (a loaded state saved with a smaller
            # dense_numel): sent with it and cleared, so nothing is lost or left stranded, and
            # put back if the step raises or is skipped.
            folded, small = [], None
            if self.all_small and self.step >= self.warmup_steps:
                folded = self._fold_residual(self.flat, [(0, self.n)])
            if self.small and not dense:
                small = torch.cat([self.flat[a:b] for a, b in self.small])
                folded = self._fold_residual(small, self.small)
                try:
                    small = self._reduce_small(small, x_in)
                except BaseException as e:
                    self._undo(ar, u_before, before_density, folded, e)
                    raise
                if small is False:  # nonfinite="skip": the whole step is dropped
                    self._undo(ar, u_before, before_density, folded)
                    self.flat.zero_()  # the result, as a skipped sparse step leaves it
                    return self._empty()
            buf = _vector(self.flat)
            _sync(self.flat)  # torch's writes to flat are done before the allreducer reads it
            skipped = ar.stats.get("skipped_steps", 0)
            try:
                out = ar(buf)
            except BaseException as e:
                self._undo(ar, u_before, before_density, folded, e)
                raise
            applied = ar.stats.get("skipped_steps", 0) == skipped
            if not applied:  # nonfinite="skip": as if the step had not been taken
                self._undo(ar, u_before, before_density, folded)
                x_in = None
        except BaseException as e:
            error = e
            raise
        finally:
            try:
                _undo_or_break(self, lambda: self._put_back(holder, kept), error)
            finally:
                error = None  # no cycle through the traceback to this frame's tensors
        if undo is not None and applied and (kept or folded):
            undo.append((holder, kept, folded))
        if unused:
            out = self._without(out, unused)
        out.to_dense(out=buf)  # into the flat buffer, on its device
        _sync(self.flat)
        if small is not None and applied:
            start = 0
            for a, b in self.small:
                self.flat[a:b] = small[start : start + b - a]
                start += b - a
            out = self._result(out)
        if x_in is not None:
            # Factor masking: u is zeroed where this rank's accumulation left its residual.
            _mask_sent(self.velocity, _tensor(ar.residual, self.flat), x_in)
        self._recycle_velocity(u_before)
        if applied:  # the schedules (dense warm-up, density warm-up) count applied steps
            self.step += 1
        return out

    def _set_aside(self, holder, unused) -> list:
        """Take the residual of the ``unused`` slices out of the allreducer ``holder`` (the
        sparse allreducer that owns the residual, or None): returns [(start, end, values)] for
        :meth:`_put_back` and leaves zeros there, so that parameters no rank used take no part
        in the selection (their gradient is zero on every rank too)."""
        if not unused or holder is None or holder._residual is None:
            return []  # no residual yet: zero everywhere, nothing to set aside
        if holder.residual_mode == "none":
            return []
        res = _own_tensor(holder.residual, self.flat)
        kept = [(a, b, res[a:b].clone()) for a, b in unused]
        for a, b, _ in kept:
            res[a:b].zero_()
        _sync(res)
        return kept

    def _put_back(self, holder, kept) -> None:
        """Put the residual that :meth:`_set_aside` took back, exactly as it was (the step
        left zeros there: nothing was selected or dropped on those slices)."""
        if not kept:
            return
        res = _own_tensor(holder.residual, self.flat)  # moved to the device by the step, perhaps
        for a, b, v in kept:
            res[a:b].copy_(v)
        _sync(res)

    def _without(self, out, slices):
        """The result ``out`` without its entries in ``slices`` (the parameters no rank used:
        their values are not applied). The dense form is zero there already (every rank's
        input was); a sparse one may hold entries of value zero there (a selection of k places
        among fewer non-zeros), which are dropped."""
        from .result import SparseResult

        if out.is_dense:
            return out
        idx = _tensor(out.indices, self.flat)
        if idx.numel() == 0:
            return out
        starts = torch.tensor([a for a, _ in slices], dtype=idx.dtype, device=idx.device)
        ends = torch.tensor([b for _, b in slices], dtype=idx.dtype, device=idx.device)
        at = torch.searchsorted(starts, idx, right=True) - 1  # the last slice starting at or before
        inside = (at >= 0) & (idx < ends[at.clamp(min=0)])
        if not bool(inside.any()):
            return out
        keep = ~inside
        vals = _tensor(out.values, self.flat)
        return SparseResult._of(
            _vector(idx[keep].contiguous()), _vector(vals[keep].contiguous()), out.n
        )

    def _reduce_small(self, parts, x_in):
        """``parts``, the parameters of :attr:`small` (at most ``dense_numel`` elements each,
        their slices one after the other), reduced in place by a dense allreduce (``op``: mean
        or sum) and taken out of the sparse allreducer's input (their slices of ``flat`` become
        zeros, so the sparse part never selects them). Returns ``parts``, or False when the
        reduced values are not finite and
        ``nonfinite="skip"`` (every rank sees the same sums). With momentum correction their
        velocity is kept, not masked: they are sent in full every step, as momentum SGD does
        (``x_in``'s slices are zeroed so factor masking skips them).

        Raises
        ------
        spardl.NonFiniteError
            With ``nonfinite="raise"``, on every rank, when the reduced values are not finite.
        """
        from .algorithms.base import NonFiniteError

        for a, b in self.small:
            self.flat[a:b].zero_()
            if x_in is not None:
                x_in[a:b].zero_()
        if self.small_dense is None:
            op = self.options.get("op", "mean")
            self.small_dense = make("dense", self.comm, len(parts), op=op, nonfinite="propagate")
        buf = _vector(parts)
        _sync(parts)
        self.small_dense(buf).to_dense(out=buf)
        _sync(parts)
        mode = self.options.get("nonfinite", "raise")
        if mode != "propagate" and not bool(torch.isfinite(parts).all()):
            if mode == "raise":
                raise NonFiniteError(
                    f"the dense-reduced small parameters (dense_numel={self.tech.dense_numel}) "
                    f"hold NaN or Inf at step {self.step}; the step was not applied"
                )
            self.stats["skipped_steps"] = self.stats.get("skipped_steps", 0) + 1
            return False
        return parts

    def _fold_residual(self, parts, slices):
        """Add the sparse allreducer's residual on ``slices`` to ``parts`` (their values one
        after the other) and clear it there; returns what was taken [(start, end, values)] for
        :meth:`_unfold_residual` (empty when the residual is zero there, as it is unless a
        loaded state put mass there)."""
        ar = self.sparse
        if ar is None or ar._residual is None:
            return []
        # The allreducer's own array where it lives (a host residual loaded before the first
        # GPU step stays on the host): a copy would take the clearing, and the mass would be
        # both in parts and still in the residual.
        res = _own_tensor(ar.residual, self.flat)
        taken, start = [], 0
        for a, b in slices:
            piece = res[a:b]
            if bool(piece.any()):
                taken.append((a, b, piece.clone()))
                parts[start : start + b - a] += piece.to(parts.device, parts.dtype)
                piece.zero_()
            start += b - a
        _sync(res)
        return taken

    def _unfold_residual(self, taken) -> None:
        """Put back what :meth:`_fold_residual` took (a step that raised or was skipped)."""
        if taken:
            res = _own_tensor(self.sparse.residual, self.flat)
            for a, b, v in taken:
                res[a:b] = v.to(res.device)
            _sync(res)

    def _unstep(self, undo) -> None:
        """Put back what the applied steps of ``undo`` (:meth:`run`) wrote into the residual
        they started from, once the allreducers are restored to their snapshots from before
        those steps: the residual folded into a dense part, then the unused slices' residual
        set aside (the reverse of the order :meth:`run` took them in)."""
        for holder, kept, folded in reversed(undo):
            self._unfold_residual(folded)
            self._put_back(holder, kept)

    def _result(self, out):
        """The reduced gradient in ``flat`` (the sparse part ``out`` written there, and the
        dense-reduced small parameters) as a SparseResult: its non-zeros, on flat's device.

        They lie among ``out``'s entries and the small slices (``flat`` is zero elsewhere), so
        only those places are read, not all n (a scan of ``flat`` cost as much as the sparse
        allreduce's own selection at ρ = 1 %)."""
        from .result import SparseResult

        flat = self.flat
        if out.is_dense:
            idx = torch.nonzero(flat).flatten()
        else:
            if self._small_idx is None or self._small_idx.device != flat.device:
                self._small_idx = torch.cat(
                    [torch.arange(a, b, device=flat.device) for a, b in self.small]
                )
            sparse = _tensor(out.indices, flat).to(torch.int64)
            idx = torch.unique(torch.cat([sparse, self._small_idx]))  # sorted
            idx = idx[flat[idx] != 0]
        return SparseResult._of(_vector(idx), _vector(flat[idx]), self.n)

    def _empty(self):
        from .result import SparseResult

        flat = self.flat
        idx = torch.zeros(0, dtype=torch.int64, device=flat.device)
        return SparseResult._of(_vector(idx), _vector(flat[:0]), self.n)

    def _warm_density(self, ar, dense: bool):
        """Move ρ to this step's density warm-up value; returns the allreducer's snapshot
        taken before (None when ρ did not move), with which a step that raises or is skipped
        puts ρ back, with what derives from it (budgets, h, thresholds)."""
        tech = self.tech
        if dense or not tech.density_warmup:
            return None
        rho = warmup_density_at(
            self.step - self.warmup_steps,
            tech.density_warmup,
            tech.warmup_density,
            self.target_density,
        )
        if rho == ar.density:
            return None
        before = ar._snapshot()
        ar.set_density(rho)
        return before

    def _accumulate_velocity(self, ar, unused, dense: bool):
        """Momentum correction: u ← m·u + g (the ``unused`` slices of u kept), copied into
        ``self.flat`` (zero on the unused slices). Returns (u before, X = u + E_old in the
        allreducer's work dtype for factor masking or None); (None, None) without momentum."""
        tech = self.tech
        if tech.momentum is None:
            return None, None
        # Dense steps do not mask: everything was sent, and masking would zero u at every step
        # (the warm-up's dense steps, and every step of algorithm="dense").
        mask = tech.factor_masking and not dense and ar.name != "dense"
        flat = self.flat
        u_before, u = self._velocity(), self._next_velocity_buffer()
        res = _tensor(ar.residual, flat) if mask else None
        if _host_kernels_take(flat, u_before):
            x_in = self._accumulate_on_host(u_before, u, res)
        else:
            x_in = self._accumulate_with_torch(u_before, u, res)
        for a, b in unused:  # as they were, and out of the step: X = 0 + E there
            u[a:b] = u_before[a:b]
            flat[a:b].zero_()
            if x_in is not None:
                torch.add(flat[a:b].to(x_in.dtype), res[a:b].to(x_in.dtype), out=x_in[a:b])
        self.velocity = u
        return u_before, x_in

    def _accumulate_with_torch(self, u_before, u, res):
        """:meth:`_accumulate_velocity`'s u ← m·u + g into ``u`` and ``flat``, and X = u + E
        (``res``) if given, in torch's passes (a device, or float16); returns X or None."""
        flat = self.flat
        # As torch.optim.SGD's momentum buffer (u.mul_(m).add_(g)), into the other buffer.
        torch.mul(u_before, self.tech.momentum, out=u).add_(flat)
        flat.copy_(u)
        if res is None:
            return None
        # X = u + E_old, in the allreducer's work dtype and the same float operations.
        work = torch.float32 if flat.dtype == torch.float16 else flat.dtype
        return torch.add(flat.to(work), res.to(work))  # one pass where no dtype changes

    def _accumulate_on_host(self, u_before, u, res):
        """:meth:`_accumulate_with_torch` for a host float32/float64 ``flat``, in one pass
        (:func:`spardl_kernels.cpu.arrays.accumulate_velocity`)."""
        from spardl_kernels.cpu.arrays import accumulate_velocity

        flat = self.flat
        x_in = None if res is None else torch.empty_like(flat)
        accumulate_velocity(
            u_before.numpy(),
            self.tech.momentum,
            flat.numpy(),
            u.numpy(),
            None if res is None else res.numpy(),
            None if x_in is None else x_in.numpy(),
        )
        return x_in

    def _next_velocity_buffer(self) -> torch.Tensor:
        """The buffer a step writes its new velocity into: the old velocity stays as it was
        for an undo, without a copy. It is the velocity the last step replaced
        (:meth:`_recycle_velocity`), or a new one."""
        u, self._spare_velocity = self._spare_velocity, None  # taken until the step is done
        flat = self.flat
        if u is None or u.shape != flat.shape or u.dtype != flat.dtype or u.device != flat.device:
            u = torch.empty_like(flat)
        return u

    def _recycle_velocity(self, u_before) -> None:
        """Keep the velocity a step replaced as the next step's buffer
        (:meth:`_next_velocity_buffer`), unless the step put it back (an undo)."""
        if u_before is not None and u_before is not self.velocity:
            self._spare_velocity = u_before

    def _undo(self, ar, u_before, before_density, folded, error=None) -> None:
        """A step that raised (``error``) or was skipped: the velocity, the density and the
        residual folded into a dense part as they were (:func:`_undo_or_break`)."""

        def undo():
            if u_before is not None:
                if self.velocity is not u_before:  # the step's new one: the next step's buffer
                    self._spare_velocity = self.velocity
                self.velocity = u_before
            if before_density is not None:
                ar._restore(before_density)
            self._unfold_residual(folded)

        _undo_or_break(self, undo, error)

    def _clip(self) -> None:
        """Local gradient clipping (arXiv 1712.01887 §3.3): this rank's whole gradient is scaled
        to the L2 norm clip_norm·P^(-1/2) when its norm (float64) is larger."""
        limit = self.tech.clip_norm / np.sqrt(self.comm.size)
        if self.flat.is_cuda:  # on the device: torch's reduction order, float64 as well
            norm = float(torch.linalg.vector_norm(self.flat, dtype=torch.float64))
            if norm > limit:
                self.flat.mul_(limit / norm)
            return
        buf = self.flat.numpy()
        norm = float(np.sqrt(np.sum(np.square(buf, dtype=np.float64))))
        if norm > limit:
            buf *= buf.dtype.type(limit / norm)

    def _velocity(self) -> torch.Tensor:
        """This rank's velocity u (created at zero, or from a loaded state by parameter key,
        checked by :meth:`check_pending_velocity` before the step's agreement)."""
        if self.velocity is None:
            u = torch.zeros_like(self.flat)
            saved = self.pending_velocity
            if saved:
                self.check_pending_velocity()
                o = self.offsets
                for i, k in enumerate(self.keys):
                    if k in saved:
                        u[o[i] : o[i + 1]] = torch.from_numpy(saved[k]).to(self.flat.dtype)
            self.velocity, self.pending_velocity = u, None
        return self.velocity

    def check_pending_velocity(self) -> None:
        """Check the loaded velocities that wait for the next step against the layout: every
        key one of this layout's parameters, every velocity as long as its parameter. Run at
        the load when the layout is known, else before the agreement that starts the first
        step (the hook learns its layout there), so that a bad one fails on every rank.

        Raises
        ------
        ValueError
            Naming the parameter.
        """
        saved = self.pending_velocity
        if not saved or self.keys is None:
            return
        lost = sorted(set(saved) - set(self.keys), key=repr)
        if lost:
            raise ValueError(
                f"the state holds velocities of parameters {lost} that are not reduced here"
            )
        for k, m in zip(self.keys, self.numels, strict=True):
            if k in saved and saved[k].shape != (m,):
                raise ValueError(
                    f"the state's velocity of parameter {k!r} has shape {saved[k].shape}, "
                    f"the parameter has {m} elements"
                )

    def velocities(self) -> dict:
        if self.velocity is None or self.keys is None:
            return {}
        u, o = self.velocity.cpu().numpy(), self.offsets
        return {k: np.array(u[o[i] : o[i + 1]]) for i, k in enumerate(self.keys)}

    def residuals(self) -> dict:
        ar = self.sparse
        if ar is None or self.keys is None:
            return {}
        res, o = A.to_host(ar.residual), self.offsets
        return {k: np.array(res[o[i] : o[i + 1]]) for i, k in enumerate(self.keys)}

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        _raise_if(self.restored_error())  # a half-restored state would be saved as if sound
        keys, numels = self.keys, self.numels
        allreducer = None if self.sparse is None else self.sparse.state_dict()
        extra = {}
        if self.sparse is None and self.pending is not None:
            # Loaded, not applied yet (the hook before its first sparse iteration): saved again
            # as it was loaded, so a checkpoint taken now loses nothing (an overlap-mode state's
            # residuals by key stay marked as such).
            allreducer = self.pending.get("allreducer")
            keys, numels = self.pending.get("keys"), self.pending.get("numels")
            if self.pending.get("by_key"):
                extra["by_key"] = True
        return to_torch_state(
            {
                **extra,
                "algorithm": self.algorithm,
                "step": self.step,
                "keys": keys,
                "numels": numels,
                "allreducer": allreducer,
                "stats": copy.deepcopy(self.stats),
                "techniques": self.tech.as_dict(),
                "velocity": self.velocities()
                if self.velocity is not None
                else self.pending_velocity,
            }
        )

    def load_state_dict(self, state: dict) -> None:
        """Collective, all or nothing on every rank: a state invalid on any rank raises on every
        rank and leaves every rank's state (step, counters, velocities, the allreducer's state)
        as it was."""
        step = self.step
        err = self.restored_error()  # agreed below: it may hold on this rank only
        saved = None
        if err is None:  # a half-restored state is neither read nor loaded into
            saved = (
                self.velocity,
                self.pending_velocity,
                copy.deepcopy(self.stats),
                self.pending,
                None if self.sparse is None else self.sparse._snapshot(),
            )
            try:
                self._load_local(state)
            except Exception as e:  # noqa: BLE001 - every rank must hear of any failure
                err = load_error(e)
        try:
            # The allreducer's loaded state must agree across ranks too (counters, ρ, the
            # algorithm's schedule state); loaded later (pending), it is checked when applied.
            agree_on_load(
                self.ctl,
                err,
                [name_hash("load_state_dict"), step, self.step if err is None else -1],
                {
                    "load_state_dict": self.algorithm,
                    "step before": step,
                    "state's step": self.step if err is None else None,
                },
                loaded=self.sparse,
                prefix="allreducer ",
            )
        except BaseException as e:
            if saved is None:  # refused unread: nothing changed
                raise
            self.step = step
            self.velocity, self.pending_velocity, stats, self.pending, ar = saved
            self.stats.clear()
            self.stats.update(stats)
            if ar is not None:
                _undo_or_break(self, lambda: self.sparse._restore(ar), e)
            raise

    def _load_local(self, state) -> None:
        state = _checked_state(state, self.algorithm)
        if "allreducers" in state and "allreducer" not in state:
            raise ValueError(
                "state holds per-bucket allreducers (saved by an older spardl); its residuals "
                "cannot be assigned to parameters"
            )
        saved = state.get("allreducer")
        if saved is not None and (
            not isinstance(saved, dict) or saved.get("world_size") != self.comm.size
        ):
            raise ValueError(
                f"state was saved with world_size="
                f"{saved.get('world_size') if isinstance(saved, dict) else None!r}, "
                f"this one has {self.comm.size} (spardl.elastic loads the states of every "
                "rank at another world size)"
            )
        velocity = _loaded_velocity(state.get("velocity"))
        if velocity and self.tech.momentum is None:
            raise ValueError(
                "the state holds momentum-correction velocities, but momentum_correction is "
                "None here"
            )
        step = check_counter("state step", state["step"])
        stats = _loaded_stats(state.get("stats"), self.stats)
        if self.sparse is not None:
            self._apply(state)  # local and all or nothing; may raise before anything changed
        else:
            self.pending = state
        self.step = step
        self.velocity = None
        self.pending_velocity = velocity or None
        self.check_pending_velocity()  # the layout known: at the load, on every rank
        self.stats.clear()
        self.stats.update(stats)

    def _apply(self, state: dict) -> None:
        """Load a saved state into the sparse allreducer. Same parameters in the same layout:
        the whole allreducer state (bit for bit). Otherwise each parameter's residual goes to its
        new place; the algorithm's own estimates (thresholds, budgets, regions) start afresh.
        A state folded for another world size (:mod:`spardl.elastic`) is loaded by
        ``spardl.elastic``: residual and counters, everything else derived afresh."""
        saved = state.get("allreducer")
        if saved is None:
            return
        ar = self.sparse
        load = ar._load_local
        folded = isinstance(saved, dict) and "resized_from" in saved
        if folded:
            from .elastic import _load_folded

            load = functools.partial(_load_folded, ar)
        if state.get("keys") is None:  # saved before the layout was recorded: same n only
            load(saved)
            return
        same = list(state["keys"]) == self.keys and list(state["numels"]) == self.numels
        # Saved from parameters of another dtype (a model cast since, or mixed dtypes reduced in
        # float32 before float64 joined): the residuals are converted by parameter.
        flat_dtype = str(self.flat.dtype).removeprefix("torch.")
        same = same and (not isinstance(saved, dict) or saved.get("dtype") in (None, flat_dtype))
        if same and not state.get("by_key"):  # by_key: residuals only (overlap mode's states)
            load(saved)
            return
        res = saved.get("residual")
        if res is None:
            return
        offs = np.cumsum([0, *state["numels"]]).tolist()
        old = {k: res[offs[i] : offs[i + 1]] for i, k in enumerate(state["keys"])}
        lost = sorted(k for k in set(old) - set(self.keys) if len(old[k]))  # of no elements: none
        if lost:
            raise ValueError(
                f"the state holds residuals of parameters {lost} that are not reduced here"
            )
        fresh = ar.state_dict()
        dtype = np.dtype(flat_dtype)
        new = np.zeros(self.n, dtype=np.float32 if dtype == np.float16 else dtype)
        for i, k in enumerate(self.keys):
            if k in old:
                if len(old[k]) != self.numels[i]:
                    raise ValueError(
                        f"the state's residual of parameter {k!r} has {len(old[k])} elements, "
                        f"the parameter has {self.numels[i]}"
                    )
                new[self.offsets[i] : self.offsets[i + 1]] = old[k]
        fresh.update(step=int(saved["step"]), dtype=str(dtype), residual=new)
        if folded:
            # The saved counters and density, this world's fresh estimates; an overlap-mode
            # state (residuals and step only) takes the rest from this allreducer.
            fresh = {**fresh, **saved, "n": self.n, "dtype": str(dtype), "residual": new}
        load(fresh)


#: The allreducers of a :class:`_Core`, as its attributes.
_ALLREDUCERS = ("sparse", "dense", "small_dense")


class _Iteration:
    """One overlap-mode iteration as a transaction: what its buckets changed, so that all of it
    is undone when one of them fails (raises, or is skipped by ``nonfinite="skip"``).

    Opened at the iteration's first bucket, closed at its last one (:meth:`_Buckets._end`).
    Nothing of O(n) is copied: the :class:`_Buckets` containers are kept as shallow copies;
    each bucket's allreducers as their snapshots from before the iteration's first step on
    them (``Allreducer._snapshot``: counters, ρ and the algorithm's own state, small, and the
    residual by reference, since an applied step replaces the residual and never writes into
    it); and what :meth:`_Core.run` itself wrote into that residual (the unused parameters'
    slices it set aside, the slices folded into a dense part), copies the step makes anyway.
    """

    def __init__(self, buckets):
        self.saved = (
            dict(buckets.cores),
            dict(buckets.carry),
            dict(buckets.carry_full),
            buckets.carry_step,
            buckets.created,
        )
        self.before = {}  # id(core) -> (core, snapshots by attribute, residual, undo list)
        self.created = []  # cores built in this iteration
        self.released = []  # cores given up in this iteration (a rebuild), closed at the end
        self.buffers = []  # the iteration's bucket buffers
        self.indices = set()  # DDP's indices of its buckets so far
        self.failed = False
        self.error = None  # the first exception of its buckets, the one the caller sees

    def enter(self, core) -> list | None:
        """Record ``core``'s allreducers before its step (the first time in this iteration);
        returns the list :meth:`_Core.run` appends its in-place writes to, or None when the
        step does not start from the recorded residual (the core stepped before in this
        iteration, and that step replaced the residual: what this one writes is dropped)."""
        entry = self.before.get(id(core))
        if entry is None:
            snaps = {
                name: None if getattr(core, name) is None else getattr(core, name)._snapshot()
                for name in _ALLREDUCERS
            }
            entry = (core, snaps, core.sparse._residual, [])
            self.before[id(core)] = entry
        return entry[3] if core.sparse._residual is entry[2] else None

    def add_buffer(self, buf) -> None:
        if not any(b is buf for b in self.buffers):
            self.buffers.append(buf)


class _Buckets:
    """Overlap mode of :class:`SparseHookState`: one :class:`_Core` per DDP bucket (its
    parameters' slices, in the bucket's order), each bucket reduced on one communication thread
    as soon as DDP hands it over, while backward computes the next ones.

    The cores share one pair of communicators (one ``stats``). Residuals are kept per bucket;
    when DDP's bucket layout changes (its rebuild after the first iteration), every core's state
    is carried by parameter key (``carry``: residual slices; ``carry_full``: a bucket's whole
    allreducer state, for a bucket that comes back with the same parameters) into the new cores.

    An iteration is a transaction (:class:`_Iteration`): if any of its buckets raises or is
    skipped, every bucket of it is undone at its last bucket (each bucket allreducer's state,
    the cores, carried states and the iteration count as they were before it) and every
    bucket's buffer is zeroed; the iteration is not counted. Every rank fails in the same
    bucket (the checks that fail a bucket are collective), so every rank undoes the same
    iteration.
    """

    def __init__(self, comm, algorithm, warmup_steps: int, options: dict, tech):
        self.comm, self.ctl = Comm(comm), Comm(comm)
        self.algorithm = algorithm
        self.warmup_steps = warmup_steps
        self.options = dict(options)
        self.tech = tech if tech is not None else _Techniques()
        self.cores = {}  # DDP's bucket index -> _Core
        self.step = 0  # applied iterations
        self.created = 0
        self.carry = {}  # parameter key -> host residual slice, not yet in a bucket's allreducer
        self.carry_full = {}  # (keys, numels) -> a bucket allreducer's whole state
        self.carry_step = 0  # the allreducer step the carried residuals were saved at
        self.checked = False
        self.jobs = queue.Queue()
        self.thread = None
        self.iteration = None  # the open _Iteration (communication thread)
        self.broken = None  # the error of a failed iteration's undo (_undo_or_break), if one raised

    @property
    def stats(self) -> dict:
        return self.comm.stats

    def restored_error(self) -> RuntimeError | None:
        """The RuntimeError of a failed iteration, or of a bucket's failed step, that could not
        be undone (:func:`_restored_error`)."""
        return _restored_error([self]) or next(
            (e for e in (c.restored_error() for c in self.cores.values()) if e is not None), None
        )

    @property
    def sparse(self):
        return None  # one allreducer per bucket: see ``cores``

    @property
    def n(self) -> int:
        """Elements reduced per iteration: the buckets' together (0 before the first)."""
        return sum(core.n for core in self.cores.values())

    # -- the communication thread -----------------------------------------------------------
    def submit(self, work, fut) -> None:
        """Run ``work()`` on the communication thread after the jobs before it; its result or
        exception completes the torch future ``fut``."""
        if self.thread is None:
            self.thread = threading.Thread(
                target=self._serve, args=(self.jobs,), name="spardl-comm", daemon=True
            )
            self.thread.start()
        self.jobs.put((work, fut))

    @staticmethod
    def _serve(jobs) -> None:
        while True:
            work, fut = jobs.get()
            try:
                fut.set_result(work())
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                if not isinstance(e, Exception):  # a torch future takes an Exception only
                    stopped = RuntimeError(
                        f"a bucket's allreduce was stopped by {type(e).__name__}: {e}"
                    )
                    stopped.__cause__ = e
                    e = stopped
                fut.set_exception(e)
            finally:
                jobs.task_done()

    def drain(self) -> None:
        """Wait until the communication thread has finished every submitted bucket."""
        self.jobs.join()

    def close(self) -> None:
        """Finish the submitted buckets, then free every bucket's communicators (collective;
        an unfinished iteration's undo that raises does so after every close)."""
        self.drain()
        first = None
        for close in (
            lambda: self.close_unfinished(zero=False),
            *(core.close for core in self.cores.values()),
            self.comm.free,
            self.ctl.free,
        ):
            try:
                close()
            except BaseException as e:  # noqa: BLE001 - raised below, after every close
                first = first or e
        if first is not None:
            raise first

    # -- one bucket (on the communication thread) -------------------------------------------
    def reduce_bucket(self, index, buf, keys, numels, used, err, last, check_group):
        """Collective, in DDP's bucket order on every rank: the control allreduce (any rank's
        error, which parameters some rank used), then the bucket's sparse allreduce in place.

        The iteration is a transaction (:class:`_Iteration`), opened at its first bucket and
        closed at its ``last`` one: a bucket that raises or is skipped fails the iteration,
        and then every bucket of it is undone there and its buffer zeroed (the future of an
        earlier bucket holds its buffer, which DDP copies into the gradients only after the
        last bucket), and the iteration is not counted."""
        check_counter_room("step", self.step)  # before the iteration opens: nothing changed
        if self.iteration is not None and index in self.iteration.indices:
            # A bucket seen already: the open iteration never reached its last bucket (its
            # backward raised) and this is the next one. Undone, as a failed iteration, but its
            # buffers are not zeroed: they are this iteration's now. An undo that raises (it
            # may on one rank only) fails this bucket in its agreement, on every rank.
            try:
                self.close_unfinished(zero=False)
            except BaseException as e:  # noqa: BLE001 - handed to the agreement below
                # An interrupt too: the other ranks wait in that agreement. On this thread it
                # is no user's (signals reach the main thread), and a torch future takes no
                # interrupt: it goes as the cause of the RuntimeError saying so.
                err = err or self.restored_error() or e
        if self.iteration is None:
            self.iteration = _Iteration(self)
        it = self.iteration
        it.indices.add(index)
        it.add_buffer(buf)
        try:
            if not self.checked:
                check_group()
                self.checked = True
            local = np.zeros(1 + len(keys), dtype=np.int64)
            local[1:] = used
            err = err or self.restored_error()  # agreed: it may hold on this rank only
            total = _step_control(
                self.ctl, err, local, self.options.get("check", True), "reduce_bucket", index
            )
            core = self._core_for(index, keys, numels, buf, it)
            undo = it.enter(core)
            o = core.offsets
            with torch.no_grad():
                core.flat.copy_(buf)
                core.step = self.step  # dense warm-up by iteration, for every bucket alike
                core.run([(o[i], o[i + 1]) for i in range(len(keys)) if total[1 + i] == 0], undo)
                buf.copy_(core.flat)
            _sync(buf)
            if core.step == self.step:  # not counted by run: skipped (nonfinite="skip")
                it.failed = True
            return buf
        except BaseException as e:
            it.failed = True
            if it.error is None:
                it.error = e
            raise
        finally:
            if last:
                self._end()

    def _end(self) -> None:
        """Close the iteration at its last bucket: counted if every bucket of it was applied,
        else undone (every rank alike: a bucket fails on every rank or on none). An undo that
        raises is noted on the iteration's first error, which the hook raises, else raises
        (:func:`_undo_or_break`)."""
        it, self.iteration = self.iteration, None
        if it.failed:
            _undo_or_break(self, lambda: self._undo(it), it.error)
            return
        self.step += 1
        for core in it.released:  # no longer needed to undo the iteration
            core.close()

    def close_unfinished(self, zero: bool = True) -> None:
        """Undo an iteration whose last bucket never came (a backward that raised on the
        way), as a failed one (:meth:`_undo`; its buffers zeroed if ``zero``). Called with
        the communication thread idle: by :meth:`SparseHookState.drain`, :meth:`close`,
        :meth:`load_state_dict`, or on that thread at the next iteration's first bucket."""
        it, self.iteration = self.iteration, None
        if it is not None:
            _undo_or_break(self, lambda: self._undo(it, zero))

    def _undo(self, it: _Iteration, zero: bool = True) -> None:
        """Every bucket of the failed iteration ``it`` as it was before it: each allreducer
        restored from its snapshot (one built in the iteration closed), the residual slices
        its step wrote in place put back, the cores built in the iteration closed and those
        it gave up (a rebuild) back, the carried states as they were; every bucket buffer of
        the iteration zeroed if ``zero``. Local, except the closing (collective, the same on
        every rank). The buffers first: zero even if a restore raises. A restore that raises
        (it may on one rank only) stops no other restore and no close: the first such error is
        raised after them all, so no other rank waits in a close this rank skipped (what that
        core's steps wrote in place is then left: it goes back into restored residuals only)."""
        if zero:
            with torch.no_grad():
                for buf in it.buffers:
                    buf.zero_()
                    _sync(buf)
        first, closing = None, []
        for core, snaps, _, undo in it.before.values():
            if any(core is c for c in it.created):
                continue
            restored = True
            for name, snap in snaps.items():
                ar = getattr(core, name)
                if snap is None:
                    if ar is not None:  # built in this iteration (the warm-up's, say)
                        closing.append(ar)
                        setattr(core, name, None)
                    continue
                try:
                    ar._restore(snap)
                except BaseException as e:  # noqa: BLE001 - raised below, after the closes
                    first, restored = first or e, False
            if restored:  # what the steps wrote in place, into the restored residuals only
                try:
                    core._unstep(undo)
                except BaseException as e:  # noqa: BLE001 - raised below, after the closes
                    first = first or e
        try:
            for ar in closing:
                ar.close()
            for core in it.created:
                core.close()
        finally:
            self.cores, self.carry, self.carry_full, self.carry_step, self.created = it.saved
        if first is not None:
            raise first

    def _core_for(self, index, keys, numels, buf, it: _Iteration) -> _Core:
        core = self.cores.get(index)
        dtype = _flat_dtype([buf.dtype])
        if core is not None and (
            (core.keys, core.numels, core.flat.dtype, core.flat.device)
            != (keys, numels, dtype, buf.device)
        ):
            self._release(it)  # DDP rebuilt its buckets: every core's state goes by key
            core = None
        if core is None:
            opts = (self.algorithm, self.warmup_steps, self.options, self.tech)
            core = _Core(None, *opts, comms=(self.comm, self.ctl))
            it.created.append(core)
            core.set_layout(keys, numels, dtype, buf.device)
            core.pending = self._claim(keys, numels)
            core.allreducer(dense=False)  # collective; applies the carried state
            self.cores[index] = core
            self.created += 1
        return core

    def _release(self, it: _Iteration) -> None:
        """Every core's state into ``carry`` / ``carry_full`` (by parameter key); cores dropped,
        and closed when the iteration ``it`` ends (undoing it brings them back)."""
        for core in self.cores.values():
            saved = core.sparse.state_dict()
            self.carry_full[(tuple(core.keys), tuple(core.numels))] = saved
            self.carry.update(_by_key(core.keys, core.numels, saved.get("residual")))
            self.carry_step = int(saved["step"])
            it.released.append(core)
        self.cores = {}

    def _claim(self, keys, numels):
        """The carried state of a new bucket's parameters, as a state :meth:`_Core._apply` loads:
        the whole allreducer state if a bucket had exactly these parameters, else their
        residuals by key (the algorithm's own estimates start afresh)."""
        full = self.carry_full.pop((tuple(keys), tuple(numels)), None)
        if full is not None:
            for k in keys:
                self.carry.pop(k, None)
            return {"keys": keys, "numels": numels, "allreducer": full}
        have = [i for i, k in enumerate(keys) if k in self.carry]
        if not have:
            return None
        mine = set(keys)
        for layout in [kn for kn in self.carry_full if mine & set(kn[0])]:
            del self.carry_full[layout]  # no longer loadable whole
        residual = np.concatenate([self.carry.pop(keys[i]) for i in have])
        return {
            "by_key": True,
            "keys": [keys[i] for i in have],
            "numels": [numels[i] for i in have],
            "allreducer": {"residual": residual, "step": self.carry_step},
        }

    # -- state (main thread, after drain) ----------------------------------------------------
    def residuals(self) -> dict:
        self.drain()
        out = {k: np.array(v) for k, v in self.carry.items()}
        for core in self.cores.values():
            res = A.to_host(core.sparse.residual)
            out.update(_by_key(core.keys, core.numels, res, copy=True))
        return out

    def velocities(self) -> dict:
        return {}  # momentum_correction is not available in overlap mode

    def state_dict(self) -> dict:
        self.drain()
        _raise_if(self.restored_error())  # a half-restored state would be saved as if sound
        if self.iteration is not None:  # its applied buckets would be saved without the rest
            raise RuntimeError(
                "an iteration is open: its backward stopped before DDP's last bucket, so part "
                "of it is applied; call drain() first (it undoes that iteration), then save"
            )
        buckets = [
            {"keys": c.keys, "numels": c.numels, "allreducer": c.sparse.state_dict()}
            for _, c in sorted(self.cores.items())
        ]
        buckets += [
            {"keys": list(kn[0]), "numels": list(kn[1]), "allreducer": saved}
            for kn, saved in self.carry_full.items()
        ]
        res = self.residuals()
        keys = list(res)
        steps = [int(b["allreducer"]["step"]) for b in buckets] or [self.carry_step]
        return to_torch_state(
            {
                "algorithm": self.algorithm,
                "step": self.step,
                "by_key": True,  # the residuals of every parameter; the buckets' states whole
                "keys": keys,
                "numels": [len(res[k]) for k in keys],
                "allreducer": {
                    "residual": np.concatenate([res[k] for k in keys]) if keys else None,
                    "step": max(steps),
                    "world_size": self.comm.size,
                },
                "buckets": buckets,
                "stats": copy.deepcopy(self.stats),
                "techniques": self.tech.as_dict(),
                "velocity": None,
            }
        )

    def load_state_dict(self, state) -> None:
        """Collective, all or nothing (as :meth:`_Core.load_state_dict`); the state is carried by
        key into the buckets' allreducers as they are built (whole where a saved bucket had
        the same parameters). An iteration left open by a backward that stopped early is
        undone first, whether the load is then taken or refused (it is never resumed)."""
        self.drain()
        err, new = None, None
        try:
            # An unfinished iteration is undone whatever the load's outcome (it is never
            # resumed); its undo, a half-restored state (both may hold on this rank only) and a
            # state that does not load are agreed below, so every rank refuses together.
            self.close_unfinished(zero=False)
        except BaseException as e:  # noqa: BLE001 - every rank must hear of it
            # The RuntimeError saying so, the undo's error its cause; an interrupt as it is: it
            # propagates (as from _undo_or_break), raised here by the agreement, after it.
            err = e if not isinstance(e, Exception) else self.restored_error() or e
        err = err or self.restored_error()
        try:
            if err is None:
                new = self._load_local(state)
        except Exception as e:  # noqa: BLE001 - every rank must hear of any failure
            err = load_error(e)
        step = -1 if new is None else new[0]
        collective_check(
            self.ctl,
            err,
            [name_hash("load_state_dict"), self.step, step],
            {"load_state_dict": self.algorithm, "step before": self.step, "state's step": step},
        )
        for core in self.cores.values():
            core.close()
        self.step, stats, self.carry_full, self.carry, self.carry_step = new
        self.cores = {}
        self.stats.clear()
        self.stats.update(stats)

    def _load_local(self, state):
        state = _checked_state(state, self.algorithm)
        if state.get("velocity"):
            raise ValueError(
                "the state holds momentum-correction velocities; overlap mode does not use them"
            )
        saved = state.get("allreducer")
        full, carry, carry_step = {}, {}, 0
        if saved is not None:
            if not isinstance(saved, dict) or saved.get("world_size") != self.comm.size:
                got = saved.get("world_size") if isinstance(saved, dict) else None
                raise ValueError(
                    f"state was saved with world_size={got!r}, this one has {self.comm.size}"
                )
            keys, numels = state.get("keys"), state.get("numels")
            if keys is None:
                raise ValueError(
                    "state has no parameter layout (saved by an older spardl); overlap mode "
                    "assigns residuals by parameter"
                )
            if not state.get("by_key") and "resized_from" not in saved:
                full[(tuple(keys), tuple(numels))] = saved
            for b in state.get("buckets") or []:
                full[(tuple(b["keys"]), tuple(b["numels"]))] = b["allreducer"]
            carry = _by_key(keys, numels, saved.get("residual"), copy=True)
            carry_step = int(saved.get("step", 0))
        return (
            check_counter("state step", state["step"]),
            _loaded_stats(state.get("stats"), self.stats),
            full,
            carry,
            carry_step,
        )


def _by_key(keys, numels, residual, copy=False) -> dict:
    """A flat residual's slices by parameter key (empty for no residual)."""
    if residual is None:
        return {}
    offs = np.cumsum([0, *numels]).tolist()
    res = np.asarray(residual)
    return {
        k: (np.array if copy else np.asarray)(res[offs[i] : offs[i + 1]])
        for i, k in enumerate(keys)
    }


class _Front:
    """What :class:`SparseGradientReducer` and :class:`SparseHookState` show of their core
    (``self._core``): step, counters, residuals and velocities by parameter, checkpoints."""

    _core: _Core

    def close(self) -> None:
        """Free the MPI communicators this object and its allreducers created (collective:
        every rank closes at the same point; idempotent). Use it, or a ``with`` block, where a
        program builds reducers or hook states repeatedly: MPI libraries allow a bounded
        number of communicators per process (MPICH: about 2,000). Checkpoints
        (:meth:`state_dict`) stay readable.

        Raises
        ------
        ValueError
            From :meth:`SparseGradientReducer.reduce` or the hook, once closed.
        """
        if not getattr(self, "_closed", False):
            # The submitted work first (overlap mode's buckets): if that wait raises (an
            # interrupt), this object is still open, with nothing freed, and close() can be
            # called again; once closed, a second close() does nothing.
            self._core.drain()
            self._closed = True
            self._core.close()

    def _check_open(self) -> None:
        if getattr(self, "_closed", False):
            raise ValueError(f"{type(self).__name__} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def step(self) -> int:
        """Completed steps: calls of ``reduce`` (the reducer), iterations (the hook)."""
        return self._core.step

    @property
    def stats(self) -> dict:
        """Cumulative message and byte counters of the allreducers (warm-up included); see
        :mod:`spardl.comm`."""
        return self._core.stats

    def velocities(self) -> dict:
        """Each parameter's momentum-correction velocity u (this rank's), keyed like the
        checkpoint: name or position.

        Returns
        -------
        dict of str -> ndarray
            Empty without ``momentum_correction`` or before the first step.
        """
        return self._core.velocities()

    def residuals(self) -> dict:
        """Each parameter's residual (this rank's), keyed like the checkpoint: name or position.

        Returns
        -------
        dict of str -> ndarray
            Empty before the first sparse step.
        """
        return self._core.residuals()

    def state_dict(self) -> dict:
        """The allreducer's state (residuals, selector state, density), the parameter layout,
        step and counters, and with ``momentum_correction`` the velocities keyed by parameter
        (they follow their parameters into another layout, like the residuals).

        Arrays are torch tensors and scalars plain Python numbers, so ``torch.save`` /
        ``torch.load`` (with its default ``weights_only=True``) round-trip it.

        Raises
        ------
        RuntimeError
            If a failed step could not be undone (its undo raised): the state is half restored.
            Every later call but :meth:`close` refuses: this one (local) on this rank, the
            collective ones on every rank (this rank's RuntimeError, named by the others in a
            ValueError). In overlap mode also while an iteration is open (a backward that
            stopped before DDP's last bucket, with some buckets applied): :meth:`drain` first.
        """
        return self._core.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`. Same parameters in the same layout: the next step
        continues bit for bit. Another layout (other parameters' order, a parameter more):
        each parameter's residual follows it, by key; the algorithm's own estimates (Ok-Topk's
        thresholds and regions, SparDL's budget h, selector state) start afresh. The hook
        applies it when its allreducer is created (at the first sparse iteration).

        Collective (every rank calls it, with its own rank's state), and all or nothing: a
        state that is bad on any rank raises on every rank, and every rank's state (step,
        counters, velocities, the allreducer's state) stays as it was.

        Raises
        ------
        TypeError
            On every rank, if some rank's ``state`` is not a dict.
        ValueError
            On every rank, if some rank's state misses a key, was saved with another algorithm
            or world size, or holds residuals of parameters that are not reduced here (or of
            another size), or this object is closed.
        """
        self._check_open()
        self._core.load_state_dict(state)


class SparseHookState(_Front):
    """State of :func:`sparse_allreduce_hook`: one allreducer over the model's gradient, with
    residuals kept by parameter.

    By default the hook gathers every bucket of an iteration and reduces the whole model's
    gradient as one vector, laid out by parameter (the order of ``model.parameters()`` when
    ``model`` is given, else the order of DDP's first iteration), with one sparse allreducer:
    the result does not depend on DDP's buckets (their rebuild after the first iteration,
    ``bucket_cap_mb``), and a run resumed into a fresh DDP continues bit for bit. The result
    equals :class:`SparseGradientReducer`'s on the same parameters. With ``overlap=True`` each
    bucket is reduced on its own as soon as DDP hands it over, on a communication thread, while
    backward goes on. CUDA buckets stay on the device in both modes.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The communicator the sparse allreduce runs over (duplicated inside); the same ranks as
        DDP's process group, checked against the default process group (size and rank) at the
        first call: launch with ``mpiexec``, not torchrun.
    algorithm : str, default "spardl"
        A key of :data:`spardl.ALGORITHMS`, or "auto" (:class:`spardl.algorithms.auto.Auto`).
    warmup_steps : int, default 2
        Dense allreduce for the first ``warmup_steps`` iterations.
    model : torch.nn.Module, optional
        The model (or its DDP wrapper). Recommended: parameters are then named in checkpoints
        and errors (a checkpoint loads by name, whatever the layout), and the parameters a rank
        used are known from the first iteration on (``find_unused_parameters=True``). A
        parameter DDP reduces that is not one of its parameters (another module
        given) is a ValueError on every rank, raised after that backward, the step not applied.
    momentum_correction, factor_masking, clip_norm, density_warmup, warmup_density
        Deep Gradient Compression's techniques, as in :class:`SparseGradientReducer`; they run on
        the model's whole gradient (every bucket of the iteration), with the velocity kept by
        parameter and checkpointed in :meth:`state_dict`.
    dense_numel : int, default 0
        Parameters with at most this many elements reduced dense, as in
        :class:`SparseGradientReducer` (in overlap mode bucket by bucket: a bucket of small
        parameters only is reduced dense as a whole).
    overlap : bool, default False
        Reduce each DDP bucket as soon as DDP hands it over, on one communication thread, while
        backward computes the next buckets: the hook's future for a bucket completes when that
        bucket's sparse allreduce finishes. Buckets are reduced in DDP's order (the same on
        every rank), each with its own allreducer and residuals (kept per parameter slice of
        the bucket, checkpointed by parameter key): results then depend on DDP's bucket layout
        (``bucket_cap_mb``), unlike the default mode, and are not bit-identical to it. Needs
        MPI initialised with at least ``MPI.THREAD_SERIALIZED`` (mpi4py's default is
        ``THREAD_MULTIPLE``); under ``THREAD_SERIALIZED`` the program must not call MPI itself
        during backward. ``clip_norm`` and ``momentum_correction`` (which need the whole
        gradient) are not available with it. The iteration stays the transaction: a bucket
        that fails undoes every bucket of its iteration (Notes).
    **allreducer_options
        Passed to :func:`spardl.make` (``density``, ``teams``, ``residual``, ...). ``op`` is
        always "mean", as DDP expects averaged gradients.

    Attributes
    ----------
    step : int
        Completed iterations (one that raised or was skipped is not counted).
    allreducer : spardl.Allreducer or None
        The sparse allreducer (created at the first sparse iteration).
    stats : dict
        Cumulative message and byte counters of the allreducers, warm-up included.

    Raises
    ------
    ValueError, TypeError
        On every rank (collective), if any rank's algorithm, option or ``warmup_steps`` is
        invalid or the ranks disagree; the messages are those of :func:`spardl.make`; with
        ``overlap=True``, if ``clip_norm`` or ``momentum_correction`` is given.
    RuntimeError
        With ``overlap=True``, if MPI's thread level (``MPI.Query_thread()``) is below
        ``MPI.THREAD_SERIALIZED`` (other ranks: a ValueError naming it).

    Notes
    -----
    An iteration is a transaction in both modes. In the default mode it is one step of one
    allreducer. In overlap mode it is one step per bucket, and a bucket that fails (an error
    while it is reduced: a rank's sparse gradient, a non-finite gradient with
    ``nonfinite="raise"``; or a non-finite gradient skipped with ``nonfinite="skip"``) fails
    the whole iteration: at its last bucket every bucket of it is undone (each bucket
    allreducer's state, residuals included, as before the iteration; the iteration not
    counted in ``step``) and every bucket's future holds zeros, so every gradient of the
    iteration reads as zero, as in the default mode. Every rank fails in the same bucket (the
    checks are collective), so every rank undoes the iteration. ``stats`` keep counting what
    was sent. An error is raised by the hook at the iteration's last bucket (after the others
    are reduced), so ``loss.backward()`` raises it on every rank with its own type.

    Parameters that no rank used in an iteration (``find_unused_parameters=True``) keep their
    residual: DDP leaves their ``.grad`` alone, so what was selected for them is put back.
    Sparse gradients (``nn.Embedding(sparse=True)``) raise a TypeError naming the parameter.
    """

    def __init__(
        self,
        comm,
        algorithm: str = "spardl",
        warmup_steps: int = 2,
        *,
        model=None,
        momentum_correction=None,
        factor_masking: bool = True,
        clip_norm=None,
        density_warmup: int = 0,
        warmup_density: float | None = None,
        dense_numel: int = 0,
        overlap: bool = False,
        **allreducer_options,
    ):
        err, tech = None, None
        try:
            warmup_steps = _check_warmup(warmup_steps)
            if model is not None and not isinstance(model, torch.nn.Module):
                raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
            check_bool("overlap", overlap)
            if overlap:
                _check_overlap(momentum_correction, clip_norm)
            tech = _Techniques(
                momentum_correction,
                factor_masking,
                clip_norm,
                density_warmup,
                warmup_density,
                dense_numel=dense_numel,
                density=allreducer_options.get("density", _DEFAULT_DENSITY),
                residual=allreducer_options.get("residual", "global"),
            )
        except (TypeError, ValueError, RuntimeError) as e:
            err = e
        agreed = {
            "warmup_steps": warmup_steps,
            "overlap": overlap,
            **(tech.as_dict() if tech else {}),
        }
        if err is None and model is not None:
            inner = getattr(model, "module", model)
            named = [(k, p) for k, p in inner.named_parameters() if p.requires_grad]
            agreed["parameters"] = _layout([k for k, _ in named], [p for _, p in named])
        self.overlap = overlap is True
        core = _Buckets if self.overlap else _Core
        self._core = core(comm, algorithm, 0, allreducer_options, tech)
        _validate_options(
            self._core.ctl, algorithm, allreducer_options, err, hook=True, agreed=agreed
        )
        self._core.warmup_steps = warmup_steps
        self.algorithm = algorithm
        self.warmup_steps = warmup_steps
        self._names = None
        self._params = None
        self._used = None
        self._index = None  # parameter id -> position (keys of unnamed parameters)
        self._errors = []  # overlap mode: this iteration's errors, from the communication thread
        self._inflight = []
        self._order = None  # the flat layout's parameters, from the first iteration
        self._order_ids = set()
        self._refused = None  # an iteration's end that cannot be known: refused for good
        self._first_done = False  # overlap mode: an iteration has ended (its buckets are known)
        self._strangers = set()  # overlap mode: ids of parameters refused as another model's
        self._checked = False
        if model is not None:
            inner = getattr(model, "module", model)
            named = [(k, p) for k, p in inner.named_parameters() if p.requires_grad]
            self._names = {id(p): k for k, p in named}
            self._params = [p for _, p in named]
            self._track(self._params)
            self._model_ids = {id(p) for p in inner.parameters()}

    def _track(self, params) -> None:
        # A gradient hook fires when autograd computes the parameter's gradient, before DDP's
        # own hook marks it ready: at the last bucket, every parameter this rank used is known.
        if self._used is None:
            self._used = {}
        for p in params:
            if id(p) not in self._used:
                self._used[id(p)] = False
                p.register_hook(self._mark(id(p)))

    def _mark(self, key):
        used = self._used  # not self: the model's hooks do not keep this state alive

        def hook(grad):
            used[key] = True

        return hook

    @property
    def allreducer(self):
        """The sparse allreducer (created at the first sparse iteration); None in overlap mode,
        where each bucket has its own."""
        return self._core.sparse

    @property
    def created(self) -> int:
        """How many sparse allreducers this state has created (one; in overlap mode one per
        bucket, and again after DDP rebuilds its buckets)."""
        return self._core.created

    def drain(self) -> None:
        """Overlap mode: wait until every bucket handed to the communication thread is reduced
        (DDP waits for them itself at the end of backward; this is for a backward that raised),
        then undo the iteration if it never reached its last bucket (every bucket of it
        restored, as for a failed iteration, and its gradients zero; collective when it built
        or gave up bucket allreducers). A no-op otherwise. Without this call the next
        iteration's first bucket undoes it, leaving the buffers alone."""
        if self.overlap:
            self._core.drain()
            # An iteration whose backward raised before its last bucket is not applied: every
            # bucket of it undone, its gradients zero.
            self._core.close_unfinished()

    # -- the hook's work --------------------------------------------------------------------
    def _name(self, p, i=None) -> str:
        if self._names is not None and id(p) in self._names:
            return self._names[id(p)]
        return f"#{i}" if i is not None else f"of shape {tuple(p.shape)}"

    def _unknown_parameter(self, p) -> ValueError:
        """The error for a parameter DDP hands over that the first iteration's buckets did not
        hold (both hook modes)."""
        return ValueError(
            f"parameter {self._name(p)} is in DDP's buckets but was not at the first iteration "
            "(one SparseHookState serves one DDP model)"
        )

    def _foreign(self, params) -> ValueError | None:
        """The error for parameters DDP reduces that the ``model`` given to the state does not
        hold (another module than the one DDP wraps: its names would key nothing); None when
        every one is the model's, or no model was given."""
        if self._names is None:
            return None
        foreign = [p for p in params if id(p) not in self._model_ids]
        if not foreign:
            return None
        return ValueError(
            f"model: {len(foreign)} parameter(s) DDP reduces (shapes "
            f"{', '.join(str(tuple(p.shape)) for p in foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}) are not parameters of the model "
            "given as model=; pass the module DDP wraps (or the DDP wrapper itself)"
        )

    def _check_group(self) -> None:
        """Collective, once: the MPI communicator is DDP's (default) process group."""
        import torch.distributed as dist

        ctl, err = self._core.ctl, None
        if dist.is_available() and dist.is_initialized():
            mine = (dist.get_rank(), dist.get_world_size())
            if mine != (ctl.rank, ctl.size):
                err = ValueError(
                    f"comm has rank {ctl.rank} of {ctl.size} but the torch.distributed process "
                    f"group has rank {mine[0]} of {mine[1]}: start one MPI job (mpiexec -n P "
                    "python train.py, then init_process_group_from_mpi(comm)), not torchrun"
                )
        collective_check(ctl, err, [ctl.size], {"size": ctl.size})
        self._checked = True

    def _bucket(self, bucket):
        self._check_open()
        if self.overlap:
            return self._bucket_overlap(bucket)
        if not self._checked:
            self._check_group()
        fut = _future(bucket.buffer())
        if self._refused is not None:  # see below: every later bucket is given back as zeros
            bucket.buffer().zero_()
            fut.set_result(bucket.buffer())
            _raise_after_backward(self._refused)
            return fut
        index = bucket.index()
        repeated = any(i == index for i, _, _, _ in self._inflight)
        self._inflight.append((index, bucket.buffer(), list(bucket.parameters()), fut))
        if not (bucket.is_last() or self._covered()):
            if repeated and self._expected() is None:
                # DDP numbers two buckets of one iteration alike (its delayed first iteration
                # under static_graph=True with several dtypes), and is_last() never comes: the
                # end of the iteration is known only from the parameters (model=).
                self._refused = ValueError(
                    f"DDP handed over two buckets numbered {index} in one iteration (its first "
                    "iteration under static_graph=True with parameters of several dtypes), so "
                    "the hook cannot tell when the iteration ends: pass model= to "
                    "SparseHookState (then the parameters tell)"
                )
                inflight, self._inflight = self._inflight, []
                for _, buf, _, f in inflight:
                    buf.zero_()
                    f.set_result(buf)
                _raise_after_backward(self._refused)
            return fut
        inflight = [(buf, params, f) for _, buf, params, f in self._inflight]
        self._inflight = []
        try:
            self._reduce(inflight)
        except Exception as e:  # noqa: BLE001 - raised once DDP has finished the backward
            for buf, _, f in inflight:
                buf.zero_()  # nothing of this step is applied: the gradients read as zero
                f.set_result(buf)
            _raise_after_backward(e)
            return fut
        for buf, _, f in inflight:
            f.set_result(buf)
        return fut

    def _expected(self) -> set | None:
        """The ids of the parameters every iteration's buckets hold together: the layout's once
        it is set, else those of ``model=`` (the trainable ones); None when not yet known."""
        if self._order is not None:
            return self._order_ids
        if self._params is not None:
            return {id(p) for p in self._params}
        return None

    def _covered(self) -> bool:
        """Whether this iteration's buckets so far hold every expected parameter: the end of
        the iteration, where DDP's is_last() does not say so."""
        expected = self._expected()
        if expected is None:
            return False
        seen = {id(p) for _, _, params, _ in self._inflight for p in params}
        return expected <= seen

    def _bucket_overlap(self, bucket):
        """Overlap mode: what the bucket's reduction needs, taken now (on the autograd thread);
        the reduction itself queued on the communication thread."""
        buf, params = bucket.buffer(), list(bucket.parameters())
        err = None
        if buf.layout != torch.strided:
            names = ", ".join(self._name(p) for p in params)
            err = TypeError(
                f"parameter {names} has a sparse gradient ({buf.layout}); "
                "sparse_allreduce_hook reduces dense gradients only (use "
                "nn.Embedding(sparse=False))"
            )
        err = err or self._foreign(params)
        if self._index is None:
            self._index = {id(p): i for i, p in enumerate(self._params or [])}
            self._track([])
        unknown = [p for p in params if id(p) not in self._index or id(p) in self._strangers]
        if unknown and self._first_done and err is None:
            self._strangers.update(id(p) for p in unknown)  # refused at every later iteration
            # Every bucket holds all its parameters on every iteration, so a parameter first
            # seen after the first iteration belongs to another model sharing this state.
            err = self._unknown_parameter(unknown[0])
        new = [p for p in params if id(p) not in self._used or id(p) not in self._index]
        for p in new:
            self._index.setdefault(id(p), len(self._index))
        self._track(new)
        fresh = {id(p) for p in new}  # tracked from now on: counted as used this time
        used = [1 if id(p) in fresh or self._used[id(p)] else 0 for p in params]
        for p in params:
            self._used[id(p)] = False
        keys = [self._name(p, self._index[id(p)]) for p in params]
        numels = [p.numel() for p in params]
        fut = _future(buf)
        reduce = functools.partial(
            self._core.reduce_bucket,
            bucket.index(),
            buf,
            keys,
            numels,
            used,
            err,
            bucket.is_last(),
            self._check_group,
        )

        def work():
            try:
                return reduce()
            except Exception as e:  # noqa: BLE001 - raised at the last bucket, after backward
                self._errors.append(e)
                # The iteration failed: undone at its last bucket, where every bucket buffer of
                # it is zeroed (this one too, now).
                buf.zero_()
                return buf

        self._core.submit(work, fut)
        if bucket.is_last():
            self._first_done = True
            # Backward has computed every bucket: wait for the last reductions here (DDP would
            # wait right after), so that an error raises from backward with its own type, on
            # every rank.
            self._core.drain()
            errors, self._errors = self._errors, []
            if errors:
                _raise_after_backward(errors[0])
        return fut

    def _reduce(self, inflight) -> None:
        """Reduce the iteration's buckets ``inflight`` ((buffer, parameters, future) each) as one
        flat gradient, and write the result back into the buffers."""
        core = self._core
        err, seen, params = self._dense_slices(inflight)
        first = False
        if core.keys is None:
            first = self._first_layout(params, inflight)
        local, err = self._copy_in(seen, first, err)
        err = core.restored_error() or err  # agreed below (see SparseGradientReducer.reduce)
        if err is None:
            try:
                core.check_pending_velocity()  # a loaded one meets its layout here
            except ValueError as e:
                err = e
        total = _step_control(
            core.ctl, err, local, core.options.get("check", True), "hook iteration"
        )
        o = core.offsets
        core.run([(o[i], o[i + 1]) for i in range(len(core.keys)) if total[1 + i] == 0])
        with torch.no_grad():
            for p, buf, off in seen:
                i = self._index[id(p)]
                buf[off : off + p.numel()].copy_(core.flat[o[i] : o[i + 1]])

    def _dense_slices(self, inflight):
        """Where each parameter's gradient lies: (error, [(param, buffer, offset in it)] of the
        dense buckets, every parameter); the error names a bucket with a sparse gradient."""
        err = None
        seen = []
        params = []
        for buf, ps, _ in inflight:
            params += ps
            if buf.layout != torch.strided:
                if err is None:
                    names = ", ".join(self._name(p) for p in ps)
                    err = TypeError(
                        f"parameter {names} has a sparse gradient ({buf.layout}); "
                        "sparse_allreduce_hook reduces dense gradients only (use "
                        "nn.Embedding(sparse=False))"
                    )
                continue
            off = 0
            for p in ps:
                seen.append((p, buf, off))
                off += p.numel()
        return err or self._foreign(params), seen, params

    def _first_layout(self, params, inflight) -> bool:
        """The flat layout at the first iteration: the parameters in the order given to the
        state (then those it did not list), on the buckets' device when they share one.
        Returns whether usage is tracked from now on (the first call)."""
        ids = {id(p) for p in params}
        order = [p for p in self._params if id(p) in ids] if self._params else []
        order += [p for p in params if id(p) not in {id(q) for q in order}]
        self._order = order
        self._order_ids = {id(p) for p in order}
        self._index = {id(p): i for i, p in enumerate(order)}
        keys = [self._name(p, i) for i, p in enumerate(order)]
        dtype = _flat_dtype(p.dtype for p in order)
        devices = {buf.device for buf, _, _ in inflight}
        device = devices.pop() if len(devices) == 1 else None
        self._core.set_layout(keys, [p.numel() for p in order], dtype, device)
        first = self._used is None
        if first:
            self._track(order)
        return first

    def _copy_in(self, seen, first: bool, err):
        """Copy the gradients into the flat buffer (zeros for parameters no bucket holds).
        Returns (the control vector [failed, used per parameter], error); the error names a
        parameter that was not in the first iteration's layout. Usage is reset."""
        core = self._core
        m = len(core.keys)
        local = np.zeros(1 + m, dtype=np.int64)
        present = np.zeros(m, dtype=bool)
        flat, o = core.flat, core.offsets
        with torch.no_grad():
            for p, buf, off in seen:
                i = self._index.get(id(p))
                if i is None:
                    if err is None:
                        err = self._unknown_parameter(p)
                    continue
                flat[o[i] : o[i + 1]].copy_(buf[off : off + p.numel()])
                present[i] = True
                local[1 + i] = 1 if first else int(self._used.get(id(p), False))
            for i in np.flatnonzero(~present):
                flat[o[i] : o[i + 1]].zero_()
        for key in self._used:
            self._used[key] = False
        return local, err


def sparse_allreduce_hook(state: SparseHookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: sparse allreduce of the model's gradient over MPI.

    Use as ``ddp_model.register_comm_hook(state, sparse_allreduce_hook)``.

    Parameters
    ----------
    state : SparseHookState
    bucket : torch.distributed.GradBucket
        DDP's bucket; its flat ``buffer()`` (float16/32/64 or bfloat16) holds this rank's
        gradients of ``bucket.parameters()``.

    Returns
    -------
    torch.futures.Future
        Holds the bucket's buffer overwritten with the averaged (sparse) gradient, same dtype,
        shape and device, as the DDP hook API requires. The futures of an iteration complete
        at its last bucket, when the whole gradient is reduced (DDP waits for them only after
        the backward pass).

    Raises
    ------
    ValueError
        On every rank at the first call, if ``state``'s communicator is not DDP's process group
        (size and rank), e.g. under torchrun.
    TypeError
        On every rank, if a parameter has a sparse gradient.
    spardl.NonFiniteError
        On every rank, with ``nonfinite="raise"``, if the reduced gradient holds NaN or Inf.

    Errors found while reducing come out of ``backward()`` after DDP has finished the iteration
    (an autograd final callback), so DDP stays usable: nothing of the iteration is applied
    (every residual and counter as before it, in overlap mode every bucket's too) and every
    gradient of it is zero; catch the error, skip ``optimizer.step()``, and go on with the
    next batch. An iteration skipped by ``nonfinite="skip"`` leaves the same, without an error.

    Notes
    -----
    The first ``state.warmup_steps`` iterations use a dense allreduce (Ok-Topk and DGC warm up
    densely as well: arXiv 2201.07598 §5, arXiv 1712.01887 §3). The sparse result is mean-reduced
    by the allreducer; entries no rank selected are zero, and what was not sent stays in the
    residual for the next iteration (error feedback, arXiv 1809.07599). bfloat16 and float16
    gradients accumulate in float32 (float16: in the allreducer's work dtype).
    """
    return state._bucket(bucket)


class SparseGradientReducer(_Front):
    """Sparse allreduce of a model's gradients in a plain training loop (the papers' setup).

    After ``loss.backward()``, :meth:`reduce` flattens every gradient into one contiguous buffer,
    runs the allreducer on it, and writes the averaged result back into each ``.grad``.

    Parameters
    ----------
    params : iterable of torch.nn.Parameter or of (name, Parameter)
        The parameters whose gradients are reduced (those with ``requires_grad``), in the same
        order on every rank; ``model.named_parameters()`` names them in errors and checkpoints.
        n = their total number of elements.
    comm : mpi4py.MPI.Intracomm
        The communicator (duplicated inside).
    algorithm : str, default "spardl"
        A key of :data:`spardl.ALGORITHMS`, or "auto" (:class:`spardl.algorithms.auto.Auto`).
    warmup_steps : int, default 0
        Dense allreduce for the first ``warmup_steps`` calls.
    momentum_correction : float, optional
        Momentum correction (Lin et al., Deep Gradient Compression, arXiv 1712.01887, §3.2):
        the momentum coefficient m. Each rank keeps a velocity u ← m·u + g (``torch.optim.SGD``'s
        momentum buffer, in the gradient's dtype) and the allreducer reduces u instead of g; its
        residual E plays the role of DGC's accumulated velocity v's unsent part
        (X = u + E_old is what is sparsified). The optimizer must then run WITHOUT momentum on
        the reduced result (``SGD(params, lr, momentum=0)``; weight decay, if any, is then applied
        after the reduction). Needs ``residual`` "global" or "local". With ``algorithm="dense"``
        every step is a dense one: u is reduced whole and never masked (SGD with momentum on
        the mean gradient). Default None: off.
    factor_masking : bool, default True
        Momentum factor masking (arXiv 1712.01887 §3.2), with ``momentum_correction``: after a
        sparse step, u_i ← 0 on every coordinate i where this rank's accumulation left its
        residual, defined as E_new,i = 0 and X_i ≠ 0 (X = u + E_old, in the allreducer's work
        dtype). For every algorithm this is where this rank's value was sent and not put back
        by error feedback (with ``residual="global"``, dropped downstream mass stays in some
        rank's residual and so is not counted as sent by the rank holding it). Dense warm-up steps
        (``warmup_steps``) send everything and do not mask: they are dense SGD with momentum.
        At density 1 masking zeroes u after every step (DGC's algorithm then is SGD without
        momentum); ``factor_masking=False`` at density 1 is SGD with momentum.
    clip_norm : float, optional
        Local gradient clipping (arXiv 1712.01887 §3.3), before the accumulation into u (or
        into the residual): this rank's whole gradient g (every reduced parameter, one vector)
        is scaled by (clip_norm·P^(-1/2))/‖g‖₂ when ‖g‖₂ (computed in float64) is larger: the P
        ranks' shares of a global threshold clip_norm, were their gradients identically
        distributed (the paper's N^(-1/2) scaling). Applied on every step, dense warm-up
        included. Default None.
    density_warmup : int, default 0
        Exponential density warm-up (arXiv 1712.01887 §3.3) over this many sparse steps (after
        the dense ``warmup_steps``): ρ_s = warmup_density·(density/warmup_density)^(s/W), then
        ``density``; applied by :meth:`spardl.Allreducer.set_density` (no rebuild, residuals
        kept). 0: off.
    warmup_density : float, optional
        The density of the warm-up's first sparse step (DGC starts at 25%), in (0, 1], at least
        ``density``; given only with ``density_warmup`` > 0 (default then: 0.25).
    dense_numel : int, default 0
        Parameters with at most this many elements (biases, normalisation gains and shifts)
        are reduced by a dense allreduce instead of the sparse one, as PowerSGD and
        PyTorch's PowerSGD hook leave 1-D tensors uncompressed: they are a small share of n
        but rarely win a place in a global top-k, where each element of theirs matters more.
        Each step then runs one more (small) allreduce; the sparse allreducer never selects
        them (their slices of its input are zeros) and their residual is left as it is. With
        ``momentum_correction`` their velocity is kept (not factor-masked): they are sent in
        full every step, which is momentum SGD. With ``op="sum"`` they are summed. A
        residual that a loaded state holds on them (saved with a smaller ``dense_numel``) is
        sent with them at the next step. When every parameter is that small, every step is a
        dense one. 0: off (every parameter sparsified).
    **options
        Passed to :func:`spardl.make` (``density``, ``teams``, ``residual``, ``op``, ...).

    Raises
    ------
    ValueError, TypeError
        On every rank, if any rank's parameters or options are invalid or the ranks disagree
        (any option, ``warmup_steps`` and the DGC options included, or the parameters' layout:
        their number of elements and order), naming the option that differs; a ``params`` that
        is a single tensor, holds no parameter with ``requires_grad`` or none with elements,
        holds one twice or two under one name; a
        ``factor_masking=False`` without ``momentum_correction`` or a ``warmup_density``
        without ``density_warmup``; a process started by ``torchrun`` for more processes than
        MPI's world holds (each would train alone: launch with ``mpiexec``). Other messages are
        those of :func:`spardl.make`.
    """

    def __init__(
        self,
        params,
        comm,
        algorithm: str = "spardl",
        warmup_steps: int = 0,
        *,
        momentum_correction=None,
        factor_masking: bool = True,
        clip_norm=None,
        density_warmup: int = 0,
        warmup_density: float | None = None,
        dense_numel: int = 0,
        **options,
    ):
        err, tech = None, None
        named, frozen = [], []
        try:
            _refuse_torchrun(_world().Get_size())
            named, frozen = _named_trainable(params)
            self._warmup = _check_warmup(warmup_steps)
            tech = _Techniques(
                momentum_correction,
                factor_masking,
                clip_norm,
                density_warmup,
                warmup_density,
                dense_numel=dense_numel,
                density=options.get("density", _DEFAULT_DENSITY),
                residual=options.get("residual", "global"),
            )
        except (TypeError, ValueError) as e:
            err, named, frozen, self._warmup, tech = e, [], [], 0, None
        self.params = [p for _, p in named]
        self.names = [k for k, _ in named]
        # The layout the flat buffer was built for: a parameter resized or cast later is refused.
        self._dtypes = [p.dtype for p in self.params]
        # Frozen when it was built: a gradient there later is reduced by no rank (an error).
        self._frozen = frozen
        self.n = int(sum(p.numel() for p in self.params))
        self.algorithm = algorithm
        self._core = _Core(comm, algorithm, self._warmup, options, tech)
        agreed = {
            "warmup_steps": self._warmup,
            **(tech.as_dict() if tech else {}),
            "parameters": _layout(self.names, self.params),
        }
        _validate_options(self._core.ctl, algorithm, options, err, agreed=agreed)
        # The flat buffer lives on the parameters' device (CPU when they span several).
        devices = {p.device for p in self.params}
        self._core.set_layout(
            self.names,
            [p.numel() for p in self.params],
            _flat_dtype(p.dtype for p in self.params),
            devices.pop() if len(devices) == 1 else None,
        )
        # Built here, on every rank, so that a bad n fails before training starts.
        self.allreducer = self._core.allreducer(dense=False)
        self._flat = self._core.flat
        self._offsets = self._core.offsets
        self.last_result = None
        # (index, a weak reference to the .grad tensor, its version) of every gradient the
        # last reduce() wrote.
        self._written = []

    def reduce(self):
        """Average the gradients over the ranks (sparsely) and write them back into ``.grad``.

        A parameter that has a gradient on some rank is reduced (a rank without one contributes
        zeros and receives the result). A parameter without a gradient on every rank, or frozen
        (``requires_grad=False``) on every rank since the reducer was built, is left alone: its
        ``.grad`` stays as it is (None) and its residual is kept for a later step.

        Returns
        -------
        SparseResult
            The reduced flat gradient (mean over ranks unless ``op="sum"``), identical on every
            rank; ``.grad`` of each reduced parameter holds exactly its slice of ``to_dense()``.

        Raises
        ------
        TypeError
            On every rank, before the allreduce, if a rank holds a sparse gradient or one whose
            dtype is not its parameter's (set through ``.data``), or a parameter cast to another
            dtype since the reducer was built; it names the parameter.
        ValueError
            On every rank, if a rank's gradient does not have its parameter's shape, a
            parameter's number of elements changed since the reducer was built (set through
            ``.data``), a parameter is frozen on some ranks and not on others, one that was
            frozen when the reducer was built has a gradient, or a rank calls reduce() again
            with no gradient changed since the last one (no backward pass in between).
        spardl.NonFiniteError
            On every rank, with ``nonfinite="raise"`` (the default), if the reduced gradient
            holds NaN or Inf. Nothing of the step is applied (residuals, velocities and
            schedules stay as they were) and every ``.grad`` is zeroed on every rank: skip
            ``optimizer.step()`` and go on with the next batch.
        OverflowError
            On every rank, before anything changes, when ``step`` (or the allreducer's step or
            call count) is 2**63 - 1: a state saved after one more would not load.
        RuntimeError
            Once a failed step could not be undone on this rank (:meth:`state_dict`); the
            other ranks raise ValueError naming it, so that none waits for it.
        """
        from .algorithms.base import NonFiniteError

        self._check_open()
        core, flat, o = self._core, self._flat, self._offsets
        m, P = len(self.params), core.ctl.size
        local = np.zeros(1 + m, dtype=np.int64)
        # A state that could not be restored refuses the step on every rank (an undo can
        # fail on one rank only: refused here alone, the others would wait in the agreement).
        err = core.restored_error() or self._unfrozen_error() or self._again_error()
        with torch.no_grad():
            for i, p in enumerate(self.params):
                g = p.grad if p.requires_grad else None
                if not p.requires_grad:
                    # Counted in units of P + 1 beside the ranks that used it (at most P).
                    local[1 + i] = P + 1
                if err is None:
                    err = self._layout_error(i, p)
                if g is not None and err is None:
                    if g.layout != torch.strided:
                        err = TypeError(
                            f"parameter {self.names[i]} has a sparse gradient ({g.layout}); "
                            "SparseGradientReducer reduces dense gradients only (use "
                            "nn.Embedding(sparse=False))"
                        )
                    elif g.shape != p.shape:
                        err = ValueError(
                            f"parameter {self.names[i]}: .grad has shape {tuple(g.shape)}, "
                            f"the parameter {tuple(p.shape)}"
                        )
                    elif g.dtype != p.dtype:
                        # Set through .data: copying it into the flat buffer would cast it
                        # (a complex gradient would lose its imaginary part without a word).
                        err = TypeError(
                            f"parameter {self.names[i]}: .grad has dtype {g.dtype}, the "
                            f"parameter {p.dtype}"
                        )
                if g is None or err is not None:
                    flat[o[i] : o[i + 1]].zero_()
                else:
                    flat[o[i] : o[i + 1]].copy_(g.reshape(-1))
                    local[1 + i] = 1
            total = _step_control(core.ctl, err, local, core.options.get("check", True), "reduce")
            frozen, used = np.divmod(total[1:], P + 1)
            _check_frozen_everywhere(self.names, frozen, P)
            used = used > 0
            try:
                out = core.run([(o[i], o[i + 1]) for i in np.flatnonzero(~used)])
            except NonFiniteError:
                # As under DDP: every rank's gradients zero, so that an optimizer step taken
                # anyway applies no rank's own (unreduced, perhaps NaN) gradient.
                for p in self.params:
                    if p.grad is not None:
                        p.grad.zero_()
                self._written = []
                raise
            for i, p in enumerate(self.params):
                if not used[i] or not p.requires_grad:
                    continue
                g = flat[o[i] : o[i + 1]].view(p.shape)
                if p.grad is None or _may_overlap(p.grad):
                    # An expanded .grad (stride 0) cannot hold a gradient: a new one replaces it.
                    p.grad = g.to(p.device, p.dtype, copy=True)
                else:
                    p.grad.copy_(g)
            self._written = [  # weak: a gradient dropped by zero_grad() is freed
                (i, weakref.ref(p.grad), _version(p.grad))
                for i, p in enumerate(self.params)
                if used[i] and p.requires_grad
            ]
        self.last_result = out
        return out

    def _layout_error(self, i: int, p) -> Exception | None:
        """The error for parameter ``i`` resized or cast since the reducer was built (its flat
        buffer's slice and dtype were fixed then), else None."""
        built = self._offsets[i + 1] - self._offsets[i]
        if p.numel() != built:
            return ValueError(
                f"parameter {self.names[i]} has {p.numel()} elements, {built} when the "
                "SparseGradientReducer was built: build a new one for the resized model"
            )
        if p.dtype != self._dtypes[i]:
            return TypeError(
                f"parameter {self.names[i]} is {p.dtype}, {self._dtypes[i]} when the "
                "SparseGradientReducer was built: build a new one after casting the model"
            )
        return None

    def _again_error(self):
        """A ValueError if no gradient changed since the last reduce() wrote them (the same
        tensors, with the values written, and no other gradient): reducing the reduced gradient
        again would apply it twice and send the residuals once more (None otherwise)."""
        if not self._written:
            return None
        written = {i for i, _, _ in self._written}
        for i, ref, version in self._written:
            g = self.params[i].grad
            if g is None or g is not ref() or _version(g) != version:
                return None
        for i, p in enumerate(self.params):
            if i not in written and p.requires_grad and p.grad is not None:
                return None
        # Changes through .data bump no version: the values must be those written (the flat
        # buffer still holds them).
        o = self._offsets
        for i, _, _ in self._written:
            g = self.params[i].grad
            if not torch.equal(g.reshape(-1), self._flat[o[i] : o[i + 1]].to(g.device, g.dtype)):
                return None
        return ValueError(
            "reduce() was called again with no backward pass since the last one: every .grad "
            "still holds the reduced gradient it wrote (run backward first, zeroing the "
            "gradients between steps)"
        )

    def _unfrozen_error(self):
        """A ValueError naming the first parameter that was frozen when the reducer was built
        and now has a gradient (None if there is none)."""
        for name, p in self._frozen:
            if p.requires_grad and p.grad is not None:
                return ValueError(
                    f"parameter {name} was frozen (requires_grad=False) when the "
                    "SparseGradientReducer was built and now has a gradient, which no rank "
                    "reduces: build the reducer again after unfreezing it"
                )
        return None

    def state_dict(self) -> dict:
        """As :meth:`_Front.state_dict`, with ``n`` (the number of reduced elements)."""
        state = self._core.state_dict()
        state["n"] = self.n
        return state


def to_torch_state(obj):
    """A state dict with NumPy arrays as torch tensors and NumPy scalars as Python numbers.

    What ``torch.load`` accepts with ``weights_only=True`` (its default): a checkpoint holding an
    allreducer's state (residuals, thresholds, counters) loads without unpickling NumPy objects.
    :func:`from_torch_state` is the inverse.

    Parameters
    ----------
    obj : dict, list, tuple, ndarray, NumPy scalar or any other object
        Typically :meth:`spardl.algorithms.base.Allreducer.state_dict` output.

    Returns
    -------
    object
        The same structure (dicts, lists and tuples rebuilt), each ndarray replaced by a CPU
        tensor of its shape and dtype (a copy), each NumPy scalar by the Python number; other
        objects as they are.
    """
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.array(obj, copy=True))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: to_torch_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_torch_state(v) for v in obj)
    return obj


def from_torch_state(obj):
    """Inverse of :func:`to_torch_state`: torch tensors back to NumPy arrays.

    Parameters
    ----------
    obj : dict, list, tuple, torch.Tensor or any other object
        What :func:`to_torch_state` returned (after a ``torch.save``/``torch.load``, say).

    Returns
    -------
    object
        The same structure, each tensor replaced by a NumPy copy of it (moved to the host);
        other objects as they are.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy().copy()
    if isinstance(obj, dict):
        return {k: from_torch_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_torch_state(v) for v in obj)
    return obj
