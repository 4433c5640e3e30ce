"""spardl.torch.init_process_group_from_mpi: the rendezvous port (docs/getting-started.md).

Rank 0 used to pick a free port by binding and closing a socket, and torch bound it again later:
between the two another process could take it (CI saw EADDRINUSE while other jobs ran). Rank 0's
store now listens from the moment the port is picked; a port it cannot listen on is an error on
every rank, not on rank 0 alone while the others wait.
"""

from __future__ import annotations

import json
import socket

import pytest
from mpirun import ROOT, run_mpi

pytest.importorskip("torch")

SCRIPT = "tests/scripts/torch_rendezvous.py"


def _lines(P, env):
    proc = run_mpi(P, [SCRIPT], timeout=180, env={"PYTHONPATH": str(ROOT), **env})
    lines = [json.loads(s) for s in proc.stdout.splitlines() if s.startswith("{")]
    assert sorted(r["rank"] for r in lines) == list(range(P)), proc.stdout + proc.stderr
    return lines


@pytest.mark.mpi
@pytest.mark.parametrize("P", [1, 3])
def test_the_group_forms_on_the_port_rank_0_listens_on(P):
    lines = _lines(P, {"MASTER_PORT": ""})
    assert all("error" not in r for r in lines), lines
    assert len({r["port"] for r in lines}) == 1 and lines[0]["port"] > 0
    assert all(r["sum"] == P * (P + 1) / 2 for r in lines)


@pytest.mark.mpi
def test_a_port_rank_0_cannot_listen_on_is_an_error_on_every_rank():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        lines = _lines(2, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    for r in lines:
        assert "error" in r, lines
        assert "could not open the rendezvous store" in r["error"]
        assert f"127.0.0.1:{port}" in r["error"]


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"TEST_BACKEND": "bogus"}, "backend must be one of gloo, nccl, mpi or None"),
        ({"TEST_BACKEND_1": "bogus"}, "rank 1"),
        ({"TEST_BACKEND_1": "gloo"}, "ranks disagree on backend"),
    ],
)
def test_a_backend_bad_or_different_on_some_rank_is_an_error_on_every_rank(env, says):
    """An unknown backend was torch's AssertionError from deep inside, on some ranks, and the
    others waited in the rendezvous (5 runs of 6 hung); one rank's backend differing hung the
    others every time."""
    lines = _lines(3, {"MASTER_PORT": "", **env})
    for r in lines:
        assert "error" in r, lines
        assert says in r["error"] or "backend must be one of" in r["error"], lines
    assert any(says in r["error"] for r in lines), lines
