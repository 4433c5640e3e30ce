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
import os
import socket

import numpy as np
import torch

from . import make
from .comm import Comm

__all__ = [
    "SparseGradientReducer",
    "SparseHookState",
    "init_process_group_from_mpi",
    "sparse_allreduce_hook",
]


def _world():
    # Only the default of the convenience helpers below; everything else takes the communicator
    # as an argument.
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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


def init_process_group_from_mpi(comm=None, backend: str | None = None, timeout=None) -> tuple:
    """Initialise ``torch.distributed`` from an MPI communicator, so one ``mpiexec`` starts the job.

    Rank and world size come from ``comm``. The rendezvous address is ``MASTER_ADDR`` (default
    127.0.0.1); the port is ``MASTER_PORT`` if set, else a free port picked by rank 0 and
    broadcast over MPI. Collective over ``comm``.

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
        If a process group is already initialised with another rank or size.
    TypeError
        If ``comm`` is not an mpi4py intracommunicator.
    """
    import torch.distributed as dist

    c = Comm(_world() if comm is None else comm)
    try:
        rank, size = c.rank, c.size
        if dist.is_initialized():
            if dist.get_rank() != rank or dist.get_world_size() != size:
                raise RuntimeError(
                    f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}, but comm gives rank {rank} of {size}"
                )
            return rank, size
        addr = os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        port = np.zeros(1, dtype=np.int64)
        if rank == 0:
            port[0] = int(os.environ.get("MASTER_PORT") or _free_port(addr))
        c.bcast(port, 0)
        os.environ["MASTER_PORT"] = str(int(port[0]))
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(_local_rank(rank) % torch.cuda.device_count())
        kwargs = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group(
            backend,
            init_method=f"tcp://{addr}:{int(port[0])}",
            rank=rank,
            world_size=size,
            **kwargs,
        )
        return rank, size
    finally:
        c.free()


