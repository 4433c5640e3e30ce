"""Deep Gradient Compression's techniques in spardl.torch (arXiv 1712.01887 §3.2-3.3): momentum
correction, momentum factor masking, local gradient clipping and the density warm-up.

The NumPy references and option checks run in this process on one rank (MPI.COMM_SELF); the
collective checks (density 1 against dense SGD with momentum, conservation, checkpoint/resume of
the reducer and the DDP hook with every technique on) in one `mpiexec -n 2` job
(tests/scripts/dgc_checks.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from mpirun import ROOT, run_mpi
from plain_state import plain_state

torch = pytest.importorskip("torch")
MPI = pytest.importorskip("mpi4py.MPI")

import spardl.torch as st  # noqa: E402

SCRIPT = "tests/scripts/dgc_checks.py"


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dgc") / "checks.json"
    run_mpi(2, [SCRIPT, str(out)], timeout=300, env={"PYTHONPATH": str(ROOT)})
    return json.loads(out.read_text())


def _reference(grads, k, m, clip, masking):
    """DGC's algorithm on one rank (Algorithm 1 of arXiv 1712.01887 with §3.2-3.3), float32:
    clip g, u ← m·u + g, v ← v + u, send the top-k of |v|, v and (masking) u zeroed there."""
    n = len(grads[0])
    u, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    outs = []
    for g in grads:
        g = g.copy()
        if clip is not None:
            norm = float(np.sqrt(np.sum(np.square(g, dtype=np.float64))))
            if norm > clip:
                g *= np.float32(clip / norm)
        u = u * np.float32(m) + g
        v = v + u
        top = np.argsort(-np.abs(v), kind="stable")[:k]
        out = np.zeros(n, np.float32)
        out[top] = v[top]
        v[top] = 0
        if masking:
            u[top] = 0
        outs.append(out)
    return outs, u, v


def _grads(n, steps, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * scale).astype(np.float32) for _ in range(steps)]


@pytest.mark.parametrize("masking", [True, False])
@pytest.mark.parametrize("clip", [None, 3.0])
def test_momentum_masking_and_clipping_match_numpy_reference(masking, clip):
    n, k, m = 200, 10, 0.9
    p = torch.nn.Parameter(torch.zeros(n))
    red = st.SparseGradientReducer(
        [("w", p)],
        MPI.COMM_SELF,
        "topka",
        density=k / n,
        momentum_correction=m,
        factor_masking=masking,
        clip_norm=clip,
    )
    grads = _grads(n, 6, scale=0.5)
    outs, u, v = _reference(grads, k, m, clip, masking)
    for g, want in zip(grads, outs, strict=True):
        p.grad = torch.from_numpy(g.copy())
        red.reduce()
        np.testing.assert_allclose(p.grad.numpy(), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(red.velocities()["w"], u, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(red.residuals()["w"], v, rtol=1e-6, atol=1e-7)
    if masking:
        np.testing.assert_array_equal(red.velocities()["w"] == 0, u == 0)


def test_clipping_scales_the_threshold_by_one_over_root_p():
    """The local threshold is clip_norm·P^(-1/2) (P = 1 here: clip_norm itself), the whole
    gradient scaled as one vector; a smaller gradient is left as it is."""
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    red = st.SparseGradientReducer([a, b], MPI.COMM_SELF, "topka", density=1.0, clip_norm=1.0)
    a.grad, b.grad = torch.full((3,), 2.0), torch.full((4,), 2.0)
    red.reduce()
    total = float(torch.cat([a.grad, b.grad]).norm())
    assert total == pytest.approx(1.0, rel=1e-6)
    assert torch.allclose(a.grad, torch.full((3,), 2.0 / np.sqrt(28)))
    a.grad, b.grad = torch.full((3,), 0.1), torch.full((4,), 0.1)
    red.reduce()
    assert torch.equal(a.grad, torch.full((3,), 0.1))


def test_density_warmup_falls_exponentially_to_the_target():
    p = torch.nn.Parameter(torch.zeros(1000))
    red = st.SparseGradientReducer(
        [p], MPI.COMM_SELF, "spardl", warmup_steps=1, density=0.01, density_warmup=4
    )
    seen = []
    for _ in range(7):
        p.grad = torch.randn(1000)
        red.reduce()
        seen.append(red.allreducer.density)
    want = [0.01, 0.25, 0.25 * 0.04**0.25, 0.25 * 0.04**0.5, 0.25 * 0.04**0.75, 0.01, 0.01]
    # Step 0 is the dense warm-up: the sparse allreducer keeps its constructed density.
    np.testing.assert_allclose(seen, want, rtol=1e-12)
    assert st.warmup_density_at(0, 4, 0.25, 0.01) == 0.25
    assert st.warmup_density_at(4, 4, 0.25, 0.01) == 0.01


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((2, 10, 0.25, 5), ValueError, r"target must be in \(0, 1\]"),
        ((2, 10, 0.0, 0.01), ValueError, r"start must be in \(0, 1\]"),
        ((2, 10, -0.25, 0.01), ValueError, "start must be in"),
        ((2, 10, "0.25", 0.01), TypeError, "start must be a float"),
        ((-2, 10, 0.25, 0.01), ValueError, "step must be >= 0"),
        ((2, -1, 0.25, 0.01), ValueError, "warmup must be >= 0"),
        ((2.0, 10, 0.25, 0.01), TypeError, "step must be an integer"),
        ((2, True, 0.25, 0.01), TypeError, "warmup must be an integer"),
    ],
)
def test_warmup_density_at_refuses_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        st.warmup_density_at(*args)


def test_nccl_without_a_cuda_device_is_a_value_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match='backend="nccl" needs a CUDA device'):
        st.init_process_group_from_mpi(MPI.COMM_SELF, backend="nccl")
    with pytest.raises(TypeError, match="backend must be a string or None"):
        st.init_process_group_from_mpi(MPI.COMM_SELF, backend=1)


def test_under_torchrun_the_process_group_from_mpi_is_refused(monkeypatch):
    """torchrun --nproc-per-node 2 makes two MPI jobs of one: each would train alone."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="started by torchrun for 2 processes .* mpiexec -n 2"):
        st.init_process_group_from_mpi(MPI.COMM_SELF)
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="started by torchrun for 2 processes"):
        st.SparseGradientReducer(torch.nn.Linear(3, 2).parameters(), MPI.COMM_SELF)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"momentum_correction": 1.0}, ValueError, r"momentum_correction must be in \[0, 1\)"),
        ({"momentum_correction": "0.9"}, TypeError, "momentum_correction must be a float"),
        (
            {"momentum_correction": 0.9, "residual": "none"},
            ValueError,
            "momentum_correction needs error feedback",
        ),
        ({"factor_masking": 1}, TypeError, "factor_masking must be a bool"),
        ({"clip_norm": 0.0}, ValueError, "clip_norm must be a finite number > 0"),
        ({"clip_norm": True}, TypeError, "clip_norm must be a float"),
        ({"density_warmup": -1}, ValueError, "density_warmup must be >= 0"),
        ({"density_warmup": 2.0}, TypeError, "density_warmup must be an integer"),
        ({"warmup_density": 1.5}, ValueError, r"warmup_density must be in \(0, 1\]"),
        ({"dense_numel": -1}, ValueError, "dense_numel must be >= 0"),
        ({"dense_numel": 2.0}, TypeError, "dense_numel must be an integer"),
        ({"factor_masking": False}, ValueError, "factor_masking=False applies with momentum"),
        ({"warmup_density": 0.3}, ValueError, "warmup_density applies with density_warmup"),
        (
            {"density_warmup": 5, "density": 0.5},
            ValueError,
            r"warmup_density \(0.25\) must be >= density \(0.5\)",
        ),
    ],
)
@pytest.mark.parametrize("kind", ["reducer", "hook"])
def test_bad_technique_options_fail_at_construction(kind, options, error, message):
    with pytest.raises(error, match=message):
        if kind == "reducer":
            st.SparseGradientReducer([torch.nn.Parameter(torch.zeros(8))], MPI.COMM_SELF, **options)
        else:
            st.SparseHookState(MPI.COMM_SELF, **options)


