"""The overlap-mode hook state that the transaction tests drive with fake DDP buckets, on one
rank (tests/test_torch_overlap.py, ``MPI.COMM_SELF``) or on every rank (tests/mpi/)."""

from __future__ import annotations


def three_parameter_state(comm, warmup_steps: int = 0, **options):
    """Three parameters (8, 5 and 3 entries) and an overlap-mode ``SparseHookState`` over them
    on ``comm``: SparDL at ρ = 0.5, nonfinite="raise", ``warmup_steps`` dense iterations
    (none by default), ``options`` added to the hook state's. Returns (params, state)."""
    import torch

    import spardl.torch as st

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (8, 5, 3)]
    state = st.SparseHookState(
        comm,
        "spardl",
        warmup_steps,
        **{"density": 0.5, "nonfinite": "raise", **options},
        model=torch.nn.ParameterList(params),
        overlap=True,
    )
    return params, state
