"""Runs tests/mpi_elastic (elastic resume: checkpoints written at P ranks, loaded at P') under
`mpiexec -n 4`: the tests resize inside that world by sub-communicators (P, P' in 1 … 4: growing,
shrinking, P' not dividing P), so one world size covers them. Every rank reports its passed and
skipped counts (tests/mpirun.py), so a skip inside cannot go unseen. The local checks below
(the folding rule, its argument checks, torch states as NumPy states) need no MPI."""

from __future__ import annotations

import numpy as np
import pytest
from mpirun import run_pytest_under_mpiexec


@pytest.mark.mpi
def test_elastic_resume_under_mpiexec():
    # Fails on any failure, a rank without a report, fewer passed than the collective tests
    # that need no torch, or (CI=true) a skip not in tests/skip_allowlist.py.
    run_pytest_under_mpiexec(4, ["tests/mpi_elastic"], min_passed=11)


def _folded_reference(P: int, Pn: int, q: int) -> list[int]:
    """The rule spelt out: the old rank itself at P' = P, else every old r with r mod P' = q."""
    return [q] if P == Pn else [r for r in range(P) if r % Pn == q]


def test_folded_ranks_is_the_modular_rule_and_a_partition():
    from spardl.elastic import folded_ranks

    for P in range(1, 8):
        for Pn in range(1, 8):
            got = [folded_ranks(P, Pn, q) for q in range(Pn)]
            assert got == [_folded_reference(P, Pn, q) for q in range(Pn)], (P, Pn)
            assert sorted(r for rs in got for r in rs) == list(range(P)), (P, Pn)
    assert folded_ranks(np.int64(4), np.int32(2), np.int64(1)) == [1, 3]  # NumPy integers too


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((4.0, 2, 0), TypeError, "world_size must be an integer, got float"),
        ((4, True, 0), TypeError, "new_world_size must be an integer, got bool"),
        ((4, 2, "0"), TypeError, "rank must be an integer, got str"),
        ((0, 2, 0), ValueError, r"world_size must be an integer in \[1, 2\*\*31 - 1\], got 0"),
        ((4, 0, 0), ValueError, r"new_world_size must be an integer in \[1, 2\*\*31 - 1\]"),
        # A list of 10**15 ranks: a MemoryError once, from a checkpoint's header.
        ((10**15, 1, 0), ValueError, r"world_size must be an integer in \[1, 2\*\*31 - 1\]"),
        ((4, 2, 2), ValueError, r"rank must be in \[0, 2\), got 2"),
        ((4, 2, -1), ValueError, r"rank must be in \[0, 2\), got -1"),
    ],
)
def test_folded_ranks_names_a_bad_argument(args, error, message):
    from spardl.elastic import folded_ranks

    with pytest.raises(error, match=message):
        folded_ranks(*args)


def test_torch_states_become_numpy_states_as_from_torch_state_makes_them():
    torch = pytest.importorskip("torch")
    from spardl.elastic import _numpy_state
    from spardl.torch import from_torch_state

    state = {
        "step": 3,
        "velocity": {"w": torch.arange(4, dtype=torch.float16)},
        "regions": [(torch.tensor([1, 2]), 5)],
        "residual": np.ones(2, np.float32),
    }
    got, want = _numpy_state(state), from_torch_state(state)
    assert type(got["regions"][0]) is tuple and got["step"] == 3
    for a, b in (
        (got["velocity"]["w"], want["velocity"]["w"]),
        (got["regions"][0][0], want["regions"][0][0]),
        (got["residual"], want["residual"]),
    ):
        assert type(a) is np.ndarray and a.dtype == b.dtype and np.array_equal(a, b)
    assert got["residual"] is state["residual"]  # NumPy arrays pass through, as there
