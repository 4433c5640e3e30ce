"""spardl.torch: the DDP hook's overlap mode, and the flat buffer handed over without copies.

The collective checks run in one `mpiexec -n 2` job (tests/scripts/torch_overlap_checks.py) that
writes its measurements to JSON; the tests marked mpi assert on parts of them. The others run in
this process on one rank (MPI.COMM_SELF), with fake buckets where DDP is not needed.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from mpirun import ROOT, run_mpi
from overlap_state import three_parameter_state
from scripts.fake_bucket import FakeBucket

torch = pytest.importorskip("torch")

SCRIPT = "tests/scripts/torch_overlap_checks.py"


def _script_results(tmp_path_factory, script: str, timeout: float) -> dict:
    """What ``script``, run under ``mpiexec -n 2``, wrote to its JSON file."""
    out = tmp_path_factory.mktemp(Path(script).stem) / "results.json"
    run_mpi(2, [script, str(out)], timeout=timeout, env={"PYTHONPATH": str(ROOT)})
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    return _script_results(tmp_path_factory, SCRIPT, 240)


@pytest.mark.mpi
def test_overlap_at_density_one_matches_ddp_allreduce(checks):
    r = checks["dense_equivalence"]
    assert r["moved_from_init"] > 1e-3  # not vacuous
    assert r["max_abs_diff"] <= 1e-6 * max(1.0, r["param_scale"])
    assert r["steps"] == 6 and r["buckets"] >= 2  # several buckets, reduced one by one
    assert r["sparse_bytes_sent"] > 0
    assert r["same_everywhere"]


@pytest.mark.mpi
def test_overlap_at_one_percent_trains_in_sync(checks):
    r = checks["sparse_trains"]
    assert r["steps"] == 80 and r["buckets"] >= 2
    assert r["same_everywhere"]
    assert r["last_loss"] < 0.6 * r["first_loss"]
    dense_bytes = 78 * 2 * r["n_params"] * 4 // 2  # 78 dense allreduces, 2·n·4·(P−1)/P each
    assert r["bytes_sent"] < 0.2 * dense_bytes
    assert r["residual_keys"] == [f"#{i}" for i in range(8)]  # by parameter
    # Elastic checkpoints of an overlap-mode state: its header's n is the buckets' together.
    assert r["gathered_n"] == r["n_params"] and r["gathered_ranks"] == 2
    assert r["loaded_step"] == 80


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("case", "kind", "message"),
    [
        ("sparse_embedding", "TypeError", "parameter 0.weight has a sparse gradient"),
        ("nonfinite", "NonFiniteError", "the reduced gradient holds NaN or Inf"),
    ],
)
def test_error_in_the_communication_thread_raises_on_every_rank(checks, case, kind, message):
    """A sparse gradient on rank 1 only, a NaN on rank 0 only: backward() raises the error with
    its own type on both ranks (the job finishing at all shows there is no hang)."""
    outcomes = checks["errors"][case]
    assert len(outcomes) == 2
    for got_kind, msg in outcomes:
        assert got_kind == kind and message in msg


@pytest.mark.mpi
def test_error_zeroes_every_future_of_the_iteration(checks):
    r = checks["errors"]
    for futures, raised in zip(r["futures"], r["hook_raised"], strict=True):
        # Bucket 0 failed (inf on rank 1): the iteration is undone, bucket 1's result too.
        assert futures[:2] == ["zeros", "zeros"]
        # The next iteration runs and is counted; its fake buckets come without a backward
        # pass, so no rank used their parameters and nothing of them is reduced (zeros). An
        # iteration of used parameters after a failing bucket: the test after _iteration below.
        assert futures[2:] == ["zeros"] * 3
        assert raised == ["NonFiniteError", "ok"]
    assert r["steps_after"] == 1  # the failed iteration is not counted


TRANSACTION_SCRIPT = "tests/scripts/torch_overlap_transaction.py"


@pytest.fixture(scope="module")
def transaction(tmp_path_factory):
    return _script_results(tmp_path_factory, TRANSACTION_SCRIPT, 300)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["skip", "raise"])
@pytest.mark.parametrize("case", ["first", "unused", "unused_oktopk", "rebuild", "later"])
def test_a_failing_bucket_undoes_its_whole_iteration(transaction, case, mode):
    """docs/reliability.md, "A step is a transaction", overlap mode: P = 2, DDP with several
    buckets, a NaN in rank 1's gradient of a middle bucket at iteration t. Afterwards every
    gradient is zero on every rank, every bucket allreducer's state_dict() and the hook state's
    are bit for bit those from before iteration t (the buckets applied before the failing one
    and the one after it undone), and three more iterations give the parameters and states of
    a twin run that never had iteration t, bit for bit. Cases (tests/scripts/
    torch_overlap_transaction.py): t = 0, where the buckets' allreducers are created; an
    unused parameter's residual set aside in a bucket applied before the failing one (spardl,
    oktopk); the iteration in which DDP's rebuilt buckets arrive; density warm-up with small
    parameters reduced dense."""
    r = transaction[f"{case}-{mode}"]
    t = r["fail_at"]
    # Not vacuous: several buckets, the NaN's one after an applied bucket and before another.
    layout = [names for _, names in r["failing_layout"]]
    at = [i for i, names in enumerate(layout) if "b.weight" in names]
    assert len(layout) >= 4 and len(at) == 1 and 0 < at[0] < len(layout) - 1, layout
    if case == "rebuild":
        assert len(r["first_layout"]) == 1  # DDP's first iteration: one bucket, rebuilt at t
    if r["unused_at_t"]:
        side = [i for i, names in enumerate(layout) if any(k.startswith("side.") for k in names)]
        assert r["side_residual_before"] and max(side) < at[0]
    assert r["residual_before"] == (t > 0)
    want = "NonFiniteError" if mode == "raise" else "ok"
    assert r["outcome"] == [want, want]
    assert (r["skipped_steps"] > 0) == (mode == "skip")
    # The iteration left nothing: zero gradients, every state as before it, not counted.
    assert r["grads_zero"] == [True, True] and min(r["grads_present"]) >= 6
    assert r["state_changed"] == [[], []]
    assert r["steps_before_after"] == [t, t]
    # The next three iterations: exactly the twin's.
    assert r["moved_after_t"] > 0
    assert r["params_equal_twin"] == [True, True]
    assert r["final_differs_from_twin"] == [[], []]
    assert r["same_everywhere"]


ELASTIC_SCRIPT = "tests/scripts/torch_elastic_overlap.py"


@pytest.mark.mpi
@pytest.mark.parametrize("sizes", [(2, 3), (2, 1), (3, 2)], ids=str)
def test_an_overlap_checkpoint_resumes_at_another_world_size_in_either_mode(tmp_path, sizes):
    """docs/reliability.md §4.1: an overlap-mode SparseHookState saved by
    ``elastic.save_checkpoint`` at P ranks loads at P' ≠ P (it raised ``KeyError: 'rank'`` on
    every rank) into overlap mode and into the default mode: each parameter's residual keeps
    its sum over ranks (bit for bit when growing), the step carries over, and the next
    iteration reduces the loaded residuals with the new gradients, conserving their mass."""
    P, new = sizes
    path, out = tmp_path / "overlap.zip", tmp_path / "loaded.json"
    env = {"PYTHONPATH": str(ROOT)}
    run_mpi(P, [ELASTIC_SCRIPT, "save", str(path)], timeout=240, env=env)
    run_mpi(new, [ELASTIC_SCRIPT, "load", str(path), str(out)], timeout=240, env=env)
    saved = json.loads(path.with_name(path.name + ".json").read_text())
    loaded = json.loads(out.read_text())
    assert saved["step"] == 3 and set(saved["sums"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert any(np.any(v) for v in saved["sums"].values())  # there is something to carry
    for mode in ("overlap", "default"):
        r = loaded[mode]
        assert r["step"] == 3 and r["steps_after"] == 4, mode
        assert set(r["sums"]) == set(saved["sums"]), mode
        for k, want in saved["sums"].items():
            got, want = np.asarray(r["sums"][k]), np.asarray(want)
            if new >= P:
                np.testing.assert_array_equal(got, want, err_msg=f"{mode} {k}")
            else:
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=mode)
        assert r["conservation_error"] <= 1e-5 * max(1.0, r["scale"]), mode
        assert r["same_everywhere"] and r["moved"] > 0, mode


def _three_parameter_state():
    """Three parameters (8, 5 and 3 entries) and an overlap-mode hook state over them on one
    rank: SparDL at ρ = 0.5, nonfinite="raise", no dense warm-up."""
    from mpi4py import MPI

    return three_parameter_state(MPI.COMM_SELF)


# -- one rank, in this process ------------------------------------------------------------------
def _iteration(state, params, groups, seed):
    """Gradients from a real backward (so the used-parameter hooks fire), handed over in the
    fake buckets ``groups`` (parameter positions); the reduced gradients, by position."""
    rng = np.random.default_rng(seed)
    loss = sum(
        (p * torch.from_numpy(rng.standard_normal(p.numel(), np.float32))).sum() for p in params
    )
    for p in params:
        p.grad = None
    loss.backward()
    futs = []
    for b, group in enumerate(groups):
        buf = torch.cat([params[i].grad for i in group])
        bucket = FakeBucket(b, buf, [params[i] for i in group], b == len(groups) - 1)
        futs.append((group, state._bucket(bucket)))
    out = {}
    for group, fut in futs:
        flat, off = fut.wait(), 0
        for i in group:
            out[i] = flat[off : off + params[i].numel()].clone()
            off += params[i].numel()
    return out


def test_the_iteration_after_a_failing_bucket_reduces_every_bucket():
    """One rank: a NaN in bucket 0 raises NonFiniteError at the last bucket, and every future
    of that iteration is zeros (bucket 1's, reduced after the failure, too); the next iteration
    (a real backward, every parameter used) reduces every bucket as usual, and is the first
    one counted."""
    import spardl

    params, state = _three_parameter_state()
    sum((i + 1) * p.sum() for i, p in enumerate(params)).backward()  # every parameter used
    grads = [p.grad.clone() for p in params]
    grads[0][3] = float("nan")
    futs = [state._bucket(FakeBucket(b, grads[b], [params[b]], False)) for b in (0, 1)]
    with pytest.raises(spardl.NonFiniteError):
        state._bucket(FakeBucket(2, grads[2], [params[2]], True))
    assert all(bool((f.wait() == 0).all()) for f in futs)
    assert all(bool((g == 0).all()) for g in grads)  # the buffers, the last one's too
    out = _iteration(state, params, [[0], [1], [2]], seed=1)
    assert all(bool(out[i].any()) for i in range(3))
    assert state.step == 1


def test_an_undo_that_raises_keeps_the_buckets_error_and_refuses_every_later_call(monkeypatch):
    """One rank: bucket 0 of the second iteration holds a NaN, and undoing the iteration at its
    last bucket raises too (``_unstep``, injected). The hook raises the bucket's NonFiniteError
    with the undo's failure as a note (it was once dropped, and the state went on half
    restored), every buffer zero; from then on every call but close() refuses, saying so."""
    import spardl
    import spardl.torch as st

    params, state = _three_parameter_state()
    _iteration(state, params, [[0], [1], [2]], seed=0)

    def fail(self, undo):
        raise RuntimeError("injected undo failure")

    monkeypatch.setattr(st._Core, "_unstep", fail)
    sum((i + 1) * p.sum() for i, p in enumerate(params)).backward()
    grads = [p.grad.clone() for p in params]
    grads[0][3] = float("nan")
    futs = [state._bucket(FakeBucket(b, grads[b], [params[b]], False)) for b in (0, 1)]
    with pytest.raises(spardl.NonFiniteError) as info:
        state._bucket(FakeBucket(2, grads[2], [params[2]], True))
    assert "injected undo failure" in "".join(getattr(info.value, "__notes__", []))
    assert all(bool((f.wait() == 0).all()) for f in futs)
    assert all(bool((g == 0).all()) for g in grads)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="could not be restored") as info:
        _iteration(state, params, [[0], [1], [2]], seed=1)
    # Named in the message: the hook raises a bucket's error after backward without its cause.
    assert "injected undo failure" in str(info.value)
    with pytest.raises(RuntimeError, match="could not be restored"):
        state.state_dict()
    state.close()


def test_a_close_whose_wait_for_the_buckets_raises_leaves_the_state_open(monkeypatch):
    """One rank: close() first waits for the buckets handed to the communication thread; if
    that wait raises (an interrupt, injected), the hook state is still open, nothing freed,
    and a second close() closes it (it once said closed, with its work pending, and a
    second close() did nothing: the communicators were never freed)."""
    import spardl.torch as st

    params, state = _three_parameter_state()
    _iteration(state, params, [[0], [1], [2]], seed=0)

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(st._Buckets, "drain", interrupted)
    with pytest.raises(KeyboardInterrupt):
        state.close()
    monkeypatch.undo()
    assert not (state._core.comm.freed or state._core.ctl.freed)
    state.load_state_dict(state.state_dict())  # still open: a closed one refuses
    state.close()
    assert state._core.comm.freed and state._core.ctl.freed


@pytest.mark.parametrize("mode", ["skip", "raise"])
def test_a_failing_iteration_that_rebuilds_the_buckets_midway_is_undone(mode):
    """One rank, fake buckets: bucket 0 keeps its parameters and is applied, then bucket 1
    comes with another layout (every bucket's state goes by key to new allreducers) and holds a
    NaN. The whole iteration is undone: every future zeros, the state as before it, and the
    next iterations are those of a twin that never had it, bit for bit."""
    from mpi4py import MPI

    import spardl
    import spardl.torch as st

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (8, 5, 3)]
    model = torch.nn.ParameterList(params)

    def state():
        return st.SparseHookState(
            MPI.COMM_SELF, "spardl", 0, density=0.4, nonfinite=mode, model=model, overlap=True
        )

    before, rebuilt = [[0], [1], [2]], [[0], [1, 2]]
    run, twin = state(), state()
    for s in (0, 1):
        assert _equal_outputs(
            _iteration(run, params, before, s), _iteration(twin, params, before, s)
        )
    saved = _bits(run.state_dict())
    # The failing iteration, on ``run`` only.
    sum((i + 1) * p.sum() for i, p in enumerate(params)).backward()
    grads = [p.grad.clone() for p in params]
    grads[1][2] = float("nan")
    bufs = [grads[0], torch.cat([grads[1], grads[2]])]
    futs = [run._bucket(FakeBucket(0, bufs[0], [params[0]], False))]
    try:
        futs.append(run._bucket(FakeBucket(1, bufs[1], [params[1], params[2]], True)))
    except spardl.NonFiniteError:
        assert mode == "raise"
    else:
        assert mode == "skip"
    assert bool(bufs[0].any() or bufs[1].any()) is False
    assert all(bool((f.wait() == 0).all()) for f in futs)
    assert _bits(run.state_dict()) == saved
    assert run.step == 2 and run.created == 3 and len(run._core.cores) == 3
    for s in (2, 3, 4):
        assert _equal_outputs(
            _iteration(run, params, rebuilt, s), _iteration(twin, params, rebuilt, s)
        )
    assert _bits(run.state_dict()) == _bits(twin.state_dict())
    assert run.step == twin.step == 5 and run.created == twin.created == 5


@pytest.mark.parametrize("mode", ["skip", "raise"])
def test_a_failing_iteration_gives_back_the_residual_folded_into_a_dense_part(mode):
    """One rank, fake buckets: a state saved with dense_numel=0 loaded where parameter 1 is
    now small (dense_numel=6); after a dense warm-up iteration, bucket 0's first sparse step
    sends that parameter's residual with its dense part and clears it in place, and bucket 1
    then fails. The residual comes back: the state is as before the iteration, and the next
    iterations are those of a twin that never had it, bit for bit."""
    from mpi4py import MPI

    import spardl
    import spardl.torch as st

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (30, 6, 40)]
    model = torch.nn.ParameterList(params)
    buckets = [[0, 1], [2]]

    def state(warmup_steps, dense_numel):
        return st.SparseHookState(
            MPI.COMM_SELF,
            "spardl",
            warmup_steps,
            density=0.2,
            nonfinite=mode,
            model=model,
            overlap=True,
            dense_numel=dense_numel,
        )

    first = state(0, 0)
    for s in (0, 1):
        _iteration(first, params, buckets, s)
    run, twin = state(3, 6), state(3, 6)
    for st_ in (run, twin):
        st_.load_state_dict(first.state_dict())
    # Step 2: dense warm-up, the residual kept; step 3 would fold it.
    assert _equal_outputs(_iteration(run, params, buckets, 2), _iteration(twin, params, buckets, 2))
    assert run.residuals()["1"].any()  # something to fold
    before = _bits(run.state_dict())
    sum((i + 1) * p.sum() for i, p in enumerate(params)).backward()
    grads = [p.grad.clone() for p in params]
    grads[2][5] = float("nan")
    bufs = [torch.cat([grads[0], grads[1]]), grads[2]]
    fut = run._bucket(FakeBucket(0, bufs[0], [params[0], params[1]], False))
    try:
        run._bucket(FakeBucket(1, bufs[1], [params[2]], True))
    except spardl.NonFiniteError:
        assert mode == "raise"
    assert not bool(bufs[0].any() or bufs[1].any()) and not bool(fut.wait().any())
    assert _bits(run.state_dict()) == before and run.step == 3
    for s in (3, 4):
        assert _equal_outputs(
            _iteration(run, params, buckets, s), _iteration(twin, params, buckets, s)
        )
    assert not run.residuals()["1"].any()  # sent at step 3
    assert _bits(run.state_dict()) == _bits(twin.state_dict())


@pytest.mark.parametrize("drain", [True, False])
@pytest.mark.parametrize("nan", [True, False])
def test_an_iteration_whose_backward_stopped_early_is_undone(drain, nan):
    """One rank, fake buckets: an iteration's backward stops after its first bucket (it raised
    on the way; that bucket applied, or skipped for a NaN), so its last bucket never comes. It
    is undone, by ``drain()`` or else at the next iteration's first bucket, and that next
    iteration is applied as in a twin that never had the broken one. (The next iteration once
    joined the open one and, with a skipped bucket in it, was dropped silently.)"""
    from mpi4py import MPI

    import spardl.torch as st

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (8, 5, 3)]
    model = torch.nn.ParameterList(params)

    def state():
        return st.SparseHookState(
            MPI.COMM_SELF, "spardl", 0, density=0.4, nonfinite="skip", model=model, overlap=True
        )

    groups = [[0], [1], [2]]
    run, twin = state(), state()
    assert _equal_outputs(_iteration(run, params, groups, 0), _iteration(twin, params, groups, 0))
    saved = _bits(run.state_dict())
    sum((i + 1) * p.sum() for i, p in enumerate(params)).backward()
    buf = params[0].grad.clone()
    if nan:
        buf[3] = float("nan")
    run._bucket(FakeBucket(0, buf, [params[0]], False))  # ... and backward raised here
    with pytest.raises(RuntimeError, match=r"an iteration is open.*call drain\(\) first"):
        run.state_dict()  # its first bucket applied (no NaN), the others not: never saved
    if drain:
        run.drain()
        assert _bits(run.state_dict()) == saved and not bool(buf.any())
    for s in (1, 2):
        out = _iteration(run, params, groups, s)
        assert all(bool(out[i].any()) for i in range(3))
        assert _equal_outputs(out, _iteration(twin, params, groups, s))
    assert run.step == twin.step == 3
    assert _bits(run.state_dict()) == _bits(twin.state_dict())


def _bits(state):
    """A state_dict as comparable data (arrays by dtype, shape and bytes), without ``stats``."""

    def walk(obj):
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items() if k != "stats"}
        if isinstance(obj, (list, tuple)):
            return [walk(v) for v in obj]
        if isinstance(obj, torch.Tensor):
            obj = obj.numpy()
        if isinstance(obj, np.ndarray):
            return (str(obj.dtype), obj.shape, obj.tobytes())
        if isinstance(obj, float):
            return ("float", obj.hex())
        return obj

    return walk(state)


def _equal_outputs(a, b):
    """Two iterations' reduced gradients (by position) equal bit for bit."""
    return a.keys() == b.keys() and all(a[i].numpy().tobytes() == b[i].numpy().tobytes() for i in a)


