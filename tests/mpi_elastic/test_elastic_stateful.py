"""Elastic resume (docs/reliability.md §4.1): a Hypothesis state machine that mixes valid steps,
rejected steps (a NaN gradient: NonFiniteError), checkpoints (gathered in memory or one file)
and resumes at another world size P → P' inside one mpiexec world (sub-communicators of the
first P ranks), and checks the mass accounting over the whole history.

The accounting, float64 vectors of length n on every rank: F = Σ over applied steps of Σ_r g_r
(what was fed), O = Σ over applied steps of s_t·out_t (s_t = P_t for op="mean", 1 for "sum";
P_t the world size of that step) and E = Σ_r E_r now. A conserving allreducer keeps
F = O + E to the rounding of its dtypes, through rejected steps (not applied: nothing
changes), checkpoints and resumes (a resume goes back to the checkpoint's F and O). A resume at
P' ≥ P keeps E bit for bit, at P' = P the whole state bit for bit; shrinking rounds E once.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)
from mpi4py import MPI
from mpiutil import assert_identical_everywhere

import spardl
from spardl import elastic

WORLD = MPI.COMM_WORLD
W = WORLD.Get_size()
ME = WORLD.Get_rank()
#: Relative rounding per unit of mass moved (see `conserves` in tests/mpi/test_stateful.py).
TOL = {np.float16: 2e-3, np.float32: 2e-6, np.float64: 1e-13}
EPS = {np.float16: 2.0**-24, np.float32: 2.0**-24, np.float64: 2.0**-53}  # residual dtype


def _tmpdir() -> str:
    """One directory for the whole job (made by rank 0; every rank sees the same path)."""
    path = tempfile.mkdtemp(prefix="spardl-elastic-") if ME == 0 else None
    return WORLD.bcast(path, root=0)


DIR = _tmpdir()


@pytest.fixture(scope="session", autouse=True)
def _remove_tmpdir():
    yield
    WORLD.Barrier()  # every rank is done with the files
    if ME == 0:
        shutil.rmtree(DIR, ignore_errors=True)


def _free(ar) -> None:
    for name in ("_team", "_cross", "comm"):
        c = getattr(ar, name, None)
        if c is not None:
            c.free()


def same_state(a, b, path="state") -> None:
    """Two state_dict()s are equal: every key, every array bit for bit, NaN equal to NaN."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {set(a) ^ set(b)}"
        for k in a:
            same_state(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            same_state(u, v, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), f"{path} differs"
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), f"{path}: nan and {b!r}"
    else:
        assert a == b, f"{path}: {a!r} and {b!r}"


def world_sum(v) -> np.ndarray:
    """Σ over the world's ranks of a float64 vector (inactive ranks give zeros)."""
    v = np.ascontiguousarray(v, dtype=np.float64)
    out = np.empty_like(v)
    WORLD.Allreduce(v, out, op=MPI.SUM)
    return out


