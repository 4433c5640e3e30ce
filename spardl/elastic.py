"""Elastic resume: a checkpoint written at P ranks resumes at any P' ≥ 1.

An allreducer's state is per rank (each rank's residual E_r, its selectors' thresholds, SparDL's
budget h, Ok-Topk's regions), so a checkpoint made of ``state_dict()`` files loads only at the
world size that wrote it. This module gathers every rank's state into one object or one file
(collective) and loads it at any world size (collective, all or nothing on every rank):

* :func:`gather_state` / :func:`load_gathered_state`: in memory, on a root rank;
* :func:`save_checkpoint` / :func:`load_checkpoint`: one file (a zip of JSON and ``.npy``
  entries, no pickle), written by the root as the ranks' states arrive and read by every rank
  (a path every rank can read: a shared filesystem);
* :func:`load_rank_states`: the primitive both loads use, for states the caller has read
  itself (``spardl train --resume`` reads its per-rank ``torch.save`` files).

Each works on a :class:`spardl.Allreducer`, a :class:`spardl.torch.SparseGradientReducer` or a
:class:`spardl.torch.SparseHookState`.

What a load at P' does (docs/design.md §11, docs/reliability.md §4.1):

* P' = P: rank r loads rank r's state as it was saved, with ``load_state_dict``: the next steps
  continue bit for bit.
* P' ≠ P: rank q of the new world takes the residuals of the old ranks r ≡ q (mod P')
  (:func:`folded_ranks`) and holds their sum. Growing (P' > P), every old residual stays as it
  was on the rank of the same number and the new ranks start at zero: no arithmetic, the sum
  over ranks is preserved bit for bit. Shrinking, each new rank sums ⌈P/P'⌉ or ⌊P/P'⌋ residuals
  (a compensated float64 sum in old-rank order, rounded once to the residual's dtype), so the
  sum over ranks is preserved to one rounding of that dtype per coordinate. The
  momentum-correction velocities of the torch classes are folded the same way.
  Everything that depends on P is derived afresh for P': SparDL's teams, blocks, block budgets
  and h (h restarts from ⌊ρC/d⌋), Ok-Topk's regions (recomputed at the next step), TopkDSA's
  regions; every threshold is re-estimated (the selectors' and Ok-Topk's global threshold are
  computed exactly at the next step), since a threshold of the old world's residuals and sums
  says nothing about the new one's. The step and call counters and the density carry over.

Why fold and not another split: every algorithm's conservation argument (docs/design.md §4) is
per step and holds for any distribution of E over the ranks, so the next steps conserve
Σ_r X_r = P'·out + Σ_r E_r whatever the split; what a split can change is the rounding of the
sum it starts from and the steps that follow. Folding adds nothing when growing (the same P
vectors, the state bit for bit at P' = P) and adds the fewest vectors per coordinate when
shrinking; giving the whole sum to one rank (or splitting it by blocks of
``uniform_bounds(n, P')``) would round every coordinate held by two or more old ranks, at every
P', and put the old world's unsent mass in one rank's top-k.

Units: the sum of the residuals is kept in *sum* units, those of the conservation invariant
(Σ_r g_r over every step = Σ_t P_t·out_t + Σ_r E_r with ``op="mean"``). With ``op="mean"`` the
unsent mass then reaches the output divided by P' instead of P: with the linear learning-rate
scaling rule (lr ∝ P) the parameter update it makes is the same as without the resize.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np

from ._checks import MAX_WORLD_SIZE, check_density, check_int, malformed
from .algorithms.base import Allreducer, collective_check
from .comm import Comm, name_hash
from .dtypes import work_dtype

__all__ = [
    "FORMAT",
    "folded_ranks",
    "gather_state",
    "load_gathered_state",
    "load_rank_states",
    "save_checkpoint",
    "load_checkpoint",
]

#: The ``format`` of a gathered state and of a checkpoint file's header.
FORMAT = "spardl-elastic"
VERSION = 1
#: Traffic counters of ``stats``: a rank that did not exist in the old world starts them at 0.
_TRAFFIC = ("messages", "bytes_sent", "bytes_received", "control_messages")
_TAG = 0x5D1  # save_checkpoint's point-to-point messages (on the control communicator)


def folded_ranks(world_size: int, new_world_size: int, rank: int) -> list[int]:
    """The old ranks whose states rank ``rank`` of the new world loads.

    Parameters
    ----------
    world_size : int
        P, the world size the states were saved at, ≥ 1.
    new_world_size : int
        P', the world size they are loaded at, ≥ 1.
    rank : int
        A rank of the new world, in [0, P').

    Returns
    -------
    list of int
        ``[rank]`` when P' = P (each rank its own state), else the old ranks r ≡ rank (mod P')
        in ascending order: empty for a new rank (rank ≥ P), one rank when growing, ⌈P/P'⌉ or
        ⌊P/P'⌋ when shrinking.

    Raises
    ------
    TypeError
        If an argument is not an integer (a bool is not one).
    ValueError
        If a size is outside [1, 2**31 − 1] (MPI's ranks are C ints) or ``rank`` is outside
        [0, P').

    Notes
    -----
    This project's rule (docs/design.md §11): growing keeps every old residual where it was,
    shrinking sums the fewest residuals per new rank.
    """
    for name, v in (("world_size", world_size), ("new_world_size", new_world_size)):
        if not 1 <= check_int(name, v) <= MAX_WORLD_SIZE:
            raise ValueError(f"{name} must be an integer in [1, 2**31 - 1], got {v!r}")
    if not 0 <= check_int("rank", rank) < new_world_size:
        raise ValueError(f"rank must be in [0, {new_world_size}), got {rank}")
    return list(range(int(rank), int(world_size), int(new_world_size)))


# -- what kind of object ------------------------------------------------------------------------
def _kind(obj) -> str:
    if isinstance(obj, Allreducer):
        return "allreducer"
    if hasattr(obj, "_core") and hasattr(obj, "load_state_dict"):
        return "torch"
    raise TypeError(
        "expected a spardl Allreducer, SparseGradientReducer or SparseHookState, got "
        f"{type(obj).__name__}"
    )


def _open_kind(obj) -> str:
    """:func:`_kind`, and the ValueError of a closed object (whose communicators are freed)
    before any message."""
    kind = _kind(obj)
    obj._check_open()
    return kind


def _control(obj) -> Comm:
    """The communicator whose ranks load together (its messages are not the algorithm's)."""
    return obj.comm if isinstance(obj, Allreducer) else obj._core.ctl


def _algorithm(obj) -> str:
    return obj.name if isinstance(obj, Allreducer) else obj._core.algorithm


def _agree(obj, err, fields, described) -> None:
    """:func:`collective_check` over :func:`_control` (``obj``'s own check for an
    allreducer, which also compares which allreducer of its communicator it is)."""
    if isinstance(obj, Allreducer):
        obj.collective_check(err, fields, described)
    else:
        collective_check(obj._core.ctl, err, fields, described)


def _is_tensor(obj) -> bool:
    """A torch tensor, told by its methods (this module does not import torch)."""
    return hasattr(obj, "detach") and hasattr(obj, "cpu") and hasattr(obj, "numpy")


def _numpy_state(obj):
    """A state with its torch tensors as NumPy arrays (host copies), recursively through dicts,
    lists and tuples; everything else as it is (``spardl.torch.from_torch_state``'s result)."""
    if _is_tensor(obj):
        return obj.detach().cpu().numpy().copy()
    if isinstance(obj, dict):
        return {k: _numpy_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_numpy_state(v) for v in obj)
    return obj


def _local_state(obj) -> dict:
    """This rank's state with NumPy arrays only (torch tensors converted)."""
    state = obj.state_dict()
    return state if isinstance(obj, Allreducer) else _numpy_state(state)


def _header(obj, world_size: int) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": _kind(obj),
        "algorithm": _algorithm(obj),
        "n": int(obj.n) if isinstance(obj, Allreducer) else int(obj._core.n),
        "world_size": int(world_size),
    }


def _check_header(obj, header) -> int:
    """The old world size of a gathered state or checkpoint ``header``; ValueError if it is not
    one or holds another kind of state, algorithm or (for an allreducer) n."""
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"not a spardl gathered state or elastic checkpoint (format {FORMAT!r})")
    if header.get("version") != VERSION:
        raise ValueError(f"elastic state version {header.get('version')!r}, expected {VERSION}")
    kind = _kind(obj)
    checks = [("kind", kind), ("algorithm", _algorithm(obj))]
    if kind == "allreducer":
        checks.append(("n", obj.n))
    for key, mine in checks:
        if header.get(key) != mine:
            raise ValueError(
                f"the checkpoint was saved with {key}={header.get(key)!r}, this one has {mine!r}"
            )
    P = header.get("world_size")
    try:  # the file's content, not an argument: a malformed file is a ValueError
        ok = check_int("world_size", P, numpy=False) >= 1
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"the checkpoint's world_size must be an integer >= 1, got {P!r}")
    return P


