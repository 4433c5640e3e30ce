"""spardl.torch: a parameter no rank used takes no part in the step (docs/getting-started.md).

A branch used at the first step only keeps a large residual. Before the fix it stayed in the
allreducer's input of every later step, won the k places of the top-k selection, and the used
layer received exactly zero gradient step after step, while the result held values on the
branch that were thrown away. The collective checks run in one ``mpiexec -n P`` job per world
size (tests/scripts/torch_unused_checks.py) that writes its measurements to JSON; each test below
asserts on one part of them, for the plain-loop reducer and the DDP hook in both modes.
"""

from __future__ import annotations

import json

import pytest
from mpirun import ROOT, run_mpi

torch = pytest.importorskip("torch")

SCRIPT = "tests/scripts/torch_unused_checks.py"
#: World size -> the algorithms run there.
ALGORITHMS = {2: ["topka", "spardl", "oktopk", "gaussiank"], 3: ["topka", "spardl"]}
KINDS = ["reducer", "hook", "overlap"]
STEPS = 12  # the script's; the branch is unused at every step after the first
CASES = [(P, a, k) for P, names in ALGORITHMS.items() for a in names for k in KINDS]


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """Every world size's measurements: {P: {algorithm: {kind: ...}}}."""
    out = {}
    for P, names in ALGORITHMS.items():
        path = tmp_path_factory.mktemp("unused") / f"checks-{P}.json"
        run_mpi(P, [SCRIPT, str(path), *names], timeout=300, env={"PYTHONPATH": str(ROOT)})
        out[P] = json.loads(path.read_text())
    return out


def _case(checks, P, algorithm, kind):
    return checks[P][algorithm][kind]


@pytest.mark.mpi
@pytest.mark.parametrize("P, algorithm, kind", CASES)
def test_a_residual_of_a_parameter_no_rank_used_leaves_the_k_places_to_the_used_ones(
    checks, P, algorithm, kind
):
    """The used layer receives a share of its input mass (it received exactly 0 with topka,
    oktopk and gaussiank), the same on every rank."""
    r = _case(checks, P, algorithm, kind)
    assert r["input"] > 0
    assert r["moved"] >= 0.1 * r["input"], (r["moved"], r["input"])
    assert r["same_everywhere"]


@pytest.mark.mpi
@pytest.mark.parametrize("P, algorithm, kind", CASES)
def test_the_result_holds_nothing_on_a_parameter_no_rank_used(checks, P, algorithm, kind):
    """The reducer's ``last_result`` and the hook's returned buckets are zero on the branch at
    every step after the first (they held the branch's selected residual, every algorithm)."""
    r = _case(checks, P, algorithm, kind)
    assert r["results_seen"] == STEPS - 1
    assert r["leaked"] == 0.0


@pytest.mark.mpi
@pytest.mark.parametrize("P, algorithm, kind", CASES)
def test_a_parameter_no_rank_used_keeps_its_residual_and_nothing_is_lost(
    checks, P, algorithm, kind
):
    """The branch's residual stays bit for bit as the first step left it, its ``.grad`` None,
    and Σ_r Σ_t g_r = P·Σ_t out_t + Σ_r E_r over every parameter."""
    r = _case(checks, P, algorithm, kind)
    assert r["branch_residual_nonzero"]  # there was mass to keep
    assert r["branch_residual_kept"]
    assert r["branch_grad_none"]
    assert r["conservation_error"] <= 1e-6 * max(1.0, r["scale"])