def test_a_warmup_density_equal_to_the_stored_density_is_accepted():
    """The warm-up's start is compared with ρ as the float it is stored as: a longdouble a hair
    above 0.5 is stored as 0.5, so a warm-up from 0.5 is valid."""
    rho = np.longdouble(0.5) + np.longdouble(2) ** -60
    red = st.SparseGradientReducer(
        [torch.nn.Parameter(torch.zeros(8))],
        MPI.COMM_SELF,
        density=rho,
        density_warmup=3,
        warmup_density=0.5,
    )
    assert red.state_dict()["techniques"]["warmup_density"] == 0.5


def test_loading_velocities_without_momentum_correction_is_an_error():
    p = torch.nn.Parameter(torch.zeros(50))
    red = st.SparseGradientReducer([p], MPI.COMM_SELF, "topka", momentum_correction=0.5)
    p.grad = torch.randn(50)
    red.reduce()
    plain = st.SparseGradientReducer([p], MPI.COMM_SELF, "topka")
    with pytest.raises(ValueError, match="momentum_correction is None here"):
        plain.load_state_dict(red.state_dict())


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["reducer", "hook"])
def test_density_one_momentum_correction_is_sgd_with_momentum(checks, kind):
    r = checks[f"density_one_{kind}"]
    assert r["moved"] > 1e-2
    assert r["max_diff"] <= 1e-6


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["reducer", "hook"])
@pytest.mark.parametrize("algorithm", ["spardl", "oktopk"])
def test_resume_with_every_technique_is_bit_for_bit(checks, kind, algorithm):
    r = checks[f"resume_{kind}"][algorithm]
    assert r["bit_equal"], r["max_diff"]
    assert r["velocity_equal"] and r["velocity_nonzero"]
    assert r["velocity_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert r["density"] == 0.05 and r["saved_density"] > 0.05  # saved mid warm-up


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["spardl", "oktopk", "topka"])
def test_momentum_correction_conserves_and_masks_what_was_sent(checks, algorithm):
    r = checks["conservation"][algorithm]
    assert r["conservation_error"] <= 1e-6
    assert r["mask_ok"] and r["masked"] > 0


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["spardl", "oktopk"])
def test_dense_numel_gives_small_parameters_the_mean_over_ranks(checks, algorithm):
    r = checks["dense_small"][algorithm]
    assert r["mean_error"] <= 1e-6, r
    assert r["conservation_error"] <= 1e-6, r
    assert r["velocity_kept"], r
    assert r["sum_error"] <= 1e-6, r  # op="sum" sums the small parameters too