# -- folding ------------------------------------------------------------------------------------
def _fold_sum(arrays, dtype) -> np.ndarray:
    """Σ arrays, in order, rounded once to ``dtype``: one array is returned as it is (a copy);
    more are summed in float64 with Neumaier's compensation, so the result is the exact sum
    rounded to ``dtype`` up to a float64 rounding of the compensated sum."""
    arrays = [np.asarray(a) for a in arrays]
    if len(arrays) == 1:
        return np.array(arrays[0], dtype=dtype, copy=True)
    s = arrays[0].astype(np.float64)
    c = np.zeros_like(s)
    with np.errstate(invalid="ignore", over="ignore"):
        for a in arrays[1:]:
            t = a.astype(np.float64)
            u = s + t
            big = np.abs(s) >= np.abs(t)
            c += np.where(big, (s - u) + t, (t - u) + s)
            s = u
        return (s + c).astype(dtype)


_AR_KEYS = ("algorithm", "n", "world_size", "rank", "step", "calls", "dtype", "residual")


def _check_ar_states(
    states,
    template,
    world_size,
    keys=_AR_KEYS,
    agree=("algorithm", "n", "step", "calls", "dtype", "density"),
) -> None:
    """Each of ``states`` [(old rank, state)] a dict holding ``keys``, saved at ``world_size``
    (and by that rank, where the states record theirs), agreeing with ``template`` on
    ``agree``; ValueError or TypeError naming the old rank otherwise."""
    for r, st in states:
        if not isinstance(st, dict):
            raise TypeError(f"the state of old rank {r} must be a dict, got {type(st).__name__}")
        missing = [k for k in keys if k not in st]
        if missing:
            raise ValueError(f"the state of old rank {r} is missing key(s) {missing}")
        if st["world_size"] != world_size or st.get("rank", r) != r:
            by = f"rank {st['rank']!r} of " if "rank" in st else "world size "
            raise ValueError(
                f"the state given as old rank {r} of {world_size} was saved by {by}"
                f"{st['world_size']!r}"
            )
        for key in agree:
            if st.get(key) != template.get(key):
                raise ValueError(
                    f"the old ranks' states disagree on {key}: {template.get(key)!r} and "
                    f"{st.get(key)!r} (rank {r}); not one checkpoint?"
                )


