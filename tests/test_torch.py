"""spardl.torch: the DDP communication hook, the plain-loop reducer and init from MPI.

The collective checks run in one `mpiexec -n 2` job (tests/scripts/torch_checks.py) that writes
its measurements to JSON; each test below asserts on one part of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mpirun import ROOT, run_mpi

torch = pytest.importorskip("torch")

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


_THREADS_SCRIPT = """
import torch
torch.set_num_threads(1)
assert torch.get_num_threads() == 1
import spardl.torch  # noqa: F401
import numpy as np
from spardl_kernels import config, count_above
config.SELECT_PARALLEL_MIN_N = 0
config.CPU_THREADS = 2
count_above(np.arange(1 << 16, dtype=np.float32), 5.0)  # a call on two threads
print(torch.get_num_threads())
"""


def test_numba_threads_leave_torch_thread_count_alone():
    """Numba's OpenMP pool, when it starts, sets the OpenMP thread count torch shares; importing
    spardl.torch starts it with torch's count kept, so a threaded kernel call later leaves a job's
    torch.set_num_threads(1) in force."""
    env = {k: v for k, v in os.environ.items() if "LOCAL" not in k}
    env["NUMBA_NUM_THREADS"] = "2"
    out = subprocess.run(
        [sys.executable, "-c", _THREADS_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )
    assert out.stdout.split()[-1] == "1", out.stdout + out.stderr


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
    assert r["created"] == 1  # one allreducer over every bucket (several, rebuilt once)
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
def test_hook_result_does_not_depend_on_ddp_buckets(checks):
    r = checks["bucket_layouts"]
    # One bucket, DDP's rebuilt (reversed) order, one bucket per parameter: bit-identical.
    assert r["equal"]
    assert r["created"] == [1, 1, 1] and r["steps"] == [3, 3, 3]
    assert r["same_everywhere"]
    assert r["warmup_mean_ok"]  # dense warm-up: the exact mean
    assert r["warmup_created"] == 0  # no sparse allreducer during warm-up


@pytest.mark.mpi
def test_reducer_writes_back_exactly_to_dense(checks):
    r = checks["reducer"]
    assert r["exact"]
    assert r["n"] == r["n_expected"]  # frozen parameters are not reduced
    assert 0 < r["nnz"] < r["n"]
    assert r["frozen_untouched"]
    assert r["no_grad_filled"]  # no gradient on rank 0 only: reduced, written there too
    assert r["same_everywhere"]
    assert r["bytes_sent"] > 0
    assert r["state_has_residual"]
    assert r["expanded_replaced"]  # an expanded .grad gets a tensor of its own
    assert r["strided_kept"]  # a strided one is written in place


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


def test_close_frees_the_reducers_and_hook_states_communicators():
    """close() (or a with block) frees what a reducer or hook state created (its two
    communicators; its allreducers share them) and a closed one refuses to reduce."""
    import torch
    from mpi4py import MPI

    import spardl.torch as st

    model = torch.nn.Linear(6, 3)
    for _ in range(3):
        with st.SparseGradientReducer(model.parameters(), MPI.COMM_SELF, "topka") as red:
            model.zero_grad()
            model(torch.ones(2, 6)).sum().backward()
            red.reduce()
    comms = [red._core.comm, red._core.ctl, red._core.sparse.comm]
    assert all(c._mpi == MPI.COMM_NULL for c in comms)
    with pytest.raises(ValueError, match="closed"):
        red.reduce()
    with pytest.raises(ValueError, match="SparseGradientReducer is closed"):
        red.load_state_dict(red.state_dict())  # not MPI's "Invalid communicator"
    state = st.SparseHookState(MPI.COMM_SELF, algorithm="spardl", density=0.5)
    state.close()
    state.close()  # idempotent
    assert state._core.comm._mpi == MPI.COMM_NULL
    from spardl import elastic

    with pytest.raises(ValueError, match="SparseHookState is closed"):
        elastic.gather_state(state)


def test_auto_through_the_reducer_and_the_hook_state():
    """algorithm="auto" passes through: the reducer steps through its trials to a choice, its
    checkpoint round-trips through torch.load (weights_only), and bad auto options are named at
    construction."""
    import io

    import numpy as np
    from mpi4py import MPI

    import spardl.torch as st

    torch.manual_seed(0)
    model = torch.nn.Linear(20, 5)
    opts = {"density": 0.1, "trials": 1, "interval": 2}
    red = st.SparseGradientReducer(model.named_parameters(), MPI.COMM_SELF, "auto", **opts)
    for _ in range(7):  # four trial steps and the step flushing E into dense, then 2 more
        model.zero_grad()
        model(torch.randn(4, 20)).sum().backward()
        red.reduce()
    assert red.stats["auto"]["phase"] == "chosen" and red.stats["auto"]["decisions"] == 2
    buf = io.BytesIO()
    torch.save(red.state_dict(), buf)
    buf.seek(0)
    again = st.SparseGradientReducer(model.named_parameters(), MPI.COMM_SELF, "auto", **opts)
    again.load_state_dict(torch.load(buf))
    np.testing.assert_array_equal(again.allreducer.residual, red.allreducer.residual)
    assert again.allreducer.stats["auto"]["choice"] == red.stats["auto"]["choice"]
    with pytest.raises(ValueError, match="interval must be >= 1"):
        st.SparseHookState(MPI.COMM_SELF, algorithm="auto", interval=0)
    with pytest.raises(TypeError, match="unknown option"):
        st.SparseGradientReducer(model.parameters(), MPI.COMM_SELF, "auto", teams=2)


# -- parameter-keyed state; unused, frozen and sparse parameters; dtypes; launch; options -------
SPARSE_ALGORITHMS = ["topka", "gaussiank", "topkdsa", "gtopk", "spardl", "oktopk"]


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", SPARSE_ALGORITHMS)
def test_hook_resume_into_fresh_ddp_is_bit_for_bit(checks, algorithm):
    """3 steps, checkpoint (model, optimizer, hook state through torch.save/load), a fresh DDP
    and hook, 3 more steps == 6 steps in one go: by name, by position, and with another
    bucket_cap_mb on resume; and the hook equals the plain-loop reducer."""
    r = checks["edge_cases"][algorithm]["resume"]
    assert r["n"] == 676 and r["created"] == 1
    for label in ("named", "positional", "other_cap"):
        assert r[label]["bit_equal"], (label, r[label]["max_diff"])
    assert r["hook_equals_reducer"]
    assert r["moved"] > 1e-3  # not vacuous
    assert r["residual_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert r["residual_nonzero"]
    assert r["same_everywhere"]


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["hook", "reducer"])
@pytest.mark.parametrize("algorithm", SPARSE_ALGORITHMS)
def test_unused_parameters_keep_their_residual(checks, algorithm, kind):
    """A head no rank used (find_unused_parameters=True with DDP) keeps its residual and its
    .grad stays None; a head used by one rank is reduced; nothing is lost over every parameter."""
    import spardl

    r = checks["edge_cases"][algorithm][f"unused_{kind}"]
    assert r["head2_residual_nonzero"]  # there was mass to lose
    assert r["head2_residual_kept"]
    assert r["unused_grad_none"]
    assert r["some_ranks_reduced"]
    if spardl.ALGORITHMS[algorithm].conserves:
        assert r["conservation_error"] <= 1e-6 * max(1.0, r["scale"])


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", SPARSE_ALGORITHMS)
def test_sparse_gradient_is_a_type_error_on_every_rank(checks, algorithm):
    """nn.Embedding(sparse=True) used by rank 1 only: a TypeError naming the parameter on both
    ranks, for the reducer and the hook (the job finishing at all shows there is no hang)."""
    r = checks["edge_cases"][algorithm]["sparse"]
    for kind in ("reducer", "hook"):
        assert len(r[kind]) == 2
        for kind_name, msg in r[kind]:
            assert kind_name == "TypeError", (kind, msg)
            assert "parameter 0.weight has a sparse gradient" in msg


@pytest.mark.mpi
def test_a_parameter_resized_or_cast_after_the_reducer_was_built_is_refused_everywhere(checks):
    """The flat buffer's slices and dtype are fixed when the reducer is built: a parameter
    resized (``.data``) or a model cast (``.double()``) later, on one rank or on all, is an
    error naming the parameter on every rank instead of a hang, a raw RuntimeError or a
    float64 gradient reduced in float32."""
    got = checks["edge_cases"]["changed_layout"]
    for case, exc, words in (
        ("resize", "ValueError", "parameter weight has 12 elements, 8 when"),
        ("cast", "TypeError", "is torch.float64, torch.float32 when"),
    ):
        for where in ("one", "all"):
            outcomes = got[f"{case}_{where}"]
            assert len(outcomes) == 2
            for kind, msg in outcomes:
                assert kind == exc and words in msg, (case, where, msg)


@pytest.mark.mpi
def test_static_graph_over_two_dtypes_ends_its_first_iteration_or_says_why(checks):
    """DDP(static_graph=True) over float32 and float64 layers hands over both buckets of its
    first iteration as number 0, never is_last(): with model= the parameters end the
    iteration (density 1: DDP's own training, to rounding); without it a ValueError on every
    rank that asks for model=, never a hang."""
    r = checks["edge_cases"]["static_graph_mixed"]
    assert r["moved"] > 1e-3 and r["max_abs_diff"] < 1e-6
    assert len(r["without_model"]) == 2
    for kind, msg in r["without_model"]:
        assert kind == "ValueError" and "pass model= to SparseHookState" in msg, msg


@pytest.mark.mpi
def test_a_hook_state_shared_by_a_second_model_refuses_it_on_every_rank(checks):
    """Without model=, a SparseHookState registered on a second DDP model: each of that
    model's iterations is a ValueError on every rank, in both modes; the first model's
    iterations before and after run."""
    for mode, steps in checks["edge_cases"]["shared_state"].items():
        kinds = [[kind for kind, _ in outcomes] for outcomes in steps]
        ok, refused = ["ok", "ok"], ["ValueError", "ValueError"]
        assert kinds == [ok, ok, refused, refused, ok], (mode, steps)
        for outcomes in steps[2:4]:
            for _, msg in outcomes:
                assert "is in DDP's buckets but was not at the first iteration" in msg, msg


@pytest.mark.mpi
def test_a_model_that_ddp_does_not_wrap_is_a_value_error_on_every_rank(checks):
    """SparseHookState(model=another module): the parameters DDP reduces are not its, so its
    names would key nothing; both hook modes refuse it on every rank."""
    for mode, outcomes in checks["edge_cases"]["foreign_model"].items():
        assert len(outcomes) == 2, mode
        for kind_name, msg in outcomes:
            assert kind_name == "ValueError", (mode, msg)
            assert "are not parameters of the model given as model=" in msg, (mode, msg)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["default", "overlap"])
def test_ddp_trains_on_after_a_nonfinite_error(checks, mode):
    """An error raised by the hook leaves DDP usable: the iteration that raised has zero
    gradients on every rank, the next three run, move the parameters and keep them in sync."""
    r = checks["trains_on_after_an_error"][mode]
    for outcomes in r["outcomes"]:
        assert outcomes == ["ok", "ok", "NonFiniteError", "ok", "ok"]
    assert r["zero_grads"] == [True, True]
    for moved in r["moved"]:
        assert len(moved) == 4 and min(moved) > 0
    assert r["same_everywhere"] and r["finite"]


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", SPARSE_ALGORITHMS)
def test_reducer_leaves_unused_and_frozen_parameters_alone(checks, algorithm):
    r = checks["edge_cases"][algorithm]["frozen"]
    assert r["head2_weight_grad_none"] and r["frozen_grad_none"]
    assert r["head2_unmoved"] and r["frozen_unmoved"]  # SGD(weight_decay) did not move them
    assert r["head1_moved"]


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", SPARSE_ALGORITHMS)
def test_hook_reduces_bfloat16_and_float16_in_float32(checks, algorithm):
    for dtype, r in checks["edge_cases"][algorithm]["low_precision"].items():
        assert r["dtype"] == dtype
        assert r["equal_to_reducer"], dtype
        assert r["residual_dtype"] == "float32"
        assert r["moved"] > 1e-3


@pytest.mark.mpi
def test_hook_rejects_a_communicator_that_is_not_the_process_group(checks):
    """As under torchrun (each process's COMM_WORLD has size 1): an error on every rank."""
    outcomes = checks["edge_cases"]["launch_mismatch"]
    assert len(outcomes) == 2
    for rank, (kind, msg) in enumerate(outcomes):
        assert kind == "ValueError"
        assert (
            f"comm has rank 0 of 1 but the torch.distributed process group has rank {rank} of 2"
            in msg
        )
        assert "mpiexec" in msg


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", SPARSE_ALGORITHMS)
def test_bad_options_fail_at_construction_on_every_rank(checks, algorithm):
    import spardl

    r = checks["edge_cases"][algorithm]["options"]
    own = sorted(spardl.ALGORITHMS[algorithm].options)
    for kind in ("hook", "reducer"):
        for kind_name, msg in r["misspelt"][kind]:
            assert kind_name == "TypeError"
            assert f"{algorithm}: unknown option(s) ['densty']; accepted: " in msg
            for name in ["density", "residual", "nonfinite", "check", *own]:
                assert repr(name) in msg
            assert ("'op'" in msg) == (kind == "reducer")
        outcomes = r["range_on_rank1"][kind]
        assert [k for k, _ in outcomes] == ["ValueError", "ValueError"]
        assert all("density must be in (0, 1], got 5.0" in m for _, m in outcomes)
    for kind_name, msg in r["SparDL"]:
        assert kind_name == "ValueError"
        assert "algorithm must be one of" in msg and "got 'SparDL'" in msg


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (
            {"densty": 0.01},
            TypeError,
            "unknown option(s) ['densty']; accepted: ['check', 'density'",
        ),
        ({"density": 5.0}, ValueError, "density must be in (0, 1], got 5.0"),
        ({"algorithm": "SparDL"}, ValueError, "algorithm must be one of"),
        ({"warmup_steps": -1}, ValueError, "warmup_steps must be >= 0, got -1"),
        ({"teams": "2"}, TypeError, "teams must be an integer, got str"),
    ],
)
@pytest.mark.parametrize("kind", ["hook", "reducer"])
def test_options_are_checked_at_construction(kind, options, error, message):
    """Every option is checked when the state or reducer is built, not at the first sparse step
    inside backward(); the messages are spardl.make's."""
    from mpi4py import MPI

    import spardl.torch as st

    opts = {"algorithm": "spardl", **options}
    with pytest.raises(error) as info:
        if kind == "hook":
            st.SparseHookState(MPI.COMM_SELF, **opts)
        else:
            st.SparseGradientReducer(torch.nn.Linear(3, 2).parameters(), MPI.COMM_SELF, **opts)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("params", "error", "message"),
    [
        (lambda m: m, TypeError, "got the module Linear; pass model.parameters()"),
        (lambda m: 5, TypeError, "params must be an iterable of parameters"),
        (lambda m: [("w", m.weight, 1)], ValueError, "got a tuple of 3 at position 0"),
        (lambda m: [(0, m.weight)], TypeError, "name must be a str, got int at position 0"),
    ],
)
def test_params_that_are_not_parameters_are_named(params, error, message):
    """A module passed for its parameters, or a tuple that is not a (name, parameter) pair,
    once raised Python's own words ("'Linear' object is not iterable", "too many values to
    unpack"), which do not name params."""
    from mpi4py import MPI

    import spardl.torch as st

    with pytest.raises(error, match="params") as info:
        st.SparseGradientReducer(params(torch.nn.Linear(3, 2)), MPI.COMM_SELF)
    assert message in str(info.value)