def test_momentum_correction_with_the_dense_algorithm_is_sgd_with_momentum():
    """algorithm="dense" with momentum correction (the velocity reduced, the optimizer without
    momentum) trains as SGD with momentum. Factor masking zeroed the velocity at every step
    (dense sends everything), and the run had no momentum at all."""
    torch.manual_seed(0)
    grads = [torch.randn(16) for _ in range(5)]
    p, q = torch.nn.Parameter(torch.ones(16)), torch.nn.Parameter(torch.ones(16))
    red = st.SparseGradientReducer([p], MPI.COMM_SELF, "dense", momentum_correction=0.9)
    opt_p = torch.optim.SGD([p], lr=0.1, momentum=0.0)
    opt_q = torch.optim.SGD([q], lr=0.1, momentum=0.9)
    for g in grads:
        p.grad, q.grad = g.clone(), g.clone()
        red.reduce()
        opt_p.step()
        opt_q.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-6)


def test_a_step_that_raises_leaves_the_velocity_as_it_was():
    import spardl

    p = torch.nn.Parameter(torch.zeros(40))
    red = st.SparseGradientReducer([p], MPI.COMM_SELF, "topka", momentum_correction=0.9)
    p.grad = torch.randn(40)
    red.reduce()
    before = red.velocities()[next(iter(red.velocities()))].copy()
    p.grad = torch.full((40,), float("nan"))
    with pytest.raises(spardl.NonFiniteError):
        red.reduce()
    after = red.velocities()[next(iter(red.velocities()))]
    assert after.tobytes() == before.tobytes()


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_a_rejected_step_in_the_density_warmup_leaves_the_state_as_it_was(nonfinite):
    """The warm-up moves the density before the step; a step that raises (or is skipped) puts
    the density, and what depends on it (the threshold selector's state), back."""
    import spardl

    p = torch.nn.Parameter(torch.zeros(400))
    red = st.SparseGradientReducer(
        [p],
        MPI.COMM_SELF,
        "spardl",
        density=0.01,
        selector="threshold",
        density_warmup=4,
        momentum_correction=0.9,
        nonfinite=nonfinite,
    )
    rng = np.random.default_rng(3)
    for _ in range(2):
        p.grad = torch.from_numpy(rng.standard_normal(400).astype(np.float32))
        red.reduce()
    before = red.state_dict()
    density = red.allreducer.density
    p.grad = torch.full((400,), float("nan"))
    if nonfinite == "raise":
        with pytest.raises(spardl.NonFiniteError):
            red.reduce()
    else:
        red.reduce()
    assert red.allreducer.density == density
    after = red.state_dict()
    # Traffic counters count what was sent, by a rejected step too (its agreement messages).
    before.pop("stats"), after.pop("stats")
    assert repr(plain_state(after)) == repr(plain_state(before))