class ElasticSteps(RuleBasedStateMachine):
    """The first P ranks of the world run one allreducer; the others wait at the world's
    collectives (the accounting), so every rank runs every rule."""

    algorithm = "spardl"  # each TestCase below fixes one

    @initialize(
        n=st.integers(1, 60),
        density=st.sampled_from([0.02, 0.1, 0.5, 1.0]),
        dtype=st.sampled_from([np.float16, np.float32, np.float64]),
        op=st.sampled_from(["mean", "sum"]),
        P=st.integers(1, W),
        teams=st.sampled_from(["one", "two", "all"]),
        selector=st.sampled_from(["exact", "threshold"]),
    )
    def setup(self, n, density, dtype, op, P, teams, selector):
        self.n, self.dtype, self.op = n, dtype, op
        self.density, self.teams, self.selector = density, teams, selector
        self.ar = self.sub = None
        self._build(P)
        self.fed = np.zeros(n)  # F
        self.out = np.zeros(n)  # O
        self.mass = 0.0  # Σ over steps of max_i Σ_r |X_r,i|: what the rounding is relative to
        self.ckpt = None
        self.files = 0
        self.checkpoint(to_file=P % 2 == 1)  # a state before any step (no residual yet)

    def _options(self, P: int) -> dict:
        opts = {"density": self.density, "op": self.op}
        if self.algorithm == "spardl":
            d = {"one": 1, "two": 2 if P % 2 == 0 else 1, "all": P}[self.teams]
            opts.update(teams=d, selector=self.selector)
            if self.selector == "threshold":
                opts.update(threshold_interval=2)
        elif self.algorithm == "oktopk":
            opts.update(selector=self.selector, threshold_interval=2, region_interval=3)
        return opts

    def _build(self, P: int) -> None:
        if self.ar is not None:
            _free(self.ar)
        if self.sub is not None and self.sub != MPI.COMM_NULL:
            self.sub.Free()
        self.P = P
        self.sub = WORLD.Split(0 if ME < P else MPI.UNDEFINED, ME)
        self.active = self.sub != MPI.COMM_NULL
        self.ar = None
        if self.active:
            self.ar = spardl.make(self.algorithm, self.sub, self.n, **self._options(P))
        # World rank 0 is always in the world of the first P ranks.
        self.conserves, self.rounding = WORLD.bcast(
            (self.ar.conserves, self.ar.rounding_feedback) if ME == 0 else None, root=0
        )

    def teardown(self):
        if getattr(self, "ar", None) is not None:
            _free(self.ar)
        if getattr(self, "sub", None) is not None and self.sub != MPI.COMM_NULL:
            self.sub.Free()

    def _grad(self, seed):
        rng = np.random.default_rng([seed, ME])
        scale = 1.0 if self.dtype == np.float16 else 10.0
        g = np.clip(rng.standard_t(3, self.n), -100, 100) * scale
        g[rng.random(self.n) < 0.3] = 0
        return g.astype(self.dtype)

    def _residual_sum(self) -> np.ndarray:
        mine = np.zeros(self.n)
        if self.active:
            mine = np.asarray(self.ar.residual, np.float64)
        return world_sum(mine)

    # -- rules ------------------------------------------------------------------------------
    # One rule whose argument says what to do: Hypothesis's swarm testing disables a random
    # subset of a machine's rules in each example, which at a few examples per algorithm would
    # leave many without a resume (or without steps before one). The first action is the
    # simplest draw: steps are the most common, so checkpoints hold residuals.
    @rule(
        action=st.sampled_from(
            ["step", "step", "rejected", "checkpoint", "resume now", "resume now", "resume last"]
        ),
        seed=st.integers(0, 2**16),
        P=st.integers(1, W),
        to_file=st.booleans(),
    )
    def act(self, action, seed, P, to_file):
        if action == "step":
            self.step(seed)
        elif action == "rejected":
            self.rejected(seed)
        elif action == "checkpoint":
            self.checkpoint(to_file)
        else:
            self.resume(P, action == "resume now", to_file)

    def step(self, seed):
        """A valid step on the P ranks; F, O and the rounding scale follow."""
        n = self.n
        g, x, contribution = np.zeros(n, self.dtype), np.zeros(n), np.zeros(n)
        if self.active:
            g = self._grad(seed)
            x = np.abs(g.astype(np.float64) + np.asarray(self.ar.residual, np.float64))
            res = self.ar(g)
            assert_identical_everywhere(self.sub, res)
            assert res.values.dtype == self.dtype
            if ME == 0:  # the output is the same on every rank: count it once
                scale = self.P if self.op == "mean" else 1
                contribution = scale * res.to_dense().astype(np.float64)
        sums = world_sum(np.concatenate([g.astype(np.float64), contribution, x]))
        self.fed += sums[:n]
        self.out += sums[n : 2 * n]
        self.mass += float(np.max(sums[2 * n :], initial=0.0))

    def rejected(self, seed):
        """A NaN on one rank: NonFiniteError on every rank, the state as it was, nothing
        counted."""
        if not self.active:
            return
        g = self._grad(seed)
        if self.sub.Get_rank() == 0:
            g[seed % self.n] = np.nan
        before = self.ar.state_dict()
        with pytest.raises(spardl.NonFiniteError):
            self.ar(g)
        same_state(before, self.ar.state_dict())

    def checkpoint(self, to_file):
        """Gather every rank's state (on world rank 0) or save it to a file; remember F, O,
        E and each rank's own state with it."""
        payload = None
        if to_file:
            self.files += 1
            payload = os.path.join(DIR, f"ck{self.files}.zip")
        own = None
        if self.active:
            own = self.ar.state_dict()
            if to_file:
                elastic.save_checkpoint(self.ar, payload)
            else:
                payload = elastic.gather_state(self.ar, root=0)  # on world rank 0
        self.ckpt = {
            "payload": payload,
            "file": to_file,
            "P": self.P,
            "own": own,
            "fed": self.fed.copy(),
            "out": self.out.copy(),
            "mass": self.mass,
            "step": WORLD.bcast(self.ar.step if ME == 0 else None, root=0),
            "E": self._residual_sum(),
            "E_abs": world_sum(np.abs(np.asarray(own["residual"], np.float64)))
            if own is not None and own["residual"] is not None
            else world_sum(np.zeros(self.n)),
        }

    def resume(self, P, now, to_file):
        """Resume at P from a checkpoint taken ``now`` or from the last one (the steps since
        are then discarded)."""
        if now:
            self.checkpoint(to_file)
        ck = self.ckpt
        self._build(P)
        if self.active:
            if ck["file"]:
                elastic.load_checkpoint(self.ar, ck["payload"])
            else:
                elastic.load_gathered_state(self.ar, ck["payload"] if ME == 0 else None)
            state = self.ar.state_dict()
            assert state["step"] == ck["step"] and state["world_size"] == P
            if P == ck["P"]:
                same_state(ck["own"], state)  # the same world: bit for bit
        self.fed, self.out, self.mass = ck["fed"].copy(), ck["out"].copy(), ck["mass"]
        E = self._residual_sum()
        if P >= ck["P"]:
            np.testing.assert_array_equal(E, ck["E"])  # nothing added: bit for bit
        else:
            eps = EPS[self.dtype]
            assert np.all(np.abs(E - ck["E"]) <= 2 * eps * ck["E_abs"]), "fold rounding"
            self.mass += float(np.max(ck["E_abs"], initial=0.0))

    # -- the invariant ----------------------------------------------------------------------
    @invariant()
    def mass_is_accounted_for(self):
        if not hasattr(self, "ar") or not self.conserves:
            return
        E = self._residual_sum()
        tol = TOL[self.dtype]
        if self.dtype == np.float16 and self.rounding:
            tol = 1e-6  # remainders kept: float32 rounding only
        err = float(np.max(np.abs(self.fed - self.out - E), initial=0.0))
        assert err <= tol * self.mass + 1e-300, (err, self.mass)


