"""Hypothesis stateful test under MPI: random sequences of steps, algorithms, densities, dtypes.

Every rank draws the same examples (derandomized, no database; see conftest.py), so the machine
makes the same collective calls everywhere. After every step: the output is identical on every
rank, and the conservation invariant holds for the algorithms that promise it.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from mpi4py import MPI
from mpiutil import assert_identical_everywhere, conservation_error

import spardl

#: float16: dense keeps no residual, so only its output's float16 rounding (see `conserves`).
TOL = {np.float16: 2e-3, np.float32: 2e-6, np.float64: 1e-13}


class AllreduceSteps(RuleBasedStateMachine):
    comm = MPI.COMM_WORLD

    @initialize(
        algorithm=st.sampled_from(sorted(spardl.ALGORITHMS)),
        n=st.integers(1, 400),
        density=st.sampled_from([0.001, 0.01, 0.1, 0.5, 1.0]),
        dtype=st.sampled_from([np.float16, np.float32, np.float64]),
        op=st.sampled_from(["mean", "sum"]),
    )
    def setup(self, algorithm, n, density, dtype, op):
        self.ar = spardl.make(algorithm, self.comm, n, density=density, op=op)
        self.n, self.dtype, self.op = n, dtype, op
        self.last_error = 0.0

    @rule(seed=st.integers(0, 2**20), zeros=st.booleans(), scale=st.sampled_from([1e-3, 1.0, 1e3]))
    def step(self, seed, zeros, scale):
        rng = np.random.default_rng([seed, self.comm.rank])
        if self.dtype == np.float16:
            scale = min(scale, 1.0)  # keep float16 sums of heavy tails below 65504
        g = np.clip(rng.standard_t(3, self.n), -100, 100) * scale
        g = g.astype(self.dtype)
        if zeros:
            g[rng.random(self.n) < 0.5] = 0
        x = g.astype(np.float64) + self.ar.residual.astype(np.float64)
        out = self.ar(g)
        assert_identical_everywhere(self.comm, out)
        assert out.values.dtype == self.dtype
        assert np.all(np.diff(out.indices) > 0)
        if self.ar.conserves:
            self.last_error = conservation_error(
                self.comm, x, out.to_dense().astype(np.float64), self.ar.residual, self.op
            )

    @invariant()
    def conserves(self):
        if hasattr(self, "ar"):
            tol = TOL[self.dtype]
            if self.dtype == np.float16 and self.ar.rounding_feedback:
                tol = 1e-6  # the rounding remainders are kept: float32 rounding only
            assert self.last_error <= tol, self.last_error


TestAllreduceSteps = AllreduceSteps.TestCase
TestAllreduceSteps.settings = settings(
    max_examples=25,
    stateful_step_count=4,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
