"""``auto`` against every fixed candidate in one run: step time per allreducer, interleaved.

    mpiexec -n 4 .venv/bin/python bench/auto_step.py --n 2500000 --density 0.01

Every rank steps every allreducer on the same gradients (a few per rank, drawn once, cycled).
A step's time is the slowest rank's (a barrier before each step, the maximum after). After
``--warmup`` untimed steps of each fixed choice and ``auto``'s trials, rounds interleave the
allreducers (``--rounds`` rounds of ``--steps`` steps each, the order rotated every round), so
that a change in the machine's load falls on all of them alike.
``auto`` runs from its construction: its trial steps are counted in "auto (all)", and "auto
(chosen)" counts its steps after the trials (the candidates it pruned are not tried); the
trials amortised over its first decision interval are printed below the table (median and
mean ms per step, ratio of medians to the best fixed choice), with ``auto``'s explanation
(``stats["auto"]``), on rank 0.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import spardl  # noqa: E402
from bench._args import (  # noqa: E402
    DENSITY,
    ELEMENTS,
    NONNEGATIVE_INT,
    POSITIVE_INT,
    Parser,
)
from spardl.algorithms.auto import candidate_names, explain  # noqa: E402


def _fixed(name: str):
    """(algorithm, options) of a candidate name."""
    if name.startswith("spardl:d="):
        return "spardl", {"teams": int(name.removeprefix("spardl:d="))}
    return name, {}


def _args(argv):
    """The command line's options."""
    ap = Parser(description=__doc__.splitlines()[0])  # a usage error: one line, from rank 0
    ap.add_argument("--n", type=ELEMENTS, default=2_500_000)
    ap.add_argument("--density", type=DENSITY, default=0.01)
    ap.add_argument("--rounds", type=POSITIVE_INT, default=3)
    ap.add_argument("--steps", type=POSITIVE_INT, default=8, help="timed steps per round")
    ap.add_argument("--warmup", type=NONNEGATIVE_INT, default=3)
    ap.add_argument("--interval", type=POSITIVE_INT, default=100, help="auto's interval")
    ap.add_argument("--trials", type=NONNEGATIVE_INT, default=3, help="auto's trials")
    ap.add_argument("--grads", type=POSITIVE_INT, default=3, help="gradients per rank, cycled")
    return ap.parse_args(argv)


def _build(world, a, names):
    """Every fixed candidate's allreducer, ``auto``'s, and the slowest rank's seconds to build
    ``auto``."""
    fixed = {}
    for name in names:
        algorithm, opts = _fixed(name)
        fixed[name] = spardl.make(algorithm, world, a.n, density=a.density, **opts)
    t0 = time.perf_counter()
    auto = spardl.make("auto", world, a.n, density=a.density, interval=a.interval, trials=a.trials)
    built = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    return fixed, auto, built


def _stepper(world, grads):
    """A function that steps an allreducer on the next gradient (cycled) and returns the
    slowest rank's time (a barrier before, the maximum after)."""
    counter = [0]

    def step(ar) -> float:
        g = grads[counter[0] % len(grads)]
        counter[0] += 1
        world.Barrier()
        t = time.perf_counter()
        ar(g)
        return world.allreduce(time.perf_counter() - t, op=MPI.MAX)

    return step


def _run(a, names, fixed, auto, step):
    """Warm the fixed choices up, run ``auto``'s trials, then the interleaved rounds; the step
    times per allreducer and ``auto``'s trial step times."""
    times = {name: [] for name in [*names, "auto (all)", "auto (chosen)"]}
    trial_times = []
    for name in names:
        for _ in range(a.warmup):
            step(fixed[name])
    while auto.stats["auto"]["phase"] == "trials":  # the trials, then rounds in a rotating order
        t = step(auto)
        times["auto (all)"].append(t)
        trial_times.append(t)
    order = [*names, "auto"]
    for r in range(a.rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            if name != "auto":
                times[name] += [step(fixed[name]) for _ in range(a.steps)]
                continue
            for _ in range(a.steps):
                t = step(auto)
                times["auto (all)"].append(t)
                times["auto (chosen)"].append(t)
    return times, trial_times


def _report(a, P, names, times, trial_times, built, auto) -> None:
    """Print the table, the cost of ``auto``'s first decision interval and its explanation."""
    load = os.getloadavg()
    print(
        f"# P = {P}, n = {a.n}, density {a.density}, float32; {a.rounds} rounds x "
        f"{a.steps} steps; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; "
        f"auto built in {built * 1e3:.1f} ms (ping-pong included)"
    )
    best = min(names, key=lambda k: float(np.median(times[k])))
    ref = float(np.median(times[best]))
    print(f"{'allreducer':<16} {'median ms':>10} {'mean ms':>9} {'steps':>6} {'/ best':>7}")
    for name, ts in times.items():
        med = float(np.median(ts))
        print(
            f"{name:<16} {med * 1e3:>10.2f} {float(np.mean(ts)) * 1e3:>9.2f} "
            f"{len(ts):>6} {med / ref:>7.3f}"
        )
    T = len(trial_times)  # fewer than trials x candidates where auto pruned some
    tried = [k for k in names if k not in auto.stats["auto"]["not_tried"]]
    chosen = float(np.median(times["auto (chosen)"]))
    first = (sum(trial_times) + a.interval * chosen) / (T + a.interval)
    # The trials priced at this run's medians (they ran before the rounds, at another load):
    # each tried candidate's trial steps cost its median over the best's.
    extra = a.trials * sum(float(np.median(times[k])) / ref - 1 for k in tried)
    print(
        f"best fixed choice: {best}; auto's first {T} + {a.interval} steps (its trials as "
        f"timed, then the chosen step's median): {first * 1e3:.2f} ms per step, "
        f"{first / ref:.3f} x the best; the trials at the rounds' medians cost {extra:.1f} "
        f"best steps: {(T + extra + a.interval * chosen / ref) / (T + a.interval):.3f} x "
        f"over the first {T + a.interval} steps, "
        f"{(T + extra + (1000 - T) * chosen / ref) / 1000:.3f} x over 1000"
    )
    print(explain(auto.stats["auto"]))
    print("trial steps (ms):", " ".join(f"{t * 1e3:.1f}" for t in trial_times))


def main(argv=None) -> int:
    """Step ``auto`` and every fixed candidate in interleaved rounds; rank 0 prints the table."""
    a = _args(argv)
    world = MPI.COMM_WORLD
    rank, P = world.Get_rank(), world.Get_size()
    rng = np.random.default_rng(rank)
    grads = [(rng.standard_t(3, a.n) * 1e-3).astype(np.float32) for _ in range(a.grads)]
    names = candidate_names(P)
    fixed, auto, built = _build(world, a, names)
    times, trial_times = _run(a, names, fixed, auto, _stepper(world, grads))
    if rank == 0:
        _report(a, P, names, times, trial_times, built, auto)
    return 0


if __name__ == "__main__":
    sys.exit(main())