def _fold_allreducer(states, template, world_size, new_world_size, rank) -> dict:
    """The state rank ``rank`` of the new world loads (:func:`_load_folded`): the template's
    counters, density and dtype, the sum of ``states``' residuals, no algorithm state."""
    if not isinstance(template, dict):
        raise TypeError(f"a state must be a dict, got {type(template).__name__}")
    _check_ar_states([*states, (template["rank"], template)], template, world_size)
    out = {k: template[k] for k in ("algorithm", "n", "step", "calls", "dtype")}
    out["density"] = template.get("density")
    out.update(world_size=new_world_size, rank=rank, extra=None, resized_from=world_size)
    if template["residual"] is None or template["dtype"] is None:
        out["residual"] = None
        return out
    work = work_dtype(np.dtype(template["dtype"]))
    n = int(template["n"])
    residuals = []
    for r, st in states:
        res = st["residual"]
        if getattr(res, "shape", None) != (n,):
            raise ValueError(
                f"the residual of old rank {r} has shape {getattr(res, 'shape', None)}, "
                f"expected ({n},)"
            )
        got = np.asarray(res).dtype
        if got != work:  # as load_state_dict: never converted silently
            raise TypeError(
                f"the residual of old rank {r} has dtype {got}; a "
                f"{template['dtype']} gradient's residual is {work}"
            )
        residuals.append(res)
    out["residual"] = _fold_sum(residuals, work) if residuals else np.zeros(n, work)
    return out