def test_a_step_whose_accumulation_raises_puts_the_warmups_density_back(monkeypatch):
    """The warm-up moves the density before momentum correction's accumulation; when the
    accumulation raises (injected), the density and the rest of the state are as before the
    step, and the next step runs."""
    p = torch.nn.Parameter(torch.zeros(400))
    red = st.SparseGradientReducer(
        [p], MPI.COMM_SELF, "spardl", density=0.01, density_warmup=4, momentum_correction=0.9
    )
    rng = np.random.default_rng(3)
    for _ in range(2):
        p.grad = torch.from_numpy(rng.standard_normal(400).astype(np.float32))
        red.reduce()
    before, density = red.state_dict(), red.allreducer.density

    def fail(self, ar, unused, dense):
        raise RuntimeError("injected accumulation failure")

    with monkeypatch.context() as mp:
        mp.setattr(st._Core, "_accumulate_velocity", fail)
        p.grad = torch.from_numpy(rng.standard_normal(400).astype(np.float32))
        with pytest.raises(RuntimeError, match="injected accumulation failure"):
            red.reduce()
    assert red.allreducer.density == density
    after = red.state_dict()
    before.pop("stats"), after.pop("stats")
    assert repr(plain_state(after)) == repr(plain_state(before))
    p.grad = torch.from_numpy(rng.standard_normal(400).astype(np.float32))
    red.reduce()
    assert red.allreducer.density < density  # the schedule goes on from the step it was at


def test_a_restore_that_raises_keeps_the_steps_error_and_refuses_every_later_call(monkeypatch):
    """A step of the density warm-up raises NonFiniteError and putting its density back raises
    too (injected): the caller sees the NonFiniteError, the restore's failure in a note (it once
    replaced it), and the half-restored reducer refuses every later call but close()."""
    import spardl

    p = torch.nn.Parameter(torch.zeros(400))
    red = st.SparseGradientReducer(
        [p], MPI.COMM_SELF, "spardl", density=0.01, density_warmup=4, nonfinite="raise"
    )
    rng = np.random.default_rng(3)
    for _ in range(2):
        p.grad = torch.from_numpy(rng.standard_normal(400).astype(np.float32))
        red.reduce()

    def fail(self, saved):
        raise RuntimeError("injected restore failure")

    monkeypatch.setattr(type(red.allreducer), "_restore", fail)
    p.grad = torch.full((400,), float("nan"))
    with pytest.raises(spardl.NonFiniteError) as info:
        red.reduce()
    assert "injected restore failure" in "".join(getattr(info.value, "__notes__", []))
    monkeypatch.undo()
    p.grad = torch.from_numpy(rng.standard_normal(400).astype(np.float32))
    for call in (red.reduce, red.state_dict, lambda: red.load_state_dict({})):
        with pytest.raises(RuntimeError, match="state could not be restored"):
            call()
    red.close()


def test_a_half_restored_reducer_refuses_a_load_without_reading_its_allreducer(monkeypatch):
    """A reducer whose allreducer could not be restored (``broken``) refuses a load with the
    RuntimeError saying so, without taking a snapshot of that allreducer first: its state is
    half restored, and is neither read nor loaded into."""
    p = torch.nn.Parameter(torch.zeros(40))
    red = st.SparseGradientReducer([p], MPI.COMM_SELF, "topka", density=0.1)
    p.grad = torch.randn(40)
    red.reduce()
    state = red.state_dict()
    red.allreducer.broken = RuntimeError("injected undo failure")
    read = []
    monkeypatch.setattr(type(red.allreducer), "_snapshot", lambda self: read.append(self))
    with pytest.raises(RuntimeError, match="state could not be restored"):
        red.load_state_dict(state)
    assert read == []
    red.close()


