"""A few allreduce steps of several algorithms on fixed seeds; rank 0 writes one JSON report.

Usage: mpiexec -n P python tests/scripts/cluster_allreduce.py OUT.json [--n N] [--steps S]

For each configuration: a digest of every step's output and residual (identical wherever the same
seeds run, over shared memory or across emulated nodes), each rank's ``stats["bytes_sent"]``, and,
inside a cluster node (``spardl cluster run``), what the node's link sent over the same steps.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import numpy as np
from mpi4py import MPI

import spardl
from spardl.cluster import node_counters

CONFIGS = [
    ("spardl", {"teams": 1}),
    ("spardl", {"teams": 2}),
    ("oktopk", {}),
    ("dense", {}),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--density", type=float, default=0.01)
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    rows = []
    for name, opts in CONFIGS:
        if name == "spardl" and world.size % opts["teams"]:
            continue
        ar = spardl.make(name, world, args.n, density=args.density, **opts)
        digest = hashlib.sha256()
        world.Barrier()
        before = node_counters()
        for step in range(args.steps):
            rng = np.random.default_rng([7, world.rank, step])
            g = (rng.standard_t(3, args.n) * 1e-3).astype(np.float32)
            out = ar(g)
            for a in (out.indices, out.values, ar.residual):
                digest.update(np.ascontiguousarray(a).tobytes())
        world.Barrier()
        after = node_counters()
        sent = ar.stats["bytes_sent"]
        node_sent = node.allreduce(sent)  # what this node's ranks counted, together
        link = None if before is None else after["tx_bytes"] - before["tx_bytes"]
        per_rank = world.gather(
            {
                "rank": world.rank,
                "digest": digest.hexdigest(),
                "bytes_sent": sent,
                "node_bytes_sent": node_sent if node.rank == 0 else None,
                "link_tx_bytes": link if node.rank == 0 else None,
            }
        )
        if world.rank == 0:
            rows.append({"algorithm": name, "options": opts, "ranks": per_rank})
    if world.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"P": world.size, "n": args.n, "steps": args.steps, "rows": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