def _fold_keyed(states, template, world_size, new_world_size, n) -> dict:
    """The ``allreducer`` entry of an overlap-mode hook state (the residuals of its ``n``
    elements by parameter key, ``keys`` and ``numels`` checked equal on every old rank by
    :func:`_fold_torch`) for a rank of the new world: the sum of ``states``' residuals, the
    template's step, marked ``resized_from`` (each bucket's allreducer derives everything else
    afresh)."""
    if not isinstance(template, dict):
        raise TypeError(f"a state's allreducer must be a dict, got {type(template).__name__}")
    none = template.get("residual") is None
    dtype = None
    _check_ar_states(states, template, world_size, ("residual", "step", "world_size"), ("step",))
    for r, st in states:
        res = st["residual"]
        if (res is None) != none:
            raise ValueError(
                f"old rank {r}'s state {'holds' if none else 'lacks'} a residual where the "
                "others' do not; not one checkpoint?"
            )
        if res is None:
            continue
        res = np.asarray(res)
        if res.shape != (n,) or res.dtype.kind != "f" or dtype not in (None, res.dtype):
            raise ValueError(
                f"the residual of old rank {r} has shape {res.shape} and dtype {res.dtype}, "
                f"expected ({n},) and one float dtype on every old rank"
            )
        dtype = res.dtype
    out = {
        "residual": None,
        "step": template.get("step", 0),
        "world_size": new_world_size,
        "resized_from": world_size,
    }
    if not none:
        residuals = [st["residual"] for _, st in states]
        # A new rank starts at zero; each bucket converts the residuals to its own dtype.
        out["residual"] = _fold_sum(residuals, dtype) if residuals else np.zeros(n, np.float32)
    return out


def _fold_torch(states, template, world_size, new_world_size, rank) -> dict:
    """The torch reducer's or hook state's state for rank ``rank`` of the new world: the
    allreducer part folded, the velocities summed by parameter, the counters of the old rank of
    the same number (or rank 0's with the traffic counters at zero)."""
    if not isinstance(template, dict):
        raise TypeError(f"a state must be a dict, got {type(template).__name__}")
    for r, st in states:
        if not isinstance(st, dict):
            raise TypeError(f"the state of old rank {r} must be a dict, got {type(st).__name__}")
        for key in ("algorithm", "step", "keys", "numels"):
            if st.get(key) != template.get(key):
                raise ValueError(
                    f"the old ranks' states disagree on {key} (rank {r}); not one checkpoint?"
                )
    out = dict(template)
    ar = template.get("allreducer")
    # The hook's overlap mode keeps one allreducer per DDP bucket: its state holds every
    # parameter's residual by key ("by_key") beside the buckets' whole states, which belong to
    # the old world and are left out (the new one's buckets start from the folded residuals).
    keyed = bool(template.get("by_key"))
    if keyed:
        out.pop("buckets", None)
    if ar is not None:
        pairs = [(r, st.get("allreducer")) for r, st in states]
        if keyed:
            n = sum(int(m) for m in template.get("numels") or [])
            out["allreducer"] = _fold_keyed(pairs, ar, world_size, new_world_size, n)
        else:
            out["allreducer"] = _fold_allreducer(pairs, ar, world_size, new_world_size, rank)
    velocities = [st.get("velocity") or {} for _, st in states]
    keys = sorted({k for v in velocities for k in v}, key=str)
    out["velocity"] = {
        k: _fold_sum([v[k] for v in velocities if k in v], _first(velocities, k).dtype)
        for k in keys
    } or None
    own = [st for r, st in states if r == rank]
    if own:
        out["stats"] = own[0].get("stats")
    else:
        stats = dict(template.get("stats") or {})
        stats.update(dict.fromkeys(_TRAFFIC, 0), phases={})
        out["stats"] = stats
    return out


def _first(dicts, key):
    return next(np.asarray(d[key]) for d in dicts if key in d)


def _load_folded(ar: Allreducer, state: dict) -> None:
    """Load a folded state (:func:`_fold_allreducer`) into ``ar`` on this rank alone (no
    messages), all or nothing: the counters, density, dtype and residual from the state, and
    everything else derived afresh for this world (``_setup`` again: blocks, teams, regions,
    selectors; then the density's budgets). ValueError if it does not fit."""
    for key, mine in (
        ("algorithm", ar.name),
        ("n", ar.n),
        ("world_size", ar.P),
        ("rank", ar.rank),
    ):
        if state.get(key) != mine:
            raise ValueError(
                f"state was saved with {key}={state.get(key)!r}, this allreducer has {mine!r}"
            )
    res = state.get("residual")
    if res is not None and getattr(res, "shape", None) != (ar.n,):
        raise ValueError(
            f"state residual has shape {getattr(res, 'shape', None)}, expected ({ar.n},)"
        )
    # The checks of load_state_dict at the same size: counters, dtype, a finite residual.
    ar._check_loaded_counters(state)
    ar._check_loaded_residual(state["dtype"], res)
    density = check_density("state density", state.get("density", ar.density))
    ar._validate_common(ar.n, density, ar.op, ar.residual_mode, ar.nonfinite, ar.check)
    saved = ar._snapshot()
    try:
        ar._setup()  # a fresh derivation for this world: the options were validated already
        ar._apply_density(density)
        ar.step = int(state["step"])
        ar._calls = int(state["calls"])
        ar._dtype = None if state["dtype"] is None else np.dtype(state["dtype"])
        if res is None:
            ar._residual = None
        else:
            work = work_dtype(ar._dtype) if ar._dtype is not None else np.dtype(np.float32)
            ar._residual = np.array(res, dtype=work, copy=True)
    except Exception as e:  # noqa: BLE001 - restored, then reported as a malformed state
        ar._restore(saved)
        raise malformed(e) from e