SETTINGS = settings(
    max_examples=int(os.environ.get("SPARDL_ELASTIC_EXAMPLES", "4")),
    stateful_step_count=10,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


def _machine(algorithm: str):
    machine = type(f"ElasticSteps_{algorithm}", (ElasticSteps,), {"algorithm": algorithm})
    case = machine.TestCase
    case.settings = SETTINGS
    return case


# One machine per algorithm (every one of spardl.ALGORITHMS), so that every algorithm meets
# every rule whatever Hypothesis draws.
for _name in sorted(spardl.ALGORITHMS):
    globals()[f"TestElastic_{_name}"] = _machine(_name)


# -- what a load refuses ---------------------------------------------------------------------------
def _world_of(P: int):
    sub = WORLD.Split(0 if ME < P else MPI.UNDEFINED, ME)
    return None if sub == MPI.COMM_NULL else sub


def _stepped(sub):
    """A SparDL allreducer on ``sub`` after one step, and its state then."""
    ar = spardl.make("spardl", sub, 24, density=0.2)
    ar(np.ones(24, np.float32))
    return ar, ar.state_dict()


def _saved(n=24):
    """An SparDL allreducer of the whole world after two steps: its gathered state (on rank 0)
    and its checkpoint file."""
    ar = spardl.make("spardl", WORLD, n, density=0.2)
    for s in range(2):
        ar(np.random.default_rng([s, ME]).standard_normal(n).astype(np.float32))
    gathered = elastic.gather_state(ar, root=0)
    path = os.path.join(DIR, "refused.zip")
    elastic.save_checkpoint(ar, path)
    _free(ar)
    return gathered, path


@pytest.mark.parametrize(
    ("algorithm", "n", "message"),
    [("topka", 24, "algorithm='spardl'"), ("spardl", 25, "n=24")],
)
def test_another_algorithm_or_n_is_refused_on_every_rank(algorithm, n, message):
    gathered, path = _saved()
    P = max(1, W - 1)  # at another world size, where the residuals would be folded
    sub = _world_of(P)
    if sub is not None:
        other = spardl.make(algorithm, sub, n, density=0.2)
        other(np.ones(n, np.float32))
        before = other.state_dict()
        with pytest.raises(ValueError, match=message):
            elastic.load_gathered_state(other, gathered if ME == 0 else None)
        same_state(before, other.state_dict())
        with pytest.raises(ValueError, match=message):
            elastic.load_checkpoint(other, path)
        same_state(before, other.state_dict())
        _free(other)
        sub.Free()
    WORLD.Barrier()


def test_a_bad_file_or_a_missing_state_is_refused_on_every_rank():
    gathered, path = _saved()
    bad = os.path.join(DIR, "not-a-checkpoint.zip")
    if ME == 0:
        with open(bad, "w") as f:
            f.write("not a zip")
    states = WORLD.bcast(gathered, root=0)["states"]
    P = max(1, W - 1)
    sub = _world_of(P)
    if sub is not None:
        ar, before = _stepped(sub)
        with pytest.raises(ValueError, match="cannot read the checkpoint"):
            elastic.load_checkpoint(ar, bad)
        same_state(before, ar.state_dict())
        # One rank lacks a state it needs: every rank raises, nothing changes anywhere.
        mine = {r: states[r] for r in elastic.folded_ranks(W, P, sub.Get_rank())} or {0: states[0]}
        if sub.Get_rank() == 0:
            mine.pop(0)
        with pytest.raises(ValueError, match="missing|rank 0 rejected"):
            elastic.load_rank_states(ar, mine, W)
        same_state(before, ar.state_dict())
        _free(ar)
        sub.Free()
    WORLD.Barrier()


def test_teams_that_do_not_divide_the_new_world_are_named():
    P = 3 if W >= 3 else 1
    sub = _world_of(P)
    if sub is not None:
        with pytest.raises(ValueError, match="teams"):
            spardl.make("spardl", sub, 24, teams=2)
        sub.Free()
    WORLD.Barrier()


def test_a_save_or_gather_on_one_rank_while_the_others_step_fails_everywhere():
    """save_checkpoint and gather_state start with a collective check: a rank that is stepping
    meanwhile (it once left the root waiting for its state) and a root that is not a rank
    raise on every rank; the allreducer keeps working."""
    ar = spardl.make("spardl", WORLD, 24, density=0.2, teams=W)
    g = np.arange(24, dtype=np.float32) * (ME + 1)
    ar(g)
    path = os.path.join(DIR, "mismatched.zip")
    for save in (
        lambda: elastic.save_checkpoint(ar, path),
        lambda: elastic.gather_state(ar),
        lambda: elastic.gather_state(ar, root=None),
    ):
        if W > 1:
            with pytest.raises(ValueError, match="ranks disagree"):
                if ME == W - 1:
                    ar(g)
                else:
                    save()
        with pytest.raises(ValueError, match=r"root must be in \[0,"):
            elastic.save_checkpoint(ar, path, root=W if ME == 0 else 0)
        with pytest.raises(TypeError, match="root must be an integer"):
            elastic.save_checkpoint(ar, path, root=None)  # gather_state's "every rank" only
        # One file, loaded by every rank from the same path: a path per rank is refused.
        if W > 1:
            with pytest.raises(ValueError, match="ranks disagree on path"):
                elastic.save_checkpoint(ar, f"{path}.{ME}")
        with pytest.raises(TypeError, match="path must be a str or os.PathLike, got int"):
            elastic.save_checkpoint(ar, 7 if ME == 0 else path)
        assert ar.step == 1
    assert_identical_everywhere(WORLD, ar(g))
    assert not any(f.startswith("mismatched.zip") for f in os.listdir(DIR))
    _free(ar)
    WORLD.Barrier()


def _damaged(path: str, name: str, edit) -> str:
    """A copy of the checkpoint ``path`` with entry ``name`` replaced by ``edit(its bytes)``
    (written by rank 0; every rank gets its path)."""
    import zipfile

    out = os.path.join(DIR, f"damaged-{name.replace('/', '-')}-{len(os.listdir(DIR))}.zip")
    out = WORLD.bcast(out, root=0)
    if ME == 0:
        with zipfile.ZipFile(path) as zin, zipfile.ZipFile(out, "w") as zout:
            for item in zin.namelist():
                data = zin.read(item)
                zout.writestr(item, edit(data) if item == name else data)
    WORLD.Barrier()
    return out


def _with(key, value):
    def edit(data: bytes) -> bytes:
        import json

        doc = json.loads(data)
        doc[key] = value
        return json.dumps(doc).encode()

    return edit


def test_a_damaged_entry_is_refused_on_every_rank():
    """An entry only one rank reads (its own state) that raises something other than the usual
    read errors (a TypeError from its JSON, a RecursionError, a huge world size) once made that
    rank raise alone while the others waited for it: every rank must raise a ValueError, with
    its state unchanged, at the same world size and at another."""
    _, path = _saved()
    last = f"rank{W - 1}/state.json"
    files = [
        _damaged(path, last, _with("extra", {"__tuple__": 5})),
        _damaged(path, last, _with("extra", {"__items__": [[{"a": 1}, 2]]})),
        _damaged(path, last, lambda _: b"[" * 100_000 + b"]" * 100_000),
        _damaged(path, "header.json", _with("world_size", 10**15)),
    ]
    for P in dict.fromkeys((W, max(1, W - 1))):
        sub = _world_of(P)
        if sub is not None:
            ar, before = _stepped(sub)
            for bad in files:  # each is read by some rank at either size
                with pytest.raises(ValueError, match="cannot read the checkpoint"):
                    elastic.load_checkpoint(ar, bad)
                same_state(before, ar.state_dict())
            _free(ar)
            sub.Free()
        WORLD.Barrier()


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"step": -5, "calls": -5}, ValueError, "state step must be in"),
        ({"step": "7"}, TypeError, "state step must be an integer"),
        ({"step": 2.9}, TypeError, "state step must be an integer"),
        ({"density": "0.5"}, TypeError, "state density"),
        ({"residual": "nan"}, ValueError, "holds NaN or Inf"),
        ({"residual": "float64"}, TypeError, r"residual of old rank \d+ has dtype float64"),
    ],
)
def test_a_folded_load_checks_the_states_as_a_same_size_load_does(change, error, message):
    """Loaded at another world size, states once went in unchecked (a negative step, a string
    density, a NaN residual into nonfinite="raise", which then failed every later step, a
    float64 residual cast silently): the same errors as load_state_dict, on every rank."""
    gathered, _ = _saved()
    states = dict(enumerate(WORLD.bcast(gathered, root=0)["states"]))
    P = max(1, W - 1)
    sub = _world_of(P) if P != W else None
    if sub is not None:
        ar, before = _stepped(sub)
        bad = {}
        for r, st in states.items():
            st = {**st, **change}
            if change.get("residual") == "nan":
                st["residual"] = np.full(24, np.nan, np.float32)
            elif change.get("residual") == "float64":
                st["residual"] = np.asarray(states[r]["residual"], np.float64)
            bad[r] = st
        with pytest.raises(error, match=message):
            elastic.load_rank_states(ar, bad, W)
        same_state(before, ar.state_dict())
        _free(ar)
        sub.Free()
    WORLD.Barrier()