@pytest.mark.parametrize("algorithm", ["spardl", "oktopk"])
def test_overlap_resume_is_bit_for_bit_and_residuals_follow_a_rebuild(algorithm):
    """Overlap mode's checkpoint (through torch.save / torch.load) continues bit for bit; DDP's
    bucket rebuild after the first iteration carries each parameter's residual by key."""
    from mpi4py import MPI

    import spardl.torch as st

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (30, 7, 50)]
    model = torch.nn.ParameterList(params)
    first, rebuilt = [[0, 1, 2]], [[2], [1, 0]]

    def state():
        return st.SparseHookState(
            MPI.COMM_SELF, algorithm, 1, density=0.2, model=model, overlap=True
        )

    run = state()
    outs = [_iteration(run, params, first if s == 0 else rebuilt, s) for s in range(3)]
    assert set(run.residuals()) == {"0", "1", "2"}
    assert all(v.any() for v in run.residuals().values())  # residuals to carry
    buf = io.BytesIO()
    torch.save(run.state_dict(), buf)
    outs += [_iteration(run, params, rebuilt, s) for s in range(3, 6)]
    buf.seek(0)
    again = state()
    again.load_state_dict(torch.load(buf))
    assert again.step == 3
    resumed = [_iteration(again, params, rebuilt, s) for s in range(3, 6)]
    for a, b in zip(outs[3:], resumed, strict=True):
        for i in range(3):
            assert torch.equal(a[i], b[i])
    assert run.created == 3 and again.created == 2  # one bucket, then two after the rebuild
    assert run.step == again.step == 6