# -- the collective loads -------------------------------------------------------------------------
def _prepare(obj, states, world_size):
    """This rank's part of a load: ("same", its own state) or ("folded", the folded state)."""
    comm = _control(obj)
    P = world_size
    if not 1 <= check_int("world_size", P) <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be an integer in [1, 2**31 - 1], got {P!r}")
    if not isinstance(states, dict):
        raise TypeError(f"states must be a dict of old rank -> state, got {type(states).__name__}")
    wanted = 1 if P == comm.size else len(range(comm.rank, int(P), comm.size))
    if wanted > len(states):  # before listing them: a huge world_size is no MemoryError
        raise ValueError(
            f"the states of {wanted - len(states)} or more old rank(s) are missing on this rank "
            f"(it needs {wanted} of the {P}, and {len(states)} are given)"
        )
    need = folded_ranks(int(P), comm.size, comm.rank)
    missing = [r for r in need if r not in states]
    if missing:
        raise ValueError(f"the states of old rank(s) {missing} are missing on this rank")
    if P == comm.size:
        return "same", states[comm.rank]
    if _kind(obj) == "torch":  # torch.load's tensors as NumPy arrays, for the sums below
        used = need or sorted(states)[:1]
        states = {r: _numpy_state(states[r]) for r in used}
    if need:
        template = states[need[0]]
    elif states:
        template = states[min(states)]
    else:
        raise ValueError("no state given (a new rank needs one, e.g. old rank 0's, for counters)")
    fold = _fold_allreducer if _kind(obj) == "allreducer" else _fold_torch
    return "folded", fold([(r, states[r]) for r in need], template, int(P), comm.size, comm.rank)


def load_rank_states(obj, states: dict, world_size: int) -> None:
    """Load the states of a world of ``world_size`` ranks into ``obj`` at this world's size.

    Collective over ``obj``'s communicator (every rank calls it between the same two steps),
    and all or nothing on every rank: if anything is wrong on any rank, every rank raises and
    every rank's state stays as it was.

    Parameters
    ----------
    obj : Allreducer, SparseGradientReducer or SparseHookState
        What to load into, at world size P' (its communicator's size).
    states : dict of int -> dict
        Old rank -> that rank's ``state_dict()`` (NumPy arrays or torch tensors). On rank q it
        must hold every old rank of :func:`folded_ranks` (P, P', q); a rank with none of them
        (a new rank, q ≥ P) needs one other state (old rank 0's), of which only the counters
        are used. Other entries are ignored.
    world_size : int
        P, the size of the world that saved them (the same on every rank).

    Raises
    ------
    TypeError
        On every rank, if some rank's ``states`` (or a state in it) is not a dict or its
        ``world_size`` is not an integer.
    ValueError
        On every rank, if ``world_size`` is < 1 on some rank, some rank misses a state it
        needs, a state comes from another algorithm or n (an allreducer; the torch classes map
        residuals by parameter), the old states disagree (not one checkpoint), or the ranks
        disagree on ``world_size``.

    Notes
    -----
    At P' = P each rank loads its own state with ``load_state_dict`` (bit for bit). Otherwise
    see the module docstring: residuals (and velocities) folded, everything that depends on P
    derived afresh, thresholds re-estimated at the next step.
    """
    _open_kind(obj)
    _load(obj, states, world_size, None)


