"""Measured ``stats`` of every registered algorithm against spardl.cost_model's formulas.

Messages must match exactly (they do not depend on the data for any algorithm here; for gtopk,
whose tree makes ranks send different numbers, the busiest rank matches). Bytes are compared
with the formula's words × 4 (int32 wire indices, float32 values) within the bound stated per
algorithm: [lo·formula − 8, hi·formula + headers]. The 8 bytes absorb the floor of collective
volumes; headers allows 16 bytes per message and destination (block counts and 8-byte alignment
of the packed buffers, the size words of an allgatherv, gtopk's dropped-mass word).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpiutil import grads_for

import spardl
from spardl import cost_model

N, DENSITY = 8_000, 0.05  # k = 400: data dwarfs the headers

#: (lo, hi) of measured bytes / formula bytes, and why.
BOUNDS = {
    "dense": (1.0, 1.0),  # data-independent, exact
    "topka": (1.0, 1.0),  # k pairs from every rank: exact
    "gtopk": (1.0, 1.0),  # k pairs per message: exact on the busiest rank
    "spardl": (1.0, 1.0),  # d = 1 with the exact selector: k_b pairs per block, exact
    "gaussiank": (0.5, 2.0),  # the threshold's count is about k, at most 2k (its CAP)
    "topkdsa": (0.5, 1.25),  # formula assumes no overlapping indices; the split varies by rank
    "oktopk": (0.5, 1.1),  # formula bounds the balancing by its worst case
}


def _one_step(comm, algorithm, **options):
    ar = spardl.make(algorithm, comm, N, density=DENSITY, **options)
    g = grads_for(comm, N, np.float32, seed=7)[comm.rank]
    m0, b0 = ar.stats["messages"], ar.stats["bytes_sent"]
    ar(g)
    return comm.allgather((ar.stats["messages"] - m0, ar.stats["bytes_sent"] - b0))


def _cases():
    for name in sorted(spardl.ALGORITHMS):
        yield name, {}
    yield "spardl", {"teams": "P"}
    yield "spardl", {"teams": 2}


@pytest.mark.parametrize(
    ("algorithm", "options"), list(_cases()), ids=lambda v: v if isinstance(v, str) else repr(v)
)
def test_measured_stats_match_the_formula(comm, algorithm, options):
    P = comm.size
    assert algorithm in cost_model.FORMULAS, f"no cost formula for registered {algorithm!r}"
    options = dict(options)
    if options.get("teams") == "P":
        options["teams"] = P
    if options.get("teams") == 2 and P % 2:
        pytest.skip("teams=2 needs an even P")
    teams = options.pop("teams", 1)
    kw = {"teams": teams} if algorithm == "spardl" and teams != 1 else {}
    measured = _one_step(comm, algorithm, **kw)
    pred = cost_model.predict(
        algorithm,
        P,
        N,
        DENSITY,
        teams=teams,
        word_bytes=4,
        **({"step": 0} if algorithm == "oktopk" else {}),
    )
    msgs = [m for m, _ in measured]
    sent = [b for _, b in measured]
    if P == 1:
        assert msgs == [0] and sent == [0]
        assert pred["messages"] == pred["bytes"] == 0
        return
    if algorithm == "gtopk":
        assert max(msgs) == pred["messages"] and min(msgs) >= 1
        sent = [max(sent)]  # the formula is the busiest rank's
    else:
        assert msgs == [pred["messages"]] * P, (msgs, pred)
    lo, hi = BOUNDS[algorithm] if teams == 1 else (0.3, 1.0)  # d > 1: the union may be smaller
    headers = 16 * P * pred["messages"]
    for b in sent:
        assert lo * pred["bytes"] - 8 <= b <= hi * pred["bytes"] + headers, (b, pred, lo, hi)
