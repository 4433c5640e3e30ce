"""Validate the α-β-γ model against measured step times on this machine.

Run from the repository root (it spawns its own ``mpiexec``)::

    python bench/validate_model.py --n 2000000 --density 0.01 --P 1-8 --out results/validate.json

1. Fit: ``mpiexec -n 2`` ping-pong (:mod:`spardl.pingpong`) gives α and β by least squares,
   and the merge kernel gives γ.
2. Measure: for each P, ``mpiexec -n P`` runs every algorithm on a heavy-tailed float32
   gradient (``bench/allreduce.py``'s generator): ``--warmup`` untimed calls, then ``--repeat``
   timed calls (barrier, ``MPI.Wtime``, the slowest rank's time), recording the message trace
   of the timed calls (:mod:`spardl.trace`).
3. Predict, two ways, never fitting anything to the multi-rank wall times. With C cores and
   s(P) = ⌈P / C⌉, the most ranks any one core runs (Linux keeps a run queue per core and
   balances task counts, not time: with P = 3 on 2 cores one core runs two ranks for the whole
   of a 10 ms step, and every synchronising round waits for that core):

   (A) a priori::

       t_A(P) = t_local + s(P) · (replay(trace; α, β, γ) + control)

   * t_local: the same algorithm on ``COMM_SELF``, every rank at once (nothing is sent: the
     P = 1 code path, under the same memory and core contention).
   * replay: :func:`spardl.cost_model.replay` of the recorded trace (the slowest rank's sum over
     its messages; γ prices the merging of what arrives); control: the cross-rank check, one
     small allreduce per call.

   (B) clocked local work::

       t_B(P) = s(P) · (W_max + replay(trace; α, β, 0) + control)

   * W_max: the largest, over ranks, of a step's thread-CPU time outside MPI calls
     (``spardl.trace.record(..., timed=True)``): the P-rank code path's own local work
     (selection, packing, merging), blind to waiting, busy-polling and to the time other ranks
     held the core. The merges are inside it, hence γ = 0.
   * What (B) tests: that the step is the local work plus the α-β communication, stretched by
     the ranks sharing a core; what (A) adds: that the P = 1 local work stands for the P-rank
     one (it does not: the P-rank path packs, unpacks and merges, and it runs on fewer free
     cache and memory bandwidth).

Across links (``--bandwidth``, one rank per emulated node) the wire time is not stretched by
ranks sharing a core, and β is the ring exchange's that the P-node job measures before the
algorithms (``spardl.pingpong.ring_beta``: every node sending at once, as the algorithms'
rounds do, where the two-node ping-pong sees one link alone). Each job is also run over shared
memory, and (A) then takes its local work from there, before any link:

    t_A(P) = s(P) · W_max(shared memory) + replay(trace; α, β, 0) + control

the P-rank code path's clocked work (packing, merging, the selections after receiving, which
the P = 1 path of t_local lacks) plus the links from the model alone. The t_local form and the
ping-pong β's prediction are printed beside it.

Rank 0 of the driver prints one table: measured, predicted, relative error per (algorithm, P).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The option types without importing spardl (which would initialise MPI in the driver).
from bench._args import (  # noqa: E402
    DENSITY,
    ELEMENTS,
    NONNEGATIVE_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    Parser,
    output_file_parents,
)

SPARSE = ("spardl", "oktopk", "topka", "gaussiank", "topkdsa", "gtopk")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


def _rate(text: str) -> str:
    """argparse ``type=`` for ``--bandwidth``: a link rate in tc syntax (checked, kept as text).
    spardl is imported only when the option is given: cluster mode imports it anyway."""
    from spardl.cli.cluster import rate_type

    return rate_type(text)


_rate.__name__ = "rate"


def _spawn(P: int, args: list[str], timeout: float, bandwidth: str | None = None) -> None:
    """``mpiexec -n P python ARGS`` on shared memory, or on P emulated nodes (one rank each)
    linked at ``bandwidth`` (``spardl cluster``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI_"))}
    env.update(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [_mpiexec(), "-n", str(P), sys.executable, *args]
    if bandwidth is None:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, timeout=timeout, capture_output=True, text=True
        )
    else:
        from spardl.cluster import Cluster

        with Cluster(P, bandwidth=bandwidth) as cl:
            proc = cl.run(
                [sys.executable, *args], timeout=timeout, cwd=ROOT, capture_output=True, text=True
            )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n"
            f"{proc.stderr[-3000:]}"
        )