def _load(obj, states, world_size, err) -> None:
    """:func:`load_rank_states`, with this rank's error so far (it joins the first check)."""
    prepared = None
    if err is None:
        try:
            prepared = _prepare(obj, states, world_size)
        except (TypeError, ValueError) as e:
            err = e
    P = int(world_size) if err is None else -1
    _agree(
        obj,
        err,
        [name_hash("spardl.elastic.load"), P],
        {"elastic load": _algorithm(obj), "checkpoint world size": P},
    )
    how, state = prepared
    if how == "same" or _kind(obj) == "torch":
        obj.load_state_dict(state)  # collective, all or nothing
        return
    saved = obj._snapshot()
    err = None
    try:
        _load_folded(obj, state)
    except (TypeError, ValueError) as e:
        err = e
    try:
        _agree(
            obj,
            err,
            [name_hash(f"{obj.name}|elastic load"), obj._calls if err is None else -1, obj.step],
            {"elastic load": obj.name, "state's call number": obj._calls if err is None else None},
        )
    except BaseException:
        obj._restore(saved)
        raise


def _agree_on_save(comm: Comm, obj, what: str, root, none: bool, path=...) -> str | None:
    """The collective check that starts a save or a gather: every rank is in the same one,
    with the same valid root (None, where ``none``: every rank) and the same ``path`` (a save),
    so a rank that is elsewhere (stepping, say) makes every rank raise instead of leaving the
    root waiting for its state, and no rank believes it saved to a file that was not
    written. Returns the path as a str (bytes decoded), or None for a gather."""
    err = None
    try:
        if root is not None or not none:
            check_int("root", root)
            if not 0 <= root < comm.size:
                raise ValueError(f"root must be in [0, {comm.size}), got {root}")
        if path is not ...:
            try:
                path = os.fsdecode(path)
            except TypeError:
                raise TypeError(
                    f"path must be a str or os.PathLike, got {type(path).__name__}"
                ) from None
            if not Path(path).name:  # "", ".", "/": the root could not name its temporary file
                raise ValueError(f"path must name a file, got {path!r}")
    except (TypeError, ValueError) as e:
        err = e
    field = -1 if root is None or err is not None else int(root)
    fields = [name_hash(f"spardl.elastic.{what}"), field]
    described = {what: _algorithm(obj), "root": None if err is not None else root}
    if path is not ...:
        ok = err is None
        fields.append(name_hash(path) if ok else -1)
        described["path"] = path if ok else None
    _agree(obj, err, fields, described)
    return None if path is ... else path


def gather_state(obj, root: int | None = 0) -> dict | None:
    """Every rank's state, gathered: what :func:`load_gathered_state` loads at any world size.

    Collective over ``obj``'s communicator.

    Parameters
    ----------
    obj : Allreducer, SparseGradientReducer or SparseHookState
        What to gather (its ``state_dict()`` on every rank).
    root : int or None, default 0
        The rank that receives it; None: every rank.

    Returns
    -------
    dict or None
        On ``root`` (every rank with None): ``{"format": "spardl-elastic", "version": 1,
        "kind", "algorithm", "n", "world_size": P, "states": [state of rank 0, …, P−1]}``, the
        states with NumPy arrays (residuals float32 for float16 gradients, else the gradient's
        dtype, shape (n,)); None on the other ranks. Root holds P residuals: P·n values.

    Raises
    ------
    TypeError
        If ``obj`` is not one of the three kinds (on this rank, before any message).
    ValueError, TypeError
        On every rank, if ``root`` is neither None nor a rank, or the ranks are not all in
        this gather with the same root.
    """
    _open_kind(obj)
    comm = _control(obj)
    _agree_on_save(comm, obj, "gather_state", root, none=True)
    header = _header(obj, comm.size)  # on every rank: no rank may fail alone after a message
    state = _local_state(obj)
    if root is None:
        states = comm.allgather_object(state, control=False)
    else:
        states = comm.gather_object(state, root)
        if comm.rank != root:
            return None
    return {**header, "states": list(states)}