def test_a_parameter_list_is_taken_as_its_parameters():
    """nn.ParameterList is a module that iterates over its parameters: it is taken as them."""
    from mpi4py import MPI

    import spardl.torch as st

    plist = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(3)) for _ in range(2)])
    red = st.SparseGradientReducer(plist, MPI.COMM_SELF, density=1.0)
    sum(p.sum() for p in plist).backward()
    red.reduce()
    assert all(bool((p.grad == 1).all()) for p in plist)
    red.close()


def test_reducer_residual_follows_each_parameter_into_another_layout():
    """A checkpoint loaded into a reducer whose parameters come in another order (or a model
    with a parameter more): each parameter's residual lands at its new place, by name."""
    import numpy as np
    from mpi4py import MPI

    import spardl.torch as st

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3))
    red = st.SparseGradientReducer(model.named_parameters(), MPI.COMM_SELF, "oktopk", density=0.1)
    for _ in range(2):
        model.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        red.reduce()
    saved = red.residuals()
    state = red.state_dict()
    extra = torch.nn.Parameter(torch.zeros(5))
    reordered = [*reversed(list(model.named_parameters())), ("extra", extra)]
    again = st.SparseGradientReducer(reordered, MPI.COMM_SELF, "oktopk", density=0.1)
    again.load_state_dict(state)
    got = again.residuals()
    assert set(got) == set(saved) | {"extra"}
    assert any(v.any() for v in saved.values())
    for k, v in saved.items():
        np.testing.assert_array_equal(got[k], v)
    assert not got["extra"].any()
    # A residual with no parameter to go to is an error, not a silent loss.
    fewer = st.SparseGradientReducer(list(model.named_parameters())[:2], MPI.COMM_SELF, "oktopk")
    with pytest.raises(ValueError, match=r"residuals of parameters \['1.bias', '1.weight'\]"):
        fewer.load_state_dict(state)