# -- workers (under mpiexec) -----------------------------------------------------------------
def _worker_pingpong(out: str) -> None:
    from mpi4py import MPI

    from spardl import pingpong

    rows = pingpong.pingpong(MPI.COMM_WORLD)
    alpha, beta = pingpong.fit_alpha_beta([s for s, _ in rows], [t for _, t in rows])
    gamma = pingpong.fit_gamma()
    if MPI.COMM_WORLD.rank == 0:
        Path(out).write_text(
            json.dumps({"alpha": alpha, "beta": beta, "gamma": gamma, "rows": rows})
        )


def _worker_measure(a) -> None:
    import numpy as np
    from mpi4py import MPI

    import spardl
    import spardl.trace
    from bench.allreduce import gradient
    from spardl import pingpong

    comm = MPI.COMM_WORLD
    g = gradient(a.n, comm.rank, 0, np.float32)
    # β with every rank sending at once (before the algorithms, a priori): across links whose
    # ends share the cores it is not the two-node ping-pong's.
    beta_ring = pingpong.ring_beta(comm) if comm.size > 1 else None
    rows = {}
    for alg in a.algorithms:
        opts = {} if alg == "dense" else {"density": a.density}
        ar = spardl.make(alg, comm, a.n, **opts)
        for _ in range(a.warmup):
            ar(g)
        times = []
        work = []  # per step: this rank's thread-CPU seconds outside MPI (its local work)
        mpi_wall = []  # per step: this rank's wall seconds inside MPI calls
        m0, k0 = ar.stats["messages"], ar.stats["control_messages"]
        with spardl.trace.record(ar, timed=True) as t:
            for _ in range(a.repeat):
                comm.Barrier()
                c0, mc0, mw0 = time.thread_time(), t.mpi_cpu_seconds, t.mpi_seconds
                t0 = MPI.Wtime()
                ar(g)
                dt = MPI.Wtime() - t0
                work.append(time.thread_time() - c0 - (t.mpi_cpu_seconds - mc0))
                mpi_wall.append(t.mpi_seconds - mw0)
                times.append(comm.allreduce(dt, op=MPI.MAX))
        msgs = ar.stats["messages"] - m0
        traces = spardl.trace.gather_traces(comm, t)
        counts = comm.allgather(msgs)
        work = comm.allgather(work)  # [rank][step]
        mpi_wall = comm.allgather(mpi_wall)
        control = ar.stats["control_messages"] - k0  # the timed calls' cross-rank checks
        del ar
        # The local work alone, under the same contention: every rank runs the algorithm on
        # COMM_SELF at the same time (nothing is sent; the world barrier only aligns starts).
        solo = spardl.make(alg, MPI.COMM_SELF, a.n, **opts)
        for _ in range(a.warmup):
            solo(g)
        local = []
        for _ in range(a.repeat):
            comm.Barrier()
            t0 = MPI.Wtime()
            solo(g)
            local.append(comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX))
        del solo
        if comm.rank == 0:
            rows[alg] = {
                "times": times,
                "traces": traces,
                "messages": counts,
                "local_times": local,
                "work": work,
                "mpi_wall": mpi_wall,
                "control_per_step": control / a.repeat,
            }
    if comm.rank == 0:
        Path(a.out).write_text(json.dumps({"P": comm.size, "rows": rows, "beta_ring": beta_ring}))


# -- driver ----------------------------------------------------------------------------------
def _parse_P(text):
    """World sizes from "1-8", "2,4,8" or "3"; ValueError on anything else."""
    # No spardl import here: importing it initialises MPI in this (driver) process, whose PMI
    # environment the spawned mpiexec jobs would inherit and hang on.
    out = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            lo, hi = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"--P must be sizes like 1-8 or 2,4,8, got {text!r}") from None
        if lo < 1 or hi < lo:
            raise ValueError(f"--P ranges must satisfy 1 <= low <= high, got {part!r}")
        out += list(range(lo, hi + 1))
    return out