def load_gathered_state(obj, gathered: dict | None, root: int | None = 0) -> None:
    """Load what :func:`gather_state` returned, at this world's size P' (any P' ≥ 1).

    Collective over ``obj``'s communicator, all or nothing on every rank.

    Parameters
    ----------
    obj : Allreducer, SparseGradientReducer or SparseHookState
        Built at P' with the same algorithm (and, for an allreducer, the same n) as the saved
        one; its own options apply (SparDL's ``teams`` must divide P': the constructor says so).
    gathered : dict or None
        :func:`gather_state`'s result on ``root``; ignored on the other ranks (None is fine).
        With ``root=None`` every rank passes it.
    root : int or None, default 0
        The rank that holds ``gathered``: it sends each rank the states it needs
        (:func:`folded_ranks`). None: every rank holds it.

    Raises
    ------
    TypeError, ValueError
        On every rank, as :func:`load_rank_states`, and if ``gathered`` is not a gathered state
        or was saved with another algorithm, kind of object or (an allreducer) n.
    """
    _open_kind(obj)
    comm = _control(obj)
    Pn = comm.size

    def pieces(g):
        P = _check_header(obj, g)
        states = g.get("states")
        if not isinstance(states, (list, tuple)) or len(states) != P:
            raise ValueError(f"the gathered state must hold {P} states")
        out = []
        for q in range(Pn):
            need = folded_ranks(P, Pn, q)
            mine = {r: states[r] for r in need} or {0: states[0]}
            out.append((P, mine))
        return out

    err, P, mine = None, None, {}
    if root is None:
        try:
            P, mine = pieces(gathered)[comm.rank]
        except (TypeError, ValueError) as e:
            err = e
    else:
        parts = None
        if comm.rank == root:
            try:
                parts = pieces(gathered)
            except (TypeError, ValueError) as e:
                parts = [("error", f"{type(e).__name__}: {e}")] * Pn
                err = e
        P, mine = comm.scatter_object(parts, root)
        if P == "error" and err is None:
            err = ValueError(f"rank {root} rejected the gathered state ({mine})")
    _load(obj, mine if err is None else {}, P if err is None else 1, err)


# -- one file ----------------------------------------------------------------------------------
def _encode(obj, arrays: list, prefix: str):
    """JSON-able form of a state: arrays become ``{"__array__": entry}`` (appended to
    ``arrays``), tuples ``{"__tuple__": [...]}``, dicts with other keys than strings
    ``{"__items__": [[k, v], ...]}``."""
    if isinstance(obj, np.ndarray):
        name = f"{prefix}/{len(arrays)}.npy"
        arrays.append((name, obj))
        return {"__array__": name}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, arrays, prefix) for k, v in obj.items()}
        return {
            "__items__": [
                [_encode(k, arrays, prefix), _encode(v, arrays, prefix)] for k, v in obj.items()
            ]
        }
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, arrays, prefix) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, arrays, prefix) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if _is_tensor(obj):
        return _encode(obj.detach().cpu().numpy(), arrays, prefix)
    raise TypeError(f"cannot store a {type(obj).__name__} in an elastic checkpoint")


def _decode(obj, zf: zipfile.ZipFile | None):
    """Inverse of :func:`_encode`; arrays are read from ``zf`` (None: not read, each one an
    empty float64 array in its place: a new rank needs rank 0's counters, not its arrays)."""
    if isinstance(obj, list):
        return [_decode(v, zf) for v in obj]
    if isinstance(obj, dict):
        if "__array__" in obj:
            if zf is None:
                return np.empty(0)
            with zf.open(obj["__array__"]) as f:
                return np.lib.format.read_array(f, allow_pickle=False)
        if "__tuple__" in obj:
            return tuple(_decode(v, zf) for v in obj["__tuple__"])
        if "__items__" in obj:
            return {_hashable(_decode(k, zf)): _decode(v, zf) for k, v in obj["__items__"]}
        return {k: _decode(v, zf) for k, v in obj.items()}
    return obj


def _hashable(k):
    return tuple(_hashable(v) for v in k) if isinstance(k, list) else k


def _write_state(zf: zipfile.ZipFile, r: int, state) -> None:
    arrays: list = []
    doc = _encode(state, arrays, f"rank{r}")
    for name, a in arrays:
        with zf.open(name, "w", force_zip64=True) as f:
            np.lib.format.write_array(f, np.ascontiguousarray(a), allow_pickle=False)
    zf.writestr(f"rank{r}/state.json", json.dumps(doc))


def _read_state(zf: zipfile.ZipFile, r: int, arrays: bool = True):
    return _decode(json.loads(zf.read(f"rank{r}/state.json")), zf if arrays else None)