def _check_warmup(warmup_steps) -> int:
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, (int, np.integer)):
        raise TypeError(f"warmup_steps must be an integer, got {type(warmup_steps).__name__}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    return int(warmup_steps)


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU NumPy view of a 1-D tensor (a copy only for GPU tensors)."""
    return t.detach().cpu().numpy() if t.is_cuda else t.detach().numpy()


class _Reductions:
    """Sparse allreducers keyed by buffer id, plus the dense allreducer used for warm-up.

    All of them share one duplicated communicator and therefore one ``stats`` mapping.
    """

    def __init__(self, comm, algorithm: str, warmup_steps: int, options: dict):
        self.comm = Comm(comm)
        self.algorithm = algorithm
        self.warmup_steps = warmup_steps
        self.options = dict(options)
        self.allreducers: dict = {}
        self.dense: dict = {}
        self.created = 0
        self.step = 0
        self.pending: dict = {}  # key -> saved allreducer state, applied when it is created

    @property
    def stats(self) -> dict:
        return self.comm.stats

    def get(self, key, n: int, dense: bool):
        table = self.dense if dense else self.allreducers
        ar = table.get(key)
        if ar is None or ar.n != n:
            # A new allreducer is collective; every rank reaches here at the same bucket, since
            # DDP builds (and rebuilds) the same buckets on every rank.
            if dense:
                ar = make("dense", self.comm, n, op=self.options.get("op", "mean"))
            else:
                ar = make(self.algorithm, self.comm, n, op="mean", **self.options)
                self.created += 1
                saved = self.pending.get(key)
                if saved is not None and saved.get("n") == n:
                    ar.load_state_dict(self.pending.pop(key))
            table[key] = ar
        return ar


class SparseHookState:
    """State of :func:`sparse_allreduce_hook`: one allreducer per DDP bucket.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The communicator the sparse allreduce runs over (duplicated inside); same ranks as the
        DDP process group.
    algorithm : str, default "spardl"
        A key of :data:`spardl.ALGORITHMS`.
    warmup_steps : int, default 2
        Dense allreduce for the first ``warmup_steps`` iterations. At least 2 is advised: DDP
        rebuilds its buckets after the first iteration, and a dense start avoids stale residuals.
    **allreducer_options
        Passed to :func:`spardl.make` (``density``, ``teams``, ``residual``, ...). ``op`` is
        always "mean", as DDP expects averaged gradients.

    Attributes
    ----------
    step : int
        Completed iterations (counted at each iteration's last bucket).
    allreducers : dict
        Bucket index -> the sparse allreducer of that bucket. A bucket whose size changes gets a
        new one (and loses its residual).
    stats : dict
        Cumulative message and byte counters of every allreducer of this state, warm-up included.

    Raises
    ------
    ValueError, TypeError
        If ``warmup_steps`` is invalid or ``op`` is given (locally, when constructed); algorithm
        options are checked on every rank at the first sparse step.
    """

    def __init__(
        self, comm, algorithm: str = "spardl", warmup_steps: int = 2, **allreducer_options
    ):
        warmup_steps = _check_warmup(warmup_steps)
        if "op" in allreducer_options:
            raise TypeError("op is fixed to 'mean' for a DDP hook; do not pass it")
        self._red = _Reductions(comm, algorithm, warmup_steps, allreducer_options)
        self.algorithm = algorithm
        self.warmup_steps = warmup_steps

    @property
    def step(self) -> int:
        return self._red.step

    @property
    def allreducers(self) -> dict:
        return self._red.allreducers

    @property
    def created(self) -> int:
        """How many sparse allreducers this state has created (a rebuilt bucket adds one)."""
        return self._red.created

    @property
    def stats(self) -> dict:
        return self._red.stats

    def state_dict(self) -> dict:
        """Step, counters and every bucket's allreducer state (residuals)."""
        import copy

        return to_torch_state(
            {
                "algorithm": self.algorithm,
                "step": self._red.step,
                "allreducers": {k: ar.state_dict() for k, ar in self._red.allreducers.items()},
                "stats": copy.deepcopy(self.stats),
            }
        )

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`. Allreducers are created lazily (at the first sparse step
        of each bucket), so each saved bucket state is applied when its bucket's allreducer is
        created with the same size.

        Raises
        ------
        ValueError
            If the state was saved with another algorithm.
        """
        state = from_torch_state(state)
        if state.get("algorithm") != self.algorithm:
            raise ValueError(
                f"state was saved with algorithm={state.get('algorithm')!r}, "
                f"this hook has {self.algorithm!r}"
            )
        self._red.step = int(state["step"])
        self._red.pending = dict(state["allreducers"])
        self.stats.clear()
        self.stats.update(state.get("stats") or {})


def sparse_allreduce_hook(state: SparseHookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: sparse allreduce of one gradient bucket over MPI.

    Use as ``ddp_model.register_comm_hook(state, sparse_allreduce_hook)``.

    Parameters
    ----------
    state : SparseHookState
    bucket : torch.distributed.GradBucket
        DDP's bucket; its flat ``buffer()`` (float16/32/64, shape (n,)) holds this rank's
        gradients.

    Returns
    -------
    torch.futures.Future
        Already completed; holds the bucket's buffer overwritten with the averaged (sparse)
        gradient, same dtype, shape and device, as the DDP hook API requires.

    Notes
    -----
    The first ``state.warmup_steps`` iterations use a dense allreduce (Ok-Topk and DGC warm up
    densely as well: arXiv 2201.07598 §5, arXiv 1712.01887 §3). The sparse result is mean-reduced
    by the allreducer; entries no rank selected are zero, and what was not sent stays in the
    residual for the next iteration (error feedback, arXiv 1809.07599).
    """
    red = state._red
    buf = bucket.buffer()
    flat = buf.view(-1)
    n = flat.numel()
    dense = red.step < red.warmup_steps
    ar = red.get(bucket.index(), n, dense)
    out = ar(_as_numpy(flat))
    result = torch.from_numpy(out.to_dense())
    flat.copy_(result)
    if bucket.is_last():
        red.step += 1
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


class SparseGradientReducer:
    """Sparse allreduce of a model's gradients in a plain training loop (the papers' setup).

    After ``loss.backward()``, :meth:`reduce` flattens every gradient into one contiguous buffer,
    runs the allreducer on it, and writes the averaged result back into each ``.grad``.

    Parameters
    ----------
    params : iterable of torch.nn.Parameter
        The parameters whose gradients are reduced (those with ``requires_grad``), in the same
        order on every rank. n = their total number of elements.
    comm : mpi4py.MPI.Intracomm
        The communicator (duplicated inside).
    algorithm : str, default "spardl"
        A key of :data:`spardl.ALGORITHMS`.
    warmup_steps : int, default 0
        Dense allreduce for the first ``warmup_steps`` calls.
    **options
        Passed to :func:`spardl.make` (``density``, ``teams``, ``residual``, ``op``, ...).

    Raises
    ------
    ValueError, TypeError
        On every rank, if any rank's parameters or options are invalid or the ranks disagree
        (different n, algorithm or options).
    """

    def __init__(self, params, comm, algorithm: str = "spardl", warmup_steps: int = 0, **options):
        self.params = [p for p in params if p.requires_grad]
        self.n = int(sum(p.numel() for p in self.params))
        dtypes = {p.dtype for p in self.params}
        bad = sorted(str(d) for d in dtypes if not d.is_floating_point)
        if bad:
            raise TypeError(f"params must be floating point, got dtype(s) {bad}")
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        if dtype not in (torch.float16, torch.float32, torch.float64):
            # bfloat16 (or another float NumPy cannot view): reduce in a float32 buffer.
            dtype = torch.float32
        self._warmup = _check_warmup(warmup_steps)
        self.algorithm = algorithm
        self._red = _Reductions(comm, algorithm, self._warmup, options)
        # Built here, on every rank, so that a bad option fails before training starts.
        self.allreducer = self._red.get("all", self.n, dense=False)
        self._flat = torch.zeros(self.n, dtype=dtype)
        self._offsets = np.cumsum([0] + [p.numel() for p in self.params]).tolist()
        self.last_result = None

    @property
    def step(self) -> int:
        """Completed calls of :meth:`reduce`."""
        return self._red.step

    @property
    def stats(self) -> dict:
        """Cumulative message and byte counters (warm-up included); see :mod:`spardl.comm`."""
        return self._red.stats

    def reduce(self):
        """Average the gradients over the ranks (sparsely) and write them back into ``.grad``.

        A parameter without a gradient contributes zeros and receives the reduced gradient.

        Returns
        -------
        SparseResult
            The reduced flat gradient (mean over ranks unless ``op="sum"``), identical on every
            rank; ``.grad`` of parameter i holds exactly its slice of ``to_dense()``.
        """
        flat = self._flat
        with torch.no_grad():
            for p, a, b in zip(self.params, self._offsets, self._offsets[1:], strict=False):
                if p.grad is None:
                    flat[a:b].zero_()
                else:
                    flat[a:b].copy_(p.grad.reshape(-1))
            dense = self._red.step < self._warmup
            ar = self._red.get("dense", self.n, True) if dense else self.allreducer
            out = ar(flat.numpy())
            out.to_dense(out=flat.numpy())
            for p, a, b in zip(self.params, self._offsets, self._offsets[1:], strict=False):
                g = flat[a:b].view(p.shape)
                if p.grad is None:
                    p.grad = g.to(p.device, p.dtype, copy=True)
                else:
                    p.grad.copy_(g)
        self._red.step += 1
        self.last_result = out
        return out

    def state_dict(self) -> dict:
        """The allreducer's state (residuals, selector state), the step and the counters.

        Arrays are torch tensors and scalars plain Python numbers, so ``torch.save`` /
        ``torch.load`` (with its default ``weights_only=True``) round-trip it.
        """
        import copy

        return to_torch_state(
            {
                "algorithm": self.algorithm,
                "n": self.n,
                "step": self._red.step,
                "allreducer": self.allreducer.state_dict(),
                "stats": copy.deepcopy(self.stats),
            }
        )

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; the next :meth:`reduce` continues bit for bit.

        Raises
        ------
        ValueError
            If the state was saved with another algorithm or n (or another rank / world size).
        """
        state = from_torch_state(state)
        for key, mine in (("algorithm", self.algorithm), ("n", self.n)):
            if state.get(key) != mine:
                raise ValueError(
                    f"state was saved with {key}={state.get(key)!r}, this reducer has {mine!r}"
                )
        self.allreducer.load_state_dict(state["allreducer"])
        self._red.step = int(state["step"])
        stats = state.get("stats")
        if stats is not None:
            self.stats.clear()
            self.stats.update(stats)


def to_torch_state(obj):
    """A state dict with NumPy arrays as torch tensors and NumPy scalars as Python numbers.

    What ``torch.load`` accepts with ``weights_only=True`` (its default): a checkpoint holding an
    allreducer's state (residuals, thresholds, counters) loads without unpickling NumPy objects.
    :func:`from_torch_state` is the inverse.
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
    """Inverse of :func:`to_torch_state`: torch tensors back to NumPy arrays."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy().copy()
    if isinstance(obj, dict):
        return {k: from_torch_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_torch_state(v) for v in obj)
    return obj