def test_plain_state_takes_a_bfloat16_tensor():
    """tests/plain_state.py on a bfloat16 tensor (NumPy has no bfloat16): its values exactly,
    under its own dtype, so that it never equals a float32 tensor of the same values."""
    a = torch.tensor([1.0, -2.5, 0.0, 3.0e38], dtype=torch.bfloat16)
    kind, dtype, shape, _ = plain_state({"r": a})["r"]
    assert (kind, dtype, shape) == ("tensor", "torch.bfloat16", (4,))
    assert plain_state(a) == plain_state(a.clone())
    assert plain_state(a) != plain_state(a.float())
    assert plain_state(a) != plain_state(-a)


def test_velocity_follows_each_parameter_into_another_layout():
    a, b = torch.nn.Parameter(torch.zeros(30)), torch.nn.Parameter(torch.zeros(20))
    red = st.SparseGradientReducer(
        [("a", a), ("b", b)], MPI.COMM_SELF, "topka", density=0.1, momentum_correction=0.9
    )
    for _ in range(2):
        a.grad, b.grad = torch.randn(30), torch.randn(20)
        red.reduce()
    saved, vel = red.state_dict(), red.velocities()
    other = st.SparseGradientReducer(
        [("b", b), ("a", a)], MPI.COMM_SELF, "topka", density=0.1, momentum_correction=0.9
    )
    other.load_state_dict(saved)
    a.grad, b.grad = torch.zeros(30), torch.zeros(20)
    other.reduce()  # u ← 0.9·u: the loaded velocities, each in its parameter's new place
    for k in ("a", "b"):
        u = vel[k] * np.float32(0.9)
        got = other.velocities()[k]
        np.testing.assert_array_equal(got[got != 0], u[got != 0])
        assert np.count_nonzero(got) > 0


def _small_and_big(n_small=6, n_big=300):
    b, w = torch.nn.Parameter(torch.zeros(n_small)), torch.nn.Parameter(torch.zeros(n_big))
    return b, w


@pytest.mark.parametrize("algorithm", ["spardl", "oktopk", "topka", "gtopk"])
def test_dense_numel_reduces_small_parameters_dense_and_the_rest_sparse(algorithm):
    """P = 1: a parameter of at most dense_numel elements gets its gradient in full (the dense
    mean of one rank), tiny as it is; the large one only its top-k with error feedback, the
    same as an allreducer given the large parameter alone (where the small one's zeros never
    compete); the returned result is the written .grad."""
    b, w = _small_and_big()
    red = st.SparseGradientReducer(
        [("b", b), ("w", w)], MPI.COMM_SELF, algorithm, density=0.02, dense_numel=6
    )
    alone_w = torch.nn.Parameter(torch.zeros(300))
    alone = st.SparseGradientReducer([("w", alone_w)], MPI.COMM_SELF, algorithm, density=0.02)
    rng = np.random.default_rng(1)
    for _ in range(4):
        gb = (rng.standard_normal(6) * 1e-6).astype(np.float32)  # far below w's top-k
        gw = rng.standard_normal(300).astype(np.float32)
        b.grad, w.grad = torch.from_numpy(gb.copy()), torch.from_numpy(gw.copy())
        alone_w.grad = torch.from_numpy(gw.copy())
        out = red.reduce()
        alone.reduce()
        np.testing.assert_array_equal(b.grad.numpy(), gb)
        np.testing.assert_array_equal(w.grad.numpy(), alone_w.grad.numpy())
        np.testing.assert_array_equal(out.to_dense(), torch.cat([b.grad, w.grad]).numpy())
    assert not red.residuals()["b"].any()  # never part of the sparse allreduce
    np.testing.assert_array_equal(red.residuals()["w"], alone.residuals()["w"])


