"""The one list of skips that may happen in CI (``CI=true``).

In CI, a skipped test marked ``mpi``, ``cluster`` or ``cudasim``, a skipped test inside a run
under mpiexec (tests/mpi, tests/mpi_cudasim: :func:`mpirun.run_pytest_under_mpiexec`) and a test
file skipped as a whole are failures unless the skip's reason matches an entry here whose
condition holds (tests/conftest.py). Every entry says why the skip is not a hole in the suite.
Outside CI, skips are reported and allowed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ALLOWED", "Allowed", "allowed", "in_ci", "STRICT_MARKERS"]

#: Markers whose skips fail a CI run unless allowed here.
STRICT_MARKERS = ("mpi", "cluster", "cudasim")


def in_ci() -> bool:
    """True when the environment says this is a CI run (``CI=true``, as CI services set)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _no_cuda_at_all() -> bool:
    """Neither the CUDA simulator nor a GPU: there is nothing to run the CUDA paths on."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        from numba import cuda

        return not cuda.is_available()
    except Exception:  # noqa: BLE001 - no numba-cuda at all
        return True


def _simulator() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@dataclass(frozen=True)
class Allowed:
    """A skip reason that may happen in CI.

    Attributes
    ----------
    pattern : str
        Regular expression, searched in the skip's reason.
    why : str
        Why this skip leaves nothing untested.
    when : callable or None
        The skip is allowed only while this returns True (None: always).
    """

    pattern: str
    why: str
    when: Callable[[], bool] | None = None

    def matches(self, reason: str) -> bool:
        """Whether ``reason`` is this allowed skip, under the present conditions."""
        return re.search(self.pattern, reason) is not None and (
            self.when is None or bool(self.when())
        )


ALLOWED = [
    # -- collective tests under mpiexec, per world size ---------------------------------------
    Allowed(
        r"needs two ranks",
        "a disagreement between ranks needs two ranks; tests/test_mpi.py also runs P = 2 … 8",
    ),
    Allowed(r"C1 is the P = 1 case", "the P = 1 case, run by the P = 1 job"),
    Allowed(
        r"teams=\S+ is not a new case at P=\d+",
        "that team count equals another one's configuration at this P (d = 1 or d = P); the "
        "world sizes where it is new run it",
    ),
    Allowed(r"teams=2 needs an even P", "run at the even world sizes (2, 4, 6, 8)"),
    Allowed(r"teams must divide P", "run at the world sizes that the team count divides"),
    # -- CUDA -----------------------------------------------------------------------------------
    Allowed(
        r"needs NUMBA_ENABLE_CUDASIM=1",
        "the plain `pytest` line of `make test` runs without the simulator; the cudasim line "
        "(NUMBA_ENABLE_CUDASIM=1) runs these tests, where this skip is not allowed",
        when=_no_cuda_at_all,
    ),
    Allowed(
        r"needs a real GPU \(too slow on the simulator\)",
        "real-GPU-only checks; on the simulator the same kernels run at small sizes",
        when=_simulator,
    ),
    Allowed(r"^a GPU is present$", "checks the error without CUDA; meaningless with a GPU"),
]


def allowed(reason: str) -> Allowed | None:
    """The allowlist entry that permits a skip with this reason now, or None.

    Parameters
    ----------
    reason : str
        The skip's reason (a leading ``"Skipped: "`` is ignored).

    Returns
    -------
    Allowed or None
    """
    reason = reason.removeprefix("Skipped: ").strip()
    for entry in ALLOWED:
        if entry.matches(reason):
            return entry
    return None