def predict_rows(fit, measured, cores, links=False, shared=None):
    """Rows of (algorithm, P, measured, predicted, error) from the fit and the measurements.

    With ``links`` (one rank per emulated node), each rank's messages cross its own shaped
    link: the wire time is not stretched by ranks sharing a core, only the local work is
    (t_A = t_local + replay + control; t_B = s(P)·W_max + replay + control), and β is the ring
    exchange's that the P-node job measured before the algorithms (``pingpong.ring_beta``:
    every node sending at once, as in the algorithms' rounds) where it recorded one; the
    prediction with the two-node ping-pong's β is kept beside it (``rel_error_pingpong``).

    ``shared``: the same jobs measured over shared memory (no links), {P: measurement}. Then the
    a priori prediction (A) takes the local work from there, where nothing crosses a link:
    t_A = s(P)·W_max(shared memory) + replay(trace; α, β) + control, the P-rank code path's own
    clocked work (packing, merging, the selections after receiving, which the P = 1 path of
    t_local does not have) and the links from the model alone; the COMM_SELF form is kept as
    ``rel_error_self``."""
    from spardl import cost_model

    out = []
    for P in sorted(measured):
        if P == 1:
            continue
        for alg, r in measured[P]["rows"].items():
            # The base class's cross-rank check: one small allreduce per call (not a data
            # message, so not in the trace), at its algorithmic latency.
            control_s = (
                r["control_per_step"] * cost_model.collective_rounds("allreduce", P) * fit["alpha"]
            )
            ring = measured[P].get("beta_ring") if links else None
            beta = ring if ring else fit["beta"]
            comm_s = cost_model.replay(r["traces"], fit["alpha"], beta, fit["gamma"])
            comm_s += control_s
            comm_pp = comm_s
            if ring:
                comm_pp = control_s + cost_model.replay(
                    r["traces"], fit["alpha"], fit["beta"], fit["gamma"]
                )
            # (B): α-β only; the merges are inside the clocked local work, so no γ term here.
            comm_ab = cost_model.replay(r["traces"], fit["alpha"], beta, 0.0) + control_s
            s = float(math.ceil(P / cores))
            local = float(median(r["local_times"]))
            wire = 1.0 if links else s
            pred = local + wire * comm_s
            w_max = _work_max(r)
            pred_b = s * w_max + wire * comm_ab
            pred_self = pred
            if shared is not None and alg in shared.get(P, {}).get("rows", {}):
                w_shared = _work_max(shared[P]["rows"][alg])
                pred = s * w_shared + wire * comm_ab
            meas = float(median(r["times"]))
            row = {
                "algorithm": alg,
                "P": P,
                "measured_s": meas,
                "predicted_s": pred,
                "local_s": local,
                "comm_s": comm_s,
                "oversubscription": s,
                "rel_error": (pred - meas) / meas,
                "rel_error_self": (pred_self - meas) / meas,
                "beta": beta,
                "rel_error_pingpong": (local + wire * comm_pp - meas) / meas,
                "work_max_s": w_max,
                "comm_ab_s": comm_ab,
                "predicted_clocked_s": pred_b,
                "rel_error_clocked": (pred_b - meas) / meas,
                "mpi_wall_s": float(sum(median(v) for v in r["mpi_wall"]) / len(r["mpi_wall"])),
                "trace_messages": sum(len(tr) for tr in r["traces"])
                / P
                / max(1, len({rec[0] for rec in r["traces"][0]})),
                "stats_messages": sum(r["messages"]) / P / len(r["times"]),
            }
            out.append(row)
    return out


def _work_max(r) -> float:
    """The median over steps of the largest rank's clocked local work (s)."""
    steps = list(zip(*r["work"], strict=True))  # per step: every rank's work
    return float(median([max(w) for w in steps]))