def test_dense_numel_keeps_the_small_parameters_velocity():
    """With momentum correction a dense-reduced parameter is sent in full every step and its
    velocity is not masked: it receives u = m·u + g (momentum SGD); the large one is masked."""
    b, w = _small_and_big()
    red = st.SparseGradientReducer(
        [("b", b), ("w", w)],
        MPI.COMM_SELF,
        "topka",
        density=0.02,
        dense_numel=6,
        momentum_correction=0.5,
    )
    gb = np.arange(1, 7, dtype=np.float32)
    gw = np.linspace(-1, 1, 300, dtype=np.float32)
    want = np.zeros(6, np.float32)
    for _ in range(3):
        b.grad, w.grad = torch.from_numpy(gb.copy()), torch.from_numpy(gw.copy())
        red.reduce()
        want = np.float32(0.5) * want + gb
        np.testing.assert_array_equal(b.grad.numpy(), want)
        np.testing.assert_array_equal(red.velocities()["b"], want)
    sent = w.grad.numpy() != 0
    assert sent.any() and not red.velocities()["w"][sent].any()


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_a_nonfinite_small_parameter_rejects_the_whole_step(nonfinite):
    """NaN in a dense-reduced parameter: the step raises (or is skipped) as a NaN in the sparse
    part would: no .grad written, the residuals, velocities and step as they were."""
    import spardl

    b, w = _small_and_big()
    red = st.SparseGradientReducer(
        [("b", b), ("w", w)],
        MPI.COMM_SELF,
        "spardl",
        density=0.02,
        dense_numel=6,
        momentum_correction=0.9,
        nonfinite=nonfinite,
    )
    rng = np.random.default_rng(2)
    for _ in range(2):
        b.grad = torch.from_numpy(rng.standard_normal(6).astype(np.float32))
        w.grad = torch.from_numpy(rng.standard_normal(300).astype(np.float32))
        red.reduce()
    before = red.state_dict()
    b.grad = torch.full((6,), float("nan"))
    w.grad = torch.ones(300)
    if nonfinite == "raise":
        with pytest.raises(spardl.NonFiniteError, match="dense-reduced small parameters"):
            red.reduce()
    else:
        out = red.reduce()
        assert out.nnz == 0 and not w.grad.any() and not b.grad.any()
        assert red.stats["skipped_steps"] == 1
    after = red.state_dict()
    before.pop("stats"), after.pop("stats")
    assert repr(plain_state(after)) == repr(plain_state(before))


def test_a_residual_on_newly_small_parameters_is_sent_not_lost():
    """A state saved with a smaller dense_numel holds residual on parameters that are now
    reduced dense: the next step sends it with their dense part and clears it (nothing lost,
    and the sparse part keeps all its k places for the large parameter)."""

    def params():
        return [torch.nn.Parameter(torch.zeros(1000)), torch.nn.Parameter(torch.zeros(8))]

    ps = params()
    before = st.SparseGradientReducer(ps, MPI.COMM_SELF, "topka", density=0.005)
    ps[0].grad = torch.full((1000,), 0.01)
    ps[1].grad = torch.arange(100.0, 108.0)
    before.reduce()
    held = before.residuals()["1"].copy()
    assert held.any()  # k = 5 of 1008: some of the small parameter's mass stayed behind
    ps2 = params()
    after = st.SparseGradientReducer(ps2, MPI.COMM_SELF, "topka", density=0.005, dense_numel=8)
    after.load_state_dict(before.state_dict())
    big_res = after.residuals()["0"].copy()
    ps2[0].grad = torch.full((1000,), 0.01)
    ps2[1].grad = torch.zeros(8)
    after.reduce()
    np.testing.assert_array_equal(ps2[1].grad.numpy(), held)
    assert not after.residuals()["1"].any()
    assert int((ps2[0].grad != 0).sum()) == 5
    # Conservation over the large parameter: input + old residual = output + new residual.
    np.testing.assert_allclose(
        ps2[0].grad.numpy() + after.residuals()["0"], 0.01 + big_res, rtol=1e-6
    )


def test_a_model_of_small_parameters_only_is_reduced_dense():
    """Every parameter at most dense_numel elements: every step is a dense one (the values a
    top-k would drop arrive too), also for one DDP bucket of small parameters in overlap mode,
    where each bucket has its own layout."""
    a, b = torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(3))
    red = st.SparseGradientReducer([a, b], MPI.COMM_SELF, "topka", density=0.1, dense_numel=5)
    rng = np.random.default_rng(4)
    for _ in range(3):
        ga, gb = (
            rng.standard_normal(5).astype(np.float32),
            rng.standard_normal(3).astype(np.float32),
        )
        a.grad, b.grad = torch.from_numpy(ga.copy()), torch.from_numpy(gb.copy())
        out = red.reduce()
        np.testing.assert_array_equal(a.grad.numpy(), ga)
        np.testing.assert_array_equal(b.grad.numpy(), gb)
        np.testing.assert_array_equal(out.to_dense(), np.concatenate([ga, gb]))
    assert not any(v.any() for v in red.residuals().values())


def _scan_result(core, out):
    """The result as a scan of the whole flat buffer finds it (every non-zero)."""
    from spardl.result import SparseResult

    idx = torch.nonzero(core.flat).flatten()
    return SparseResult._of(st._vector(idx), st._vector(core.flat[idx]), core.n)


