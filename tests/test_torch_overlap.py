"""spardl.torch: the DDP hook's overlap mode, and the flat buffer handed over without copies.

The collective checks run in one `mpiexec -n 2` job (tests/scripts/torch_overlap_checks.py) that
writes its measurements to JSON; the tests marked mpi assert on parts of them. The others run in
this process on one rank (MPI.COMM_SELF), with fake buckets where DDP is not needed.
"""

from __future__ import annotations

import io
import json
import sys

import numpy as np
import pytest
from mpirun import ROOT, run_mpi
from scripts.fake_bucket import FakeBucket

torch = pytest.importorskip("torch")

SCRIPT = "tests/scripts/torch_overlap_checks.py"


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_overlap") / "checks.json"
    run_mpi(2, [SCRIPT, str(out)], timeout=240, env={"PYTHONPATH": str(ROOT)})
    return json.loads(out.read_text())


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
def test_error_zeroes_that_buckets_future(checks):
    r = checks["errors"]
    for futures, raised in zip(r["futures"], r["hook_raised"], strict=True):
        assert futures[0] == "zeros"  # bucket 0 failed (inf on rank 1): nothing applied
        assert futures[1] == "ok"  # bucket 1 of that iteration is applied
        # The next iteration runs and is counted; its fake buckets come without a backward
        # pass, so no rank used their parameters and nothing of them is reduced (zeros). An
        # iteration of used parameters after a failing bucket: the test after _iteration below.
        assert futures[2:] == ["zeros"] * 3
        assert raised == ["NonFiniteError", "ok"]
    assert r["steps_after"] == 2


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
    """One rank: a NaN in bucket 0 raises NonFiniteError at the last bucket, bucket 0's future
    is zeros and bucket 1's its result; the next iteration (a real backward, every parameter
    used) reduces every bucket as usual."""
    from mpi4py import MPI

    import spardl
    import spardl.torch as st

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (8, 5, 3)]
    state = st.SparseHookState(
        MPI.COMM_SELF,
        "spardl",
        0,
        density=0.5,
        nonfinite="raise",
        model=torch.nn.ParameterList(params),
        overlap=True,
    )
    sum((i + 1) * p.sum() for i, p in enumerate(params)).backward()  # every parameter used
    grads = [p.grad.clone() for p in params]
    grads[0][3] = float("nan")
    futs = [state._bucket(FakeBucket(b, grads[b], [params[b]], False)) for b in (0, 1)]
    with pytest.raises(spardl.NonFiniteError):
        state._bucket(FakeBucket(2, grads[2], [params[2]], True))
    assert bool((futs[0].wait() == 0).all())
    assert bool(futs[1].wait().any())
    out = _iteration(state, params, [[0], [1], [2]], seed=1)
    assert all(bool(out[i].any()) for i in range(3))
    assert state.step == 2


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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
