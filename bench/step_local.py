"""One rank's local work per step (P = 1, nothing sent) against ``np.copyto`` of the gradient,
with and without the reuse of the X = g + E buffer.

    NUMBA_NUM_THREADS=1 .venv/bin/python bench/step_local.py --n 25000000 --density 0.01

"no reuse" is the same allreducer with the caller keeping every residual alive, so each step
writes X into a fresh buffer; "reuse" lets the allreducer take the buffer of an older residual.
Each row is the median of ``--repeat`` steps after two warm-up steps, in ms, run twice
interleaved (the machine is shared: compare within a row).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import spardl  # noqa: E402
from bench._args import DENSITY, ELEMENTS, POSITIVE_INT, Parser  # noqa: E402


def _median_ms(fn, repeat):
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def step_ms(algorithm, g, density, keep, repeat):
    """Median step time of ``algorithm`` on COMM_SELF; ``keep``: hold every residual."""
    ar = spardl.make(algorithm, MPI.COMM_SELF, g.shape[0], density=density)
    held = []

    def step():
        ar(g)
        if keep:
            held.append(ar.residual)

    for _ in range(2):
        step()
    return _median_ms(step, repeat)


def main(argv=None) -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=ELEMENTS, default=25_000_000)
    ap.add_argument("--density", type=DENSITY, default=0.01)
    ap.add_argument("--repeat", type=POSITIVE_INT, default=7)
    ap.add_argument("--algorithms", default="spardl,topka,oktopk", help="comma-separated")
    a = ap.parse_args(argv)
    a.algorithms = [s for s in a.algorithms.split(",") if s]
    unknown = [s for s in a.algorithms if s not in spardl.ALGORITHMS]
    if unknown or not a.algorithms:
        ap.error(f"--algorithms: unknown {unknown}; known: {sorted(spardl.ALGORITHMS)}")
    g = (np.random.default_rng(0).standard_t(3, a.n) * 1e-3).astype(np.float32)
    x = np.empty_like(g)
    print(f"# n = {a.n}, density {a.density}, float32, median of {a.repeat} steps (ms)")
    print("| algorithm | no reuse | reuse | no reuse | reuse | np.copyto |")
    print("|---|---|---|---|---|---|")
    for alg in a.algorithms:
        cells = [step_ms(alg, g, a.density, keep, a.repeat) for keep in (True, False) * 2]
        copy = _median_ms(lambda: np.copyto(x, g), a.repeat)
        print(f"| {alg} | " + " | ".join(f"{c:.1f}" for c in cells) + f" | {copy:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