def _torch_mask(u, res, x):
    u.masked_fill_(torch.logical_and(res == 0, x != 0), 0)


def _bits(t):
    t = torch.as_tensor(np.asarray(t))
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()]).tolist()


def _cloning_accumulate(core, ar, unused, dense):
    """Momentum correction as torch's separate passes on the velocity itself, the old one
    cloned for an undo (what the host's one pass and second buffer replace); factor masking's
    X on the sparse steps of a sparse allreducer."""
    mask = core.tech.factor_masking and not dense and ar.name != "dense"
    flat, u = core.flat, core._velocity()
    u_before = u.clone()
    kept = [(a, b, u[a:b].clone()) for a, b in unused]
    u.mul_(core.tech.momentum).add_(flat)
    for a, b, v in kept:
        u[a:b] = v
    flat.copy_(u)
    for a, b, _ in kept:
        flat[a:b].zero_()
    if not mask:
        return u_before, None
    work = torch.float32 if flat.dtype == torch.float16 else flat.dtype  # the allreducer's
    return u_before, torch.add(flat.to(work), st._tensor(ar.residual, flat).to(work))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("masking", [True, False])
@pytest.mark.parametrize("algorithm", ["topka", "spardl"])
@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
@pytest.mark.parametrize("path", ["host", "torch"])
def test_the_one_pass_host_path_has_the_bits_of_torchs_passes(
    monkeypatch, dtype, masking, algorithm, nonfinite, path
):
    """On the host, momentum correction's accumulation and factor masking take one pass each
    (spardl_kernels.cpu.arrays) and write the velocity into a second buffer, recycled; the
    result is read at the sparse part's and the small parameters' places only. Over two dense
    warm-up steps and sparse ones, a parameter unused right after the warm-up (zero residual,
    non-zero velocity) and every other step after, small parameters reduced dense (one with a
    mean of zero), and a step with a NaN (raised or skipped) followed by more steps, every
    gradient, result, velocity and residual has the bits of torch's passes on the velocity
    itself with a clone for the undo, and of a scan of the whole buffer. ``path="torch"``
    runs the passes a device takes, torch's ops into the second buffer, on the host; a float16
    model takes them on either path (its X = u + E in float32, the allreducer's work dtype)."""
    import spardl

    def run(reference):
        with monkeypatch.context() as mp:
            if path == "torch":
                mp.setattr(st, "_host_kernels_take", lambda *tensors: False)
            if reference:
                mp.setattr(st._Core, "_accumulate_velocity", _cloning_accumulate)
                mp.setattr(st._Core, "_recycle_velocity", lambda core, u: None)
                mp.setattr(st, "_mask_sent", _torch_mask)
                mp.setattr(st._Core, "_result", _scan_result)
            shapes = {"w1": (30, 10), "bias": (8,), "sometimes": (50,), "w2": (120,)}
            params = {k: torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for k, s in shapes.items()}
            red = st.SparseGradientReducer(
                list(params.items()),
                MPI.COMM_SELF,
                algorithm,
                density=0.05,
                momentum_correction=0.9,
                factor_masking=masking,
                dense_numel=8,
                warmup_steps=2,
                nonfinite=nonfinite,
            )
            gen = torch.Generator().manual_seed(0)
            seen = []
            for step in range(10):
                for name, p in params.items():
                    used = name != "sometimes" or step in (0, 1, 4, 6, 8)
                    p.grad = torch.randn(p.shape, generator=gen, dtype=dtype) if used else None
                if step == 0:  # a small parameter's mean of zero: no entry of the result
                    params["bias"].grad.zero_()
                if step == 5:
                    params["w2"].grad[3] = float("nan")
                    if nonfinite == "raise":
                        with pytest.raises(spardl.NonFiniteError):
                            red.reduce()
                        continue
                out = red.reduce()
                seen.append([_bits(out.indices), _bits(out.values)])
                seen.append(
                    [_bits(p.grad.reshape(-1)) for p in params.values() if p.grad is not None]
                )
            seen.append({k: _bits(v) for k, v in red.velocities().items()})
            seen.append({k: _bits(v) for k, v in red.residuals().items()})
            return seen

    fast, slow = run(False), run(True)
    assert fast == slow
    assert any(v != 0 for v in fast[-2]["sometimes"])  # the velocity of the sometimes-unused one
