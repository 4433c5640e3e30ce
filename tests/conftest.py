"""Session-wide hooks: in CI, a skipped MPI, cluster or CUDA-simulator test is a failure.

With ``CI=true`` in the environment, a test marked ``mpi``, ``cluster`` or ``cudasim`` that is
skipped (a ``skipif``, a ``pytest.skip`` inside it), and a test file skipped as a whole, fail
instead, unless the reason is in tests/skip_allowlist.py (the one list of allowed skips, each
with why). Outside CI, skips are allowed and listed by ``-ra`` as usual. The counts of the runs
under mpiexec (tests/mpirun.py) are printed at the end of the session.

This file is also loaded by the runs under mpiexec (tests/mpi, tests/mpi_cudasim); their tests
carry none of these markers, and their skips are checked by the runner outside
(:func:`mpirun.run_pytest_under_mpiexec`).
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from skip_allowlist import STRICT_MARKERS, allowed, in_ci

# `make test` runs two stages side by side on shared cores: an example's wall time says nothing
# about the code under test, so no property test fails on hypothesis's per-example deadline.
settings.register_profile("spardl", deadline=None)
settings.load_profile("spardl")


def _reason(rep) -> str:
    lr = rep.longrepr
    return lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)


def _fail_the_skip(rep, what: str) -> None:
    reason = _reason(rep)
    rep.outcome = "failed"
    rep.longrepr = (
        f"CI=true: {what} was skipped ({reason}); a skip here fails unless its reason is "
        "in tests/skip_allowlist.py"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI, a skip of a test marked mpi, cluster or cudasim fails unless allowlisted."""
    outcome = yield
    rep = outcome.get_result()
    if not rep.skipped or hasattr(rep, "wasxfail") or not in_ci():
        return
    marks = sorted({m.name for m in item.iter_markers()} & set(STRICT_MARKERS))
    if marks and allowed(_reason(rep)) is None:
        _fail_the_skip(rep, f"a test marked {'/'.join(marks)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """In CI, a test file that skips itself as a whole fails unless allowlisted (its markers
    are not known: the skip comes before they are)."""
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and in_ci() and allowed(_reason(rep)) is None:
        _fail_the_skip(rep, f"the whole file {rep.nodeid}")


def pytest_terminal_summary(terminalreporter):
    """One line per run under mpiexec: what passed and what was skipped inside."""
    try:
        from mpirun import RUNS
    except ImportError:  # pragma: no cover - tests/ not on the path
        return
    if not RUNS:
        return
    terminalreporter.section("runs under mpiexec")
    for counts in RUNS:
        terminalreporter.write_line(str(counts))
        reasons: dict[str, int] = {}
        for _node, why in counts.skips:
            reasons[why] = reasons.get(why, 0) + 1
        for why, times in sorted(reasons.items()):
            note = "allowed" if allowed(why) is not None else "NOT in tests/skip_allowlist.py"
            terminalreporter.write_line(f"    {times} skipped: {why} ({note})")