def test_a_path_in_bytes_is_saved_and_one_naming_no_file_is_refused_everywhere():
    """A bytes path (os.PathLike's other form) once failed on the root alone, after the check
    every rank passed, and an empty one likewise: the others waited for it."""
    ar = spardl.make("spardl", WORLD, 24, density=0.2)
    ar(np.arange(24, dtype=np.float32) * (ME + 1))
    path = os.path.join(DIR, "bytes-path.zip")
    elastic.save_checkpoint(ar, os.fsencode(path))
    before = ar.state_dict()
    elastic.load_checkpoint(ar, path)
    same_state(before, ar.state_dict())
    for bad in ("", ".", b""):
        with pytest.raises(ValueError, match="path must name a file"):
            elastic.save_checkpoint(ar, bad)
    assert ar.step == 1
    _free(ar)
    WORLD.Barrier()


def test_a_folded_load_into_another_allreducer_of_a_shared_comm_is_refused_everywhere():
    """Two allreducers of one algorithm sharing a spardl Comm: a rank that loads the folded
    states into the second where the others load the first once went through, each rank
    holding a different allreducer's state. The check names which allreducer it is, every
    rank raises and keeps its state; in the same order the load goes through."""
    gathered, _ = _saved()
    states = dict(enumerate(WORLD.bcast(gathered, root=0)["states"]))
    P = max(1, W - 1)
    sub = _world_of(P)
    if sub is not None:
        shared = spardl.Comm(sub)
        a = spardl.make("spardl", shared, 24, density=0.2)
        b = spardl.make("spardl", shared, 24, density=0.2)
        before = [a.state_dict(), b.state_dict()]
        if P > 1:
            with pytest.raises(ValueError, match="in the order built on its communicator"):
                elastic.load_rank_states(a if sub.Get_rank() == 0 else b, states, W)
            same_state(before[0], a.state_dict())
            same_state(before[1], b.state_dict())
        elastic.load_rank_states(a, states, W)
        assert a.step == 2 and b.step == 0
        a.close()
        b.close()
        shared.free()
        sub.Free()
    WORLD.Barrier()
