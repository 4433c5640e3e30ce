"""The contract every algorithm of spardl.ALGORITHMS keeps, and the cases of cases/collectives.md."""

from __future__ import annotations

import numpy as np
import pytest
from mpiutil import assert_identical_everywhere, conservation_error, grads_for

import spardl

ALGS = sorted(spardl.ALGORITHMS)


@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [13, 64, 1001])
def test_density_one_is_exact_mean(comm, algorithm, dtype, n):
    grads = grads_for(comm, n, dtype, seed=n)
    ar = spardl.make(algorithm, comm, n, density=1.0)
    out = ar(grads[comm.rank])
    assert_identical_everywhere(comm, out)
    want = np.mean(np.stack(grads).astype(np.float64), axis=0)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out.to_dense(), want, rtol=tol, atol=tol)
