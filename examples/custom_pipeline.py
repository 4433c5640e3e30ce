"""A custom sparse allreduce built from the kernels alone: DGC-style sampled threshold + all-gather.

Run::

    mpiexec -n 4 python examples/custom_pipeline.py [--n 100000] [--density 0.01] [--json]

What each rank does (no ``spardl`` allreducer involved, only ``spardl_kernels`` and mpi4py):

1. X = g + E: add the residual (error feedback) to this rank's gradient.
2. Threshold: ``estimate_threshold(X, k)`` samples X to estimate the k-th largest |X| cheaply
   (Lin et al., "Deep Gradient Compression", arXiv 1712.01887, Sec. 3: sampled top-k).
3. Select: ``select_above(X, t)``: every index with |X_i| ≥ t, ascending (about k of them).
4. Exchange: an all-gather of the counts, then an ``Allgatherv`` of indices and of values,
   written with mpi4py directly.
5. Sum: ``coalesce`` of the P concatenated selections (sorted, duplicates summed in rank order).
6. Residual: E = X with the selected entries zeroed (they were sent; nothing is dropped).

Rank 0 prints one line per step: each rank's selection count and the size of the sum. With
``--json`` the line is JSON holding the whole summed sparse result too, so a test can recompute
it with NumPy (``tests/test_examples.py``).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from mpi4py import MPI

import spardl_kernels as K


def gradient(n: int, rank: int, step: int, seed: int) -> np.ndarray:
    """This rank's float32 gradient at ``step`` (heavy tailed, its own seeded stream)."""
    rng = np.random.default_rng([seed, rank, step])
    return (rng.standard_t(3, n) * 1e-3).astype(np.float32)


def sparse_allreduce(comm, x: np.ndarray, k: int, seed: int = 0):
    """Sum over ranks of each rank's threshold-selected entries of x.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The ranks to sum over.
    x : float32 array of shape (n,)
        This rank's accumulated gradient X = g + E.
    k : int
        Target number of entries per rank (1 ≤ k ≤ n).
    seed : int
        Seed of the threshold's sample (the same seed on every rank is fine: the data differ).

    Returns
    -------
    (indices, values, sent_indices)
        int64 ascending indices and float32 sums, identical on every rank, and this rank's
        selected indices.
    """
    t = K.estimate_threshold(x, k, seed=seed)
    idx, val = K.select_above(x, t)
    counts = np.array(comm.allgather(len(idx)), dtype=np.int64)
    displs = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=displs[1:])
    total = int(counts.sum())
    all_idx = np.empty(total, dtype=np.int64)
    all_val = np.empty(total, dtype=np.float32)
    comm.Allgatherv(idx, [all_idx, (counts, displs), MPI.INT64_T])
    comm.Allgatherv(val, [all_val, (counts, displs), MPI.FLOAT])
    out_i, out_v = K.coalesce(all_idx, all_val)
    return out_i, out_v, idx


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print each step's whole result as JSON")
    a = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    k = max(1, int(a.density * a.n))
    E = np.zeros(a.n, dtype=np.float32)
    for step in range(a.steps):
        X = gradient(a.n, comm.rank, step, a.seed) + E
        out_i, out_v, sent = sparse_allreduce(comm, X, k, seed=a.seed + step)
        E = X.copy()
        E[sent] = 0.0  # sent entries reach the sum exactly once; the rest waits for later
        counts = comm.gather(len(sent), root=0)
        if comm.rank == 0 and not a.json:
            print(
                f"step {step}: P={comm.size} n={a.n} k={k}, selected per rank {counts}, "
                f"{len(out_i)} entries in the sum, largest |value| {np.abs(out_v).max():.3g}",
                flush=True,
            )
        elif comm.rank == 0:
            print(
                json.dumps(
                    {
                        "step": step,
                        "P": comm.size,
                        "n": a.n,
                        "k": k,
                        "counts": counts,
                        "indices": out_i.tolist(),
                        "values": out_v.tolist(),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
