"""The PyTorch reducer and hook on models of unusual layouts: parameters of no elements, and
float64 parameters beside float32 ones. At density 1 the result must be the exact mean.

Runs on every rank under `mpiexec -n P` (tests/test_mpi.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI
from scripts.fake_bucket import FakeBucket

import spardl.torch as st

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()


def _grads(shapes_dtypes, seed):
    """Each rank's gradients: seeded by rank and ``seed``, values with low bits a float32 drops."""
    gen = torch.Generator().manual_seed(1000 * seed + RANK)
    return [
        (1 + torch.rand(shape, generator=gen, dtype=torch.float64) * 1e-9).to(dtype)
        for shape, dtype in shapes_dtypes
    ]


def _exact_mean(grads):
    every = COMM.allgather([g.to(torch.float64).numpy() for g in grads])
    return [np.mean([rank[i] for rank in every], axis=0) for i in range(len(grads))]


def _reduce(kind, params, grads, **options):
    """One step of the reducer, or of the hook on one bucket of every parameter."""
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    if kind == "reducer":
        red = st.SparseGradientReducer(params, COMM, density=1.0, **options)
        red.reduce()
        return [p.grad for p in params]
    hook = st.SparseHookState(COMM, "spardl", warmup_steps=0, density=1.0, **options)
    buf = torch.cat([p.grad.flatten() for p in params])  # one dtype, as DDP buckets are
    out = hook._bucket(FakeBucket(0, buf, params, True)).wait()
    return list(torch.split(out, [p.numel() for p in params]))


@pytest.mark.parametrize("kind", ["reducer", "hook"])
@pytest.mark.parametrize("dense_numel", [0, 4])
def test_parameters_of_no_elements_are_left_out(kind, dense_numel):
    """A parameter of no elements (nn.Linear(4, 0)) beside others: they are reduced, at the
    first sparse step (a dense allreducer of n = 0 failed there, on every rank)."""
    shapes = [((3, 4), torch.float32), ((0, 4), torch.float32), ((0,), torch.float32)]
    shapes += [((3,), torch.float32)]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in shapes]
    grads = _grads(shapes, seed=1)
    got = _reduce(kind, params, grads, dense_numel=dense_numel)
    for g, want in zip(got, _exact_mean(grads), strict=True):
        np.testing.assert_allclose(g.to(torch.float64).numpy().ravel(), want.ravel(), rtol=1e-6)


def test_float64_parameters_beside_float32_ones_keep_their_precision():
    """A float64 parameter beside a float32 one is reduced in float64: its low bits (which a
    float32 buffer dropped) and a finite value past float32's range (which became Inf there
    and raised NonFiniteError) come through."""
    shapes = [((5,), torch.float32), ((4,), torch.float64)]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in shapes]
    grads = _grads(shapes, seed=2)
    grads[1][0] = 1e40 * (RANK + 1)
    got = _reduce("reducer", params, grads)
    want = _exact_mean(grads)
    np.testing.assert_allclose(got[0].numpy(), want[0], rtol=1e-6)
    assert got[1].dtype == torch.float64
    np.testing.assert_allclose(got[1].numpy(), want[1], rtol=1e-15)


@pytest.mark.parametrize(
    ("saved", "loaded"), [(torch.float32, torch.float64), (torch.float64, None)]
)
def test_a_state_of_another_dtype_loads_by_parameter(saved, loaded):
    """A reducer state saved with the parameters in one dtype, loaded where one of them has
    another (the model cast since, or a float64 parameter beside float32 ones): each residual
    is converted into the new buffer and the next steps run on every rank (the state was taken
    whole, and the next step failed with "grad dtype changed")."""

    def reducer(dtype):
        torch.manual_seed(0)
        params = [("a", torch.nn.Parameter(torch.zeros(6)))]
        params.append(("b", torch.nn.Parameter(torch.zeros(4, dtype=dtype or torch.float32))))
        return params, st.SparseGradientReducer(params, COMM, density=0.25)

    def step(params, red, seed):
        for p, g in zip(
            [p for _, p in params],
            _grads([(p.shape, p.dtype) for _, p in params], seed),
            strict=True,
        ):
            p.grad = g * (seed + 1)
        return red.reduce()

    old_params, old = reducer(saved)
    for s in range(2):
        step(old_params, old, s)
    params, red = reducer(loaded)
    red.load_state_dict(old.state_dict())
    for k, res in old.residuals().items():
        np.testing.assert_allclose(red.residuals()[k], res, rtol=1e-6)
    out = step(params, red, 2)
    assert COMM.allgather(out.indices.tolist()) == [out.indices.tolist()] * P
    assert red.state_dict()["step"] == 3


def test_a_state_with_parameters_of_no_elements_loads_where_they_are_gone():
    """The residuals of parameters of no elements hold nothing: a state that has them loads
    into a reducer without them (it was refused as "residuals of parameters ... that are not
    reduced here")."""
    shapes = [((5,), torch.float32), ((0,), torch.float32)]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in shapes]
    red = st.SparseGradientReducer(list(zip("az", params, strict=True)), COMM, density=0.4)
    for p, g in zip(params, _grads(shapes, seed=3), strict=True):
        p.grad = g
    red.reduce()
    fewer = st.SparseGradientReducer([("a", params[0])], COMM, density=0.4)
    fewer.load_state_dict(red.state_dict())
    np.testing.assert_array_equal(fewer.residuals()["a"], red.residuals()["a"])


@pytest.mark.parametrize(
    "make, message",
    [
        # residuals() would have kept one of the two (by name)
        (lambda a, b: [("x", a), ("x", b)], "two parameters named 'x'"),
        # every trainable parameter of no elements: was "n must be >= 1, got 0"
        (lambda a, b: [a[:0].detach().requires_grad_()], "no parameter with elements"),
        (lambda a, b: [torch.nn.Parameter(torch.zeros(0, 3))], "no parameter with elements"),
    ],
    ids=["duplicate-name", "no-elements", "no-elements-2d"],
)
def test_duplicate_names_and_parameters_of_no_elements_are_refused_on_every_rank(make, message):
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=message):
        st.SparseGradientReducer(make(a, b), COMM, "topka")