def test_overlap_options_are_checked_at_construction(monkeypatch):
    from mpi4py import MPI

    import spardl.torch as st

    with pytest.raises(ValueError, match="clip_norm needs the whole gradient"):
        st.SparseHookState(MPI.COMM_SELF, clip_norm=1.0, overlap=True)
    with pytest.raises(ValueError, match="momentum_correction needs the whole gradient"):
        st.SparseHookState(MPI.COMM_SELF, momentum_correction=0.9, overlap=True)
    with pytest.raises(TypeError, match="overlap must be a bool, got int"):
        st.SparseHookState(MPI.COMM_SELF, overlap=1)
    monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_FUNNELED)
    with pytest.raises(RuntimeError, match=r"at least MPI.THREAD_SERIALIZED.*THREAD_FUNNELED"):
        st.SparseHookState(MPI.COMM_SELF, overlap=True)
    st.SparseHookState(MPI.COMM_SELF)  # the default mode needs no thread support


# -- the flat buffer: no copy on the CPU, the device array for a CUDA tensor -------------------
def test_reducer_hands_its_flat_buffer_to_the_allreducer_without_a_copy():
    from mpi4py import MPI

    import spardl.torch as st

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    red = st.SparseGradientReducer(model.parameters(), MPI.COMM_SELF, density=0.5)
    inner = red._core.sparse
    seen = []

    def spy(grad):
        seen.append((grad, inner.residual))
        return inner(grad)

    red._core.sparse = spy
    red._core.sparse.residual = inner.residual
    red._core.sparse.residual_mode = inner.residual_mode
    red._core.sparse.stats = inner.stats
    red._core.sparse.broken = inner.broken
    model(torch.randn(2, 6)).sum().backward()
    red.reduce()
    flat = red._core.flat
    ((grad, _),) = seen
    assert isinstance(grad, np.ndarray)
    assert grad.ctypes.data == flat.data_ptr()  # the flat buffer's own memory
    assert torch.equal(flat[:18].view(3, 6), model.weight.grad)