def test_first_compilation_is_announced_once(monkeypatch, capsys):
    import spardl.torch as st

    monkeypatch.setattr(st, "_ANNOUNCED", False)
    monkeypatch.setattr(st, "_kernels_cached", lambda: False)
    st._announce_compile(0)
    st._announce_compile(0)
    assert capsys.readouterr().err.count("compiling kernels, first run only") == 1
    monkeypatch.setattr(st, "_ANNOUNCED", False)
    monkeypatch.setattr(st, "_kernels_cached", lambda: True)
    st._announce_compile(0)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("algorithm", ["spardl", "oktopk"])
def test_hook_resume_is_bit_for_bit_on_one_rank(tmp_path, algorithm):
    """The resume case on one rank (P = 1), in this process: a one-rank gloo group."""
    import importlib.util

    import torch.distributed as dist
    from mpi4py import MPI

    spec = importlib.util.spec_from_file_location("torch_checks", ROOT / SCRIPT)
    checks_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks_mod)
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        r = checks_mod.hook_resume(MPI.COMM_SELF, algorithm)
    finally:
        dist.destroy_process_group()
    for label in ("named", "positional", "other_cap"):
        assert r[label]["bit_equal"], (label, r[label]["max_diff"])
    assert r["hook_equals_reducer"] and r["residual_nonzero"]


@pytest.mark.parametrize("mode", ["skip", "propagate"])
def test_dense_warmup_steps_handle_a_nonfinite_gradient_as_the_sparse_ones(mode):
    """The dense allreducer of the warm-up steps once ignored ``nonfinite``: with "skip" a NaN
    gradient in a warm-up step raised NonFiniteError instead of being skipped, and with
    "propagate" too. Now a warm-up step treats it as a sparse step does."""
    import math

    import torch
    from mpi4py import MPI

    import spardl.torch as st

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    red = st.SparseGradientReducer(
        model.parameters(), MPI.COMM_SELF, density=0.5, warmup_steps=2, nonfinite=mode
    )
    model(torch.randn(2, 6)).sum().backward()
    model.weight.grad[0, 0] = math.nan
    red.reduce()
    if mode == "skip":
        assert red.step == 0 and not model.weight.grad.any() and not model.bias.grad.any()
    else:
        assert red.step == 1 and math.isnan(model.weight.grad[0, 0])
    red.close()
