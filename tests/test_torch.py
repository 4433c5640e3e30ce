"""spardl.torch: the DDP communication hook, the plain-loop reducer and init from MPI.

The collective checks run in one `mpiexec -n 2` job (tests/scripts/torch_checks.py) that writes
its measurements to JSON; each test below asserts on one part of them.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from mpirun import ROOT, run_mpi

pytest.importorskip("torch")

SCRIPT = "tests/scripts/torch_checks.py"
ALGORITHM = "spardl"


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch") / "checks.json"
    run_mpi(2, [SCRIPT, str(out), ALGORITHM], timeout=240, env={"PYTHONPATH": str(ROOT)})
    return json.loads(out.read_text())


def test_import_spardl_does_not_import_torch():
    code = (
        "import sys, spardl, spardl.cli; spardl.cli.build_parser(); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.mpi
def test_init_process_group_from_mpi(checks):
    assert checks["world_size"] == 2
    assert checks["rank_matches_mpi"]


@pytest.mark.mpi
def test_ddp_hook_at_density_one_matches_ddp_allreduce(checks):
    r = checks["ddp_dense_equivalence"]
    # The parameters moved (the comparison is not vacuous) ...
    assert r["moved_from_init"] > 1e-3
    # ... and after warm-up and sparse steps at density 1 they equal DDP's own allreduce.
    assert r["max_abs_diff"] <= 1e-6 * max(1.0, r["param_scale"])
    assert r["hook_steps"] == 6
    assert r["buckets"] >= 2  # several buckets, one allreducer each
    assert r["sparse_bytes_sent"] > 0
    assert r["same_everywhere"]


@pytest.mark.mpi
def test_ddp_hook_at_one_percent_trains(checks):
    r = checks["ddp_sparse_trains"]
    assert r["steps"] == 120
    assert r["last_loss"] < 0.6 * r["first_loss"]
    # Sparse: far fewer bytes than 118 dense allreduces of the model (2·n·4·(P−1)/P each).
    dense_bytes = 118 * 2 * r["n_params"] * 4 // 2
    assert r["bytes_sent"] < 0.2 * dense_bytes


@pytest.mark.mpi
def test_bucket_size_change_recreates_allreducer(checks):
    r = checks["bucket_resize"]
    calls = r["calls"]
    assert [c["ar_n"] for c in calls] == [c["n"] for c in calls]
    assert calls[0]["ar_id"] == calls[1]["ar_id"]  # same size: reused
    assert calls[1]["ar_id"] != calls[2]["ar_id"]  # new size: a new allreducer
    assert calls[2]["ar_id"] == calls[3]["ar_id"]
    assert [c["created"] for c in calls] == [1, 1, 2, 2]
    for c in calls:
        assert c["shape"] == [c["n"]] and c["dtype"] == "torch.float32"
        assert c["same_everywhere"]
    assert r["warmup_mean_ok"]  # dense warm-up: the exact mean
    assert r["warmup_created"] == 0  # no sparse allreducer during warm-up


@pytest.mark.mpi
def test_reducer_writes_back_exactly_to_dense(checks):
    r = checks["reducer"]
    assert r["exact"]
    assert r["n"] == r["n_expected"]  # frozen parameters are not reduced
    assert 0 < r["nnz"] < r["n"]
    assert r["frozen_untouched"]
    assert r["no_grad_filled"]
    assert r["same_everywhere"]
    assert r["bytes_sent"] > 0
    assert r["state_has_residual"]


def test_reducer_state_round_trips_through_torch_load_weights_only():
    """A checkpoint of the reducer loads with torch.load's default (weights_only=True), also for
    a bfloat16 model (reduced in a float32 buffer)."""
    import io

    import numpy as np
    import torch
    from mpi4py import MPI

    import spardl.torch as st

    for algorithm in ("spardl", "oktopk"):
        torch.manual_seed(0)
        model = torch.nn.Linear(20, 5).to(torch.bfloat16)
        red = st.SparseGradientReducer(
            model.parameters(), MPI.COMM_SELF, algorithm=algorithm, density=0.1
        )
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(4, 20, dtype=torch.bfloat16)).sum().backward()
            red.reduce()
        assert model.weight.grad.dtype == torch.bfloat16
        buf = io.BytesIO()
        torch.save(red.state_dict(), buf)
        buf.seek(0)
        again = st.SparseGradientReducer(
            model.parameters(), MPI.COMM_SELF, algorithm=algorithm, density=0.1
        )
        again.load_state_dict(torch.load(buf))
        np.testing.assert_array_equal(again.allreducer.residual, red.allreducer.residual)
        assert again.step == red.step