def test_cuda_tensor_goes_to_the_allreducer_as_a_device_array(monkeypatch):
    """No GPU here: a stand-in CUDA tensor (``is_cuda``, ``__cuda_array_interface__``) must reach
    the device view, never ``.cpu()`` or ``.numpy()``."""
    import spardl.torch as st

    class FakeCudaTensor:
        is_cuda = True
        __cuda_array_interface__ = {
            "shape": (4,),
            "typestr": "<f4",
            "data": (0, False),
            "version": 3,
        }

        def detach(self):
            return self

        def cpu(self):
            raise AssertionError("copied to the host")

        numpy = cpu

    viewed = []
    monkeypatch.setattr(st.A, "view", lambda t: viewed.append(t) or "device view")
    t = FakeCudaTensor()
    assert st._vector(t) == "device view" and viewed == [t]
    cpu = torch.arange(4.0)
    assert st._vector(cpu).ctypes.data == cpu.data_ptr()  # a view, not a copy


def test_residual_view_is_zero_copy_on_the_cpu():
    import spardl.torch as st

    res = np.arange(5, dtype=np.float32)
    t = st._tensor(res, torch.zeros(1))
    t[2] = -1
    assert res[2] == -1


def test_a_bucket_stopped_by_a_base_exception_fails_its_future_and_the_thread_serves_on():
    """A bucket's work that raises a BaseException that is no Exception (SystemExit here;
    torch's Future.set_exception refuses one, which killed the communication thread and left
    the caller waiting forever): its future fails with a RuntimeError caused by it, and the
    next bucket is still served."""
    import queue
    import threading

    import spardl.torch as st

    jobs = queue.Queue()
    threading.Thread(target=st._Buckets._serve, args=(jobs,), daemon=True).start()

    def stop():
        raise SystemExit(3)

    stopped, served = torch.futures.Future(), torch.futures.Future()
    jobs.put((stop, stopped))
    jobs.put((lambda: torch.ones(2), served))
    waiter = threading.Thread(target=jobs.join, daemon=True)
    waiter.start()
    waiter.join(60)
    assert not waiter.is_alive(), "the communication thread stopped serving"
    with pytest.raises(RuntimeError, match="stopped by SystemExit: 3") as info:
        stopped.wait()
    assert isinstance(info.value.__cause__, SystemExit)
    assert served.wait().tolist() == [1.0, 1.0]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
