"""The DDP feature table: the spardl hook under each DDP feature a training job uses (one and
several buckets, ``gradient_as_bucket_view``, ``static_graph``, ``no_sync`` gradient
accumulation, ``Join`` with uneven inputs, a frozen layer, float64), at P = 1, 2 and 3.

Each feature PASSes when, against plain DDP (its own allreduce) on the same model, data and
optimizer: at density 1 the parameters are bit for bit the same (P a power of two: the mean is
then the same sum divided by P) or equal to rounding (P = 3); at density 1% the run trains (the
loss on the ranks' batches falls) and every rank ends with identical parameters. The runs are
in tests/scripts/ddp_features.py, one ``mpiexec -n P`` job per P.
"""

from __future__ import annotations

import json

import pytest
from mpirun import ROOT, run_mpi

pytest.importorskip("torch")

SCRIPT = "tests/scripts/ddp_features.py"
FEATURES = [
    "one bucket",
    "several buckets",
    "gradient_as_bucket_view",
    "static_graph",
    "no_sync (gradient accumulation)",
    "join (uneven inputs)",
    "frozen layer",
    "float64",
]


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda P: f"P={P}")
def table(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_features") / "table.json"
    run_mpi(request.param, [SCRIPT, str(out)], timeout=300, env={"PYTHONPATH": str(ROOT)})
    rows = json.loads(out.read_text())
    assert rows["world_size"] == request.param
    return rows


@pytest.mark.mpi
@pytest.mark.parametrize("feature", FEATURES)
def test_feature_at_density_one_is_plain_ddp(table, feature):
    row = table[feature]
    assert row["moved"] > 1e-2  # the run did train: the comparison is not of two unmoved models
    if table["world_size"] in (1, 2):
        assert row["bit_equal"], row
    else:
        assert row["max_diff"] <= (1e-12 if feature == "float64" else 1e-6), row


@pytest.mark.mpi
@pytest.mark.parametrize("feature", FEATURES)
def test_feature_at_one_percent_trains_and_keeps_ranks_in_sync(table, feature):
    row = table[feature]
    assert row["in_sync"], row
    assert row["loss_after"] < row["loss_before"], row
    if feature == "frozen layer":
        assert row["frozen_moved"] == 0.0
