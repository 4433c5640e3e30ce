"""A complete PyTorch job: DistributedDataParallel with SparDL's sparse allreduce as its hook.

Run::

    mpiexec -n 4 python examples/torch_ddp.py [--density 0.01] [--epochs 5] [--json]

Launch with ``mpiexec``, not ``torchrun``: the sparse allreduce talks over MPI, and
``init_process_group_from_mpi`` starts ``torch.distributed`` from the same ranks.

What it does: a small MLP on scikit-learn's handwritten digits (1,797 8×8 images, shipped in its
wheel), each rank training on its own shard of the training set, DDP's gradients reduced by
``spardl.torch.sparse_allreduce_hook`` at density ρ (error feedback keeps what was not sent).
Rank 0 prints the loss, the test accuracy and the bytes each rank sent, per epoch; with
``--json`` each line is JSON and also holds a checksum of the parameters on every rank (they
stay identical: every rank applies the same reduced gradient). ``spardl train`` is the full
job with every option; this is the least a script of your own needs.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from mpi4py import MPI

import spardl
import spardl.torch as st


def load_shard(rank: int, P: int, seed: int):
    """This rank's shard of the training set and the whole test set, as float32 tensors."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))  # the same split on every rank
    x, y = (x[order] / 16.0).astype(np.float32), y[order]
    cut = int(0.8 * len(y))
    # Disjoint shards of the training part, all of the same size (the smallest's).
    shard = slice(rank, rank + P * (cut // P), P)
    as_t = torch.from_numpy
    return as_t(x[shard]), as_t(y[shard]), as_t(x[cut:]), as_t(y[cut:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--density", type=float, default=0.01, help="ρ, in (0, 1] (default 0.01)")
    ap.add_argument("--algorithm", default="spardl", help="any of spardl.ALGORITHMS")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="one JSON line per epoch")
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)  # P ranks share the cores
    with spardl.abort_on_exception(comm):  # an error on one rank ends the job, not a hang
        rank, P = st.init_process_group_from_mpi(comm)
        torch.manual_seed(args.seed)  # the same initial model on every rank
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
        )
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = st.SparseHookState(
            comm, algorithm=args.algorithm, warmup_steps=5, model=model, density=args.density
        )
        ddp.register_comm_hook(state, st.sparse_allreduce_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

        x, y, x_test, y_test = load_shard(rank, P, args.seed)
        gen = torch.Generator().manual_seed(args.seed + rank)
        for epoch in range(args.epochs):
            losses = []
            for batch in torch.randperm(len(y), generator=gen).split(32):
                if len(batch) < 32:
                    break  # shards of one size: every rank takes the same number of steps
                loss = torch.nn.functional.cross_entropy(ddp(x[batch]), y[batch])
                opt.zero_grad()
                loss.backward()  # the hook reduces the gradients here
                opt.step()
                losses.append(loss.item())
            with torch.no_grad():
                accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
            checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
            checksums = comm.allgather(checksum)
            record = {
                "epoch": epoch,
                "P": P,
                "loss": float(np.mean(losses)),
                "test_accuracy": accuracy,
                "bytes_sent": int(state.stats["bytes_sent"]),
                "steps": state.step,
                "checksums": checksums,
            }
            if rank == 0:
                if args.json:
                    print(json.dumps(record), flush=True)
                else:
                    print(
                        f"epoch {epoch}: loss {record['loss']:.3f}, test accuracy "
                        f"{accuracy:.1%}, {record['bytes_sent'] / 1e6:.2f} MB sent by rank 0",
                        flush=True,
                    )
        state.close()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