def save_checkpoint(obj, path, root: int = 0) -> None:
    """Write every rank's state into one file, loadable at any world size by
    :func:`load_checkpoint`.

    Collective over ``obj``'s communicator. ``root`` writes the file (to ``path`` + ".tmp",
    renamed to ``path`` when complete) as the ranks' states arrive, one at a time: it holds one
    rank's state at once, not P.

    Parameters
    ----------
    obj : Allreducer, SparseGradientReducer or SparseHookState
        What to save.
    path : str or os.PathLike
        The file (on root's filesystem; :func:`load_checkpoint` reads it on every rank).
    root : int, default 0
        The writing rank.

    Raises
    ------
    OSError
        On every rank, if root cannot write the file (nothing is left at ``path``; an older
        file there is kept).
    TypeError
        If ``obj`` is not one of the three kinds (on this rank, before any message).
    ValueError, TypeError
        On every rank, if ``root`` is not a rank, ``path`` is not a path (or names no file:
        "", "."), or the ranks are not
        all in this save with the same root and the same ``path`` (one stepping while the
        others save, say, or a path that names each rank: the file is one, and every rank
        loads it from the same path).

    Notes
    -----
    The file is a zip: ``header.json`` (format, version, kind, algorithm, n, world size),
    ``rank{r}/state.json`` (rank r's state, arrays referenced by name) and
    ``rank{r}/{i}.npy`` (its arrays: residual, velocities, Ok-Topk's regions). No pickle: it
    loads without running code from the file.
    """
    _open_kind(obj)
    comm = _control(obj)
    path = _agree_on_save(comm, obj, "save_checkpoint", root, none=False, path=path)
    header = _header(obj, comm.size)  # on every rank: no rank may fail alone after a message
    state = _local_state(obj)
    err = None
    if comm.rank == root:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        zf = None
        try:
            zf = zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
            zf.writestr("header.json", json.dumps(header))
            _write_state(zf, root, state)
        except (OSError, TypeError, ValueError) as e:
            err = e
        for r in range(comm.size):
            if r == root:
                continue
            st = comm.recv_object(r, _TAG)
            if err is None:
                try:
                    _write_state(zf, r, st)
                except (OSError, TypeError, ValueError) as e:
                    err = e
            del st
        try:
            if zf is not None:
                zf.close()
            if err is None:
                os.replace(tmp, path)
        except OSError as e:
            err = err or e
        if err is not None:
            try:
                os.remove(tmp)
            except OSError:
                pass
    else:
        comm.send_object(state, root, _TAG)
    del state
    report = None if err is None else f"{type(err).__name__}: {err}"
    reports = comm.allgather_object(report, control=False)
    if err is not None:
        raise OSError(f"cannot write the checkpoint {path} ({report})") from err
    bad = [(r, m) for r, m in enumerate(reports) if m is not None]
    if bad:
        raise OSError(f"rank {bad[0][0]} cannot write the checkpoint ({bad[0][1]})")


def load_checkpoint(obj, path) -> None:
    """Load a file of :func:`save_checkpoint` at this world's size P' (any P' ≥ 1).

    Collective over ``obj``'s communicator, all or nothing on every rank. Every rank reads the
    file (a path every rank can read) and only the entries it needs: its old ranks'
    (:func:`folded_ranks`), ⌈P/P'⌉ residuals at most, or rank 0's counters on a new rank.

    Parameters
    ----------
    obj : Allreducer, SparseGradientReducer or SparseHookState
        Built at P' with the same algorithm (and, for an allreducer, the same n).
    path : str or os.PathLike
        The checkpoint file.

    Raises
    ------
    TypeError, ValueError
        On every rank, as :func:`load_rank_states`; ValueError also if some rank cannot read
        the file (whatever the damage: a missing or corrupt entry, malformed JSON) or it is
        not an elastic checkpoint, or was saved with another algorithm, kind of object or (an
        allreducer) n.
    """
    _open_kind(obj)
    comm = _control(obj)
    err, P, states = None, 1, {}
    try:
        with zipfile.ZipFile(path) as zf:
            P = _check_header(obj, json.loads(zf.read("header.json")))
            zf.getinfo(f"rank{P - 1}/state.json")  # the file holds P ranks (KeyError if not)
            need = folded_ranks(P, comm.size, comm.rank)
            states = {r: _read_state(zf, r) for r in need}
            if not need:
                states[0] = _read_state(zf, 0, arrays=False)
    except _NotReadable as e:
        err = ValueError(f"cannot read the checkpoint {path} ({type(e).__name__}: {e})")
    except ValueError as e:  # the header's own checks
        err = e
    except Exception as e:  # noqa: BLE001 - whatever a damaged entry raises on this rank alone
        # (a RecursionError, zlib.error, MemoryError, TypeError from its JSON) must reach every
        # rank as the collective error below, never leave the others waiting for this one.
        err = ValueError(f"cannot read the checkpoint {path} ({type(e).__name__}: {e})")
    _load(obj, states, P, err)


# ValueErrors of reading, not of the header's checks.
_NotReadable = (json.JSONDecodeError, UnicodeDecodeError, zipfile.BadZipFile)
