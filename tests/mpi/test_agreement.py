"""The PyTorch integration's construction and every load_state_dict are collective: options that
differ across ranks, and a state that is bad on one rank only, raise on every rank, and a failed
load leaves every rank's state as it was (no rank is left out of step).

Runs on every rank under `mpiexec -n P` (tests/test_mpi.py); at P = 1 there is no other rank to
differ, and the same calls must succeed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

import spardl
import spardl.torch as st

P = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"warmup_steps": RANK}, "warmup_steps"),
        ({"momentum_correction": 0.9 if RANK else None}, "momentum_correction"),
        ({"momentum_correction": 0.9, "factor_masking": RANK == 0}, "factor_masking"),
        ({"clip_norm": 1.0 + RANK}, "clip_norm"),
        ({"density_warmup": RANK + 1}, "density_warmup"),
        ({"density_warmup": 3, "warmup_density": 0.25 + 0.1 * RANK}, "warmup_density"),
        ({"density": 0.1 + 0.1 * RANK}, "density"),  # valid on every rank up to P = 9
        ({"algorithm": "spardl" if RANK == 0 else "topka"}, "algorithm"),
    ],
)
@pytest.mark.parametrize("kind", ["reducer", "hook"])
def test_options_that_differ_across_ranks_fail_at_construction(comm, kind, options, named):
    model = _model()

    def build():
        if kind == "reducer":
            return st.SparseGradientReducer(model.parameters(), comm, **options)
        return st.SparseHookState(comm, model=model, **options)

    if P == 1:
        build()
        return
    with pytest.raises(ValueError, match=f"ranks disagree on .*{named}"):
        build()


def test_parameter_layouts_that_differ_across_ranks_fail_at_construction(comm):
    params = list(_model().parameters())
    mine = params if RANK == 0 else params[:1]
    if P == 1:
        st.SparseGradientReducer(mine, comm)
        return
    with pytest.raises(ValueError, match="ranks disagree on parameters"):
        st.SparseGradientReducer(mine, comm)


def _bad_on_last_rank(good):
    return good if RANK != P - 1 else {"algorithm": good["algorithm"]}


def test_allreducer_load_failing_on_one_rank_raises_everywhere_state_unchanged(comm):
    ar = spardl.make("spardl", comm, 20, density=0.2)
    ar(np.random.default_rng(RANK).standard_normal(20))
    saved = ar.state_dict()
    ar(np.random.default_rng(RANK + 9).standard_normal(20))
    before = ar.state_dict()
    with pytest.raises(ValueError, match="missing key"):
        ar.load_state_dict(_bad_on_last_rank(saved))
    after = ar.state_dict()
    assert (after["step"], after["calls"]) == (before["step"], before["calls"])
    np.testing.assert_array_equal(after["residual"], before["residual"])
    out = ar(np.ones(20))  # every rank still in step: no "ranks disagree on call number"
    assert comm.allgather(out.indices.tolist()) == [out.indices.tolist()] * P


@pytest.mark.parametrize("bad", [None, {}])
def test_allreducer_load_of_non_state_names_state(comm, bad):
    ar = spardl.make("topka", comm, 10)
    with pytest.raises(TypeError if bad is None else ValueError, match="state"):
        ar.load_state_dict(bad)


def test_reducer_load_failing_on_one_rank_raises_everywhere_state_unchanged(comm):
    model = _model()
    red = st.SparseGradientReducer(model.parameters(), comm, density=0.5)

    def step(seed):
        model.zero_grad()
        torch.manual_seed(seed + RANK)
        model(torch.randn(3, 8)).sum().backward()
        return red.reduce()

    step(0)
    saved = red.state_dict()
    step(1)
    before = red.state_dict()
    for bad in (None, _bad_on_last_rank(saved)):
        with pytest.raises((TypeError, ValueError), match="state"):
            red.load_state_dict(bad)
    after = red.state_dict()
    assert after["step"] == before["step"] == 2
    for k, v in before["allreducer"].items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(after["allreducer"][k], v), k
    out = step(2)
    assert comm.allgather(out.indices.tolist()) == [out.indices.tolist()] * P


@pytest.mark.parametrize(
    ("grad", "message"),
    [
        (None, "grad must be a 1-D float array, got NoneType"),
        (3.0, "grad must be a 1-D float array, got float"),
        (np.array([1.0] * 10, object), "got ndarray of dtype object"),
        (torch.ones(10, requires_grad=True), r"requires grad: pass grad.detach\(\)"),
    ],
)
def test_grad_of_the_wrong_type_is_a_type_error(comm, grad, message):
    ar = spardl.make("topka", comm, 10)
    with pytest.raises(TypeError, match=message):
        ar(grad)


def test_a_list_after_a_float32_gradient_names_the_conversion(comm):
    """A Python list becomes float64 in NumPy: after float32 calls the error says so."""
    ar = spardl.make("topka", comm, 10)
    ar(np.ones(10, np.float32))
    with pytest.raises(TypeError, match=r"float32 to float64 \(NumPy's dtype for a list: pass"):
        ar([1.0] * 10)
    with pytest.raises(TypeError, match=r"float32 to float64$"):
        ar(np.ones(10))


@pytest.mark.parametrize(
    ("params", "error", "message"),
    [
        (lambda m: torch.ones(3), TypeError, "got a single Tensor"),
        (lambda m: [], ValueError, "no parameter with requires_grad"),
        (lambda m: list(m.parameters()) * 2, ValueError, "the same parameter twice"),
        # The result of an operation gets no .grad from backward(): never reduced.
        (
            lambda m: [torch.ones(3, requires_grad=True) * 2],
            TypeError,
            "leaf tensors .* got 0, the result of an operation",
        ),
    ],
)
def test_bad_params_name_params(comm, params, error, message):
    with pytest.raises(error, match=message):
        st.SparseGradientReducer(params(_model()), comm)


@pytest.mark.parametrize("algorithm", ["spardl", "dense"])
def test_a_nonfinite_reduce_zeroes_every_gradient_on_every_rank(comm, algorithm):
    """A NaN on one rank: NonFiniteError on every rank, and every .grad zero everywhere (an
    optimizer step taken anyway applies no rank's own gradient, as under DDP); the next step
    reduces as if the rejected one had not happened."""
    model, twin = _model(), _model()
    reducers = [
        st.SparseGradientReducer(m.parameters(), comm, algorithm, density=0.5)
        for m in (model, twin)
    ]
    x = torch.ones(3, 8) * (comm.rank + 1)
    model(x).sum().backward()
    if comm.rank == 0:
        next(model.parameters()).grad[0, 0] = float("nan")
    with pytest.raises(spardl.NonFiniteError):
        reducers[0].reduce()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    for m, r in zip((model, twin), reducers, strict=True):
        m.zero_grad()
        m(x).sum().backward()
        r.reduce()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_numpy_and_python_option_values_of_the_same_value_agree(comm):
    """An option given as a NumPy scalar on one rank and a Python number on another (or a tuple
    and a list) means the same allreducer: it is built on every rank and gives the same result;
    a value that differs is refused on every rank, named."""
    last = comm.rank == comm.size - 1
    d = 1 if P % 2 else 2
    ar = spardl.make("spardl", comm, 64, density=0.1, teams=np.int64(d) if last else d)
    g = np.random.default_rng(comm.rank).standard_normal(64).astype(np.float32)
    out = ar(g)
    every = comm.allgather((out.indices.tobytes(), out.values.tobytes()))
    assert all(e == every[0] for e in every)
    names = ["topka", "dense"]
    a = spardl.make("auto", comm, 64, density=0.1, candidates=tuple(names) if last else names)
    assert a.stats["auto"]["choice"] == "topka"
    if P > 1:
        with pytest.raises(ValueError, match="ranks disagree on options"):
            spardl.make("oktopk", comm, 64, density=0.1, region_interval=np.int64(3 if last else 4))


def test_an_option_named_at_its_default_on_one_rank_only_agrees(comm):
    """teams=1 named on one rank and left out on another build the same allreducer (once
    "ranks disagree on options", the options being compared as named, not as they act)."""
    last = comm.rank == comm.size - 1
    for algorithm, option in [("spardl", {"teams": 1}), ("oktopk", {"selector": "threshold"})]:
        ar = spardl.make(algorithm, comm, 64, density=0.1, **(option if last else {}))
        out = ar(np.random.default_rng(comm.rank).standard_normal(64).astype(np.float32))
        every = comm.allgather((out.indices.tobytes(), out.values.tobytes()))
        assert all(e == every[0] for e in every)
        ar.close()


@pytest.mark.parametrize("check", [True, False])
def test_a_bad_gradient_on_one_rank_fails_everywhere_with_and_without_check(comm, check):
    """The reducer's step control: a sparse gradient on the last rank raises on every rank,
    naming the parameter, with the agreement (``check=True``) and with the single
    control sum of ``check=False``; the next step runs on every rank."""
    model = _model()
    red = st.SparseGradientReducer(model.parameters(), comm, density=0.25, check=check)
    torch.manual_seed(RANK)
    model(torch.randn(3, 8)).sum().backward()
    good = model[0].weight.grad
    if RANK == P - 1:
        model[0].weight.grad = good.to_sparse()
    with pytest.raises(TypeError, match=r"parameter 0 has a sparse gradient"):
        red.reduce()
    model[0].weight.grad = good
    out = red.reduce()
    assert comm.allgather(out.indices.tolist()) == [out.indices.tolist()] * P


def test_a_gradient_of_another_dtype_on_one_rank_fails_everywhere(comm):
    """A complex ``.grad`` set through ``.data`` on the last rank: it was cast into the float
    buffer (its imaginary part dropped without a word); now every rank raises, naming the
    parameter and both dtypes, and the next step runs on every rank."""
    model = _model()
    red = st.SparseGradientReducer(model.parameters(), comm, density=0.25)
    torch.manual_seed(RANK)
    model(torch.randn(3, 8)).sum().backward()
    good = model[0].weight.grad.clone()
    if RANK == P - 1:
        model[0].weight.grad.data = good.to(torch.complex64) + 1j
    with pytest.raises(TypeError, match=r"parameter 0|rank") as info:
        red.reduce()
    if RANK == P - 1:
        assert "dtype torch.complex64, the parameter torch.float32" in str(info.value)
    model[0].weight.grad = good
    out = red.reduce()
    assert comm.allgather(out.indices.tolist()) == [out.indices.tolist()] * P


def test_a_parameter_frozen_on_some_ranks_only_fails_everywhere(comm):
    """A parameter frozen after the reducer was built on the last rank only: that rank kept its
    own gradient while the others applied the mean (the replicas drifted apart). Every rank
    raises, naming it; frozen on every rank it is left alone, as before."""
    model = _model()
    red = st.SparseGradientReducer(model.named_parameters(), comm, density=0.25)
    torch.manual_seed(RANK)
    model(torch.randn(3, 8)).sum().backward()
    weight = model[1].weight
    if RANK == P - 1:
        weight.requires_grad_(False)
    if P > 1:
        with pytest.raises(ValueError, match=rf"parameter 1.weight is frozen .* on 1 of {P} ranks"):
            red.reduce()
    weight.requires_grad_(False)
    kept = weight.grad.clone()
    out = red.reduce()
    assert torch.equal(weight.grad, kept)
    assert comm.allgather(out.indices.tolist()) == [out.indices.tolist()] * P


def test_a_parameter_unfrozen_after_the_reducer_was_built_fails_everywhere(comm):
    """A parameter frozen when the reducer was built and unfrozen later (on the last rank, say)
    gets a gradient that no rank reduces: every rank raises, naming it."""
    model = _model()
    model[1].bias.requires_grad_(False)
    red = st.SparseGradientReducer(model.named_parameters(), comm, density=0.25)
    if RANK == P - 1:
        model[1].bias.requires_grad_(True)
    torch.manual_seed(RANK)
    model(torch.randn(3, 8)).sum().backward()
    with pytest.raises(ValueError, match=r"parameter 1.bias was frozen|rank"):
        red.reduce()
    model[1].bias.grad = None  # frozen again, or its gradient dropped: reduced as before
    out = red.reduce()
    assert comm.allgather(out.indices.tolist()) == [out.indices.tolist()] * P


def test_reduce_again_with_no_backward_fails_everywhere(comm):
    """reduce() twice with no backward pass in between (on the last rank; the others ran one):
    the reduced gradient would be reduced again, with the residuals sent once more. Every rank
    raises; a gradient changed in place (clipped) counts as new, and so does a backward."""
    model = _model()
    red = st.SparseGradientReducer(model.parameters(), comm, density=0.25)

    def backward(seed):
        torch.manual_seed(100 * seed + RANK)
        model.zero_grad()
        model(torch.randn(3, 8)).sum().backward()

    backward(0)
    red.reduce()
    if RANK != P - 1:
        backward(1)
    with pytest.raises(ValueError, match="reduce\\(\\) was called again with no backward|rank"):
        red.reduce()
    backward(2)
    red.reduce()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # in place: a new gradient
    red.reduce()
    model[0].bias.grad.data.mul_(2)  # through .data (no version bump): new values all the same
    out = red.reduce()
    assert comm.allgather(out.indices.tolist()) == [out.indices.tolist()] * P


def test_ranks_that_fail_with_different_types_raise_one_type(comm):
    """Rank 1 passes a density of the wrong type (TypeError), rank 2 one out of range
    (ValueError): every rank raises the first failing rank's type, so that one ``except``
    catches it everywhere; rank 2's message keeps its own error too."""
    density = {1: "x", 2: 2.0}.get(comm.rank, 0.1)
    if comm.size == 1:
        spardl.make("topka", comm, 20, density=density).close()
        return
    with pytest.raises(TypeError) as info:
        spardl.make("topka", comm, 20, density=density)
    if comm.rank == 2:
        assert "rank 1 rejected its arguments" in str(info.value)
        assert "this rank's own: ValueError: density must be in (0, 1]" in str(info.value)