def _table(rows):
    lines = [
        "| algorithm | P | measured (ms) | (A) predicted (ms) | local (ms) | comm (ms) | s(P) "
        "| (A) error | W_max (ms) | α-β comm (ms) | MPI wall (ms) | (B) predicted (ms) "
        "| (B) error | t_local form error | (A) error, ping-pong β |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["algorithm"], r["P"])):
        lines.append(
            f"| {r['algorithm']} | {r['P']} | {r['measured_s'] * 1e3:.1f} | "
            f"{r['predicted_s'] * 1e3:.1f} | {r['local_s'] * 1e3:.1f} | "
            f"{r['comm_s'] * 1e3:.2f} | {r['oversubscription']:.1f} | "
            f"{r['rel_error']:+.0%} | {r['work_max_s'] * 1e3:.1f} | "
            f"{r['comm_ab_s'] * 1e3:.2f} | {r['mpi_wall_s'] * 1e3:.1f} | "
            f"{r['predicted_clocked_s'] * 1e3:.1f} | {r['rel_error_clocked']:+.0%} | "
            f"{r.get('rel_error_self', r['rel_error']):+.0%} | "
            f"{r.get('rel_error_pingpong', r['rel_error']):+.0%} |"
        )
    return "\n".join(lines)


def alone_line(measured) -> str:
    """Each algorithm's step at P = 1 (nothing sent: its local work alone, one rank)."""
    ones = measured.get(1, {}).get("rows", {})
    cells = [
        f"{alg} {median(r['times']) * 1e3:.1f} ms (W {median(r['work'][0]) * 1e3:.1f})"
        for alg, r in sorted(ones.items())
    ]
    return "P = 1 step (W: its local work): " + ", ".join(cells)


def summary(rows, fit=None) -> list[str]:
    """Per predictor, the sparse rows within ±30%, the median and worst |error|; the dense
    rows' worst; and how well the α-β line fits the ping-pong it was fitted to."""
    out = []
    for key, label in (("rel_error", "(A) a priori"), ("rel_error_clocked", "(B) clocked work")):
        errs = [abs(r[key]) for r in rows if key in r and r["algorithm"] in SPARSE]
        dense = [abs(r[key]) for r in rows if key in r and r["algorithm"] == "dense"]
        if errs:
            within = sum(e <= 0.30 for e in errs)
            out.append(
                f"# {label}: sparse algorithms within ±30%: {within}/{len(errs)}; "
                f"median |error| {median(errs):.0%}; worst {max(errs):.0%}"
                + (f"; dense worst {max(dense):.0%}" if dense else "")
            )
    clocked = [r for r in rows if "comm_ab_s" in r and r["algorithm"] in SPARSE]
    if clocked:
        share = [r["comm_ab_s"] / (r["work_max_s"] + r["comm_ab_s"]) for r in clocked]
        out.append(
            f"# α-β communication's share of (B) on the sparse rows: median {median(share):.1%}, "
            f"largest {max(share):.1%}"
        )
    if fit and fit.get("rows"):
        errs = [(fit["alpha"] + fit["beta"] * m - t) / t for m, t in fit["rows"]]
        worst = max(range(len(errs)), key=lambda i: abs(errs[i]))
        out.append(
            f"# α + β·m vs the ping-pong ({fit['rows'][0][0]} B … {fit['rows'][-1][0]} B): "
            f"median |error| {median([abs(e) for e in errs]):.0%}, worst {errs[worst]:+.0%} "
            f"at {fit['rows'][worst][0]} B"
        )
    return out


def _parser() -> Parser:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=ELEMENTS, default=2_000_000)
    ap.add_argument("--density", type=DENSITY, default=0.01)
    ap.add_argument("--P", default="1-8", help="world sizes, e.g. 1-8 (P = 1 is always run)")
    ap.add_argument("--algorithms", default=",".join((*SPARSE, "dense")))
    ap.add_argument("--repeat", type=POSITIVE_INT, default=5)
    ap.add_argument("--warmup", type=NONNEGATIVE_INT, default=2)
    ap.add_argument("--timeout", type=POSITIVE_FLOAT, default=300, help="per mpiexec, seconds")
    ap.add_argument(
        "--out", type=output_file_parents, help="write fit, rows and environment as JSON"
    )
    ap.add_argument(
        "--bandwidth",
        type=_rate,
        default=None,
        help="cluster mode: every job on emulated nodes (one rank each) with links of this rate "
        "(tc syntax, e.g. 1gbit; needs root); the ping-pong then fits the link",
    )
    ap.add_argument("--worker", choices=["pingpong", "measure"], help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    return ap


def _world_sizes(ap, a) -> list[int]:
    """The world sizes to measure (P = 1 always), after checking --P and --algorithms."""
    try:
        Ps = sorted(set(_parse_P(a.P)) | {1})
    except ValueError as e:
        ap.error(str(e))
    unknown = [s for s in a.algorithms if s not in (*SPARSE, "dense")]
    if unknown or not a.algorithms:
        ap.error(f"--algorithms: unknown {unknown}; known: {[*SPARSE, 'dense']}")
    return Ps


def _measure(a, Ps):
    """The ping-pong fit (one job at P = 2) and every world size's measured step times (one job
    per P), each job writing its JSON into a temporary directory."""
    me = str(Path(__file__).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        _spawn(
            2,
            [me, "--worker", "pingpong", "--worker-out", f"{tmp}/fit.json"],
            a.timeout,
            a.bandwidth,
        )
        fit = json.loads(Path(f"{tmp}/fit.json").read_text())
        measured = {}
        common = [
            "--n",
            str(a.n),
            "--density",
            str(a.density),
            "--repeat",
            str(a.repeat),
            "--warmup",
            str(a.warmup),
            "--algorithms",
            ",".join(a.algorithms),
        ]
        shared = {} if a.bandwidth else None
        for P in Ps:
            out = f"{tmp}/P{P}.json"
            bw = a.bandwidth if P > 1 else None  # P = 1 sends nothing: no link needed
            _spawn(P, [me, "--worker", "measure", "--worker-out", out, *common], a.timeout, bw)
            measured[P] = json.loads(Path(out).read_text())
            print(f"# measured P={P}", file=sys.stderr, flush=True)
            if shared is not None and P > 1:
                # The same job over shared memory: the P-rank local work without the links.
                _spawn(P, [me, "--worker", "measure", "--worker-out", out, *common], a.timeout)
                shared[P] = json.loads(Path(out).read_text())
                print(f"# measured P={P} over shared memory", file=sys.stderr, flush=True)
    return fit, measured, shared


def _print_report(a, fit, measured, rows, cores) -> None:
    """The command, host and fit as comments, the table, the summary and the load."""
    print(f"# {' '.join(['python', *sys.argv])}")
    print(
        f"# host {platform.node()}, {cores} cores, {platform.processor() or platform.machine()}"
        f"; n={a.n}, density={a.density}, repeat={a.repeat}, warmup={a.warmup}"
        + (f"; emulated nodes, {a.bandwidth} links" if a.bandwidth else "; shared memory")
    )
    print(
        f"# fit: alpha={fit['alpha']:.3e} s, beta={fit['beta']:.3e} s/B, "
        f"gamma={fit['gamma']:.3e} s/B; s(P) = ceil(P/{cores})"
    )
    rings = sorted({r["beta"] for r in rows if r.get("beta") != fit["beta"]})
    if rings:
        print(f"# beta of the ring exchange on the P nodes: {rings[0]:.3e} s/B (used by (A), (B))")
    print(_table(rows))
    for line in summary(rows, fit):
        print(line)
    print("# " + alone_line(measured))
    try:
        load = os.getloadavg()[0]
        print(f"# load average (1 min) at the end: {load:.1f}")
    except OSError:
        pass


def _write_json(a, fit, rows, cores) -> None:
    """--out: the fit, the rows and the environment as JSON."""
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(
        json.dumps(
            {
                "fit": fit,
                "rows": rows,
                "cores": cores,
                "host": platform.node(),
                "argv": sys.argv,
                "n": a.n,
                "density": a.density,
                "bandwidth": a.bandwidth,
            },
            indent=1,
        )
    )


def main(argv=None):
    ap = _parser()
    a = ap.parse_args(argv)
    a.algorithms = [s for s in a.algorithms.split(",") if s]
    if a.worker == "pingpong":
        return _worker_pingpong(a.worker_out)
    if a.worker == "measure":
        a.out = a.worker_out
        return _worker_measure(a)
    Ps = _world_sizes(ap, a)
    cores = _cores()
    fit, measured, shared = _measure(a, Ps)
    rows = predict_rows(fit, measured, cores, links=a.bandwidth is not None, shared=shared)
    _print_report(a, fit, measured, rows, cores)
    if a.out:
        _write_json(a, fit, rows, cores)
    return 0


if __name__ == "__main__":
    sys.exit(main())
