"""Tests that cannot pass silently: in CI (``CI=true``) a skipped mpi/cluster/cudasim test, a file
skipped as a whole and a skip inside a run under mpiexec fail unless tests/skip_allowlist.py
lists the reason (tests/conftest.py, tests/mpirun.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from mpirun import run_pytest_under_mpiexec
from skip_allowlist import ALLOWED, allowed

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def suite(pytester):
    """A pytester folder with this suite's conftest.py and allowlist."""
    pytester.syspathinsert(TESTS)
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makeini(
        "[pytest]\nmarkers =\n    mpi: x\n    cluster: x\n    cudasim: x\n    slow: x\n"
    )
    pytester.makepyfile(
        test_some=textwrap.dedent(
            """
            import pytest

            @pytest.mark.cluster
            @pytest.mark.skipif(True, reason="needs root to drop privileges")
            def test_cluster_skipped():
                pass

            @pytest.mark.mpi
            def test_mpi_skipped_inside():
                pytest.skip("needs two ranks")

            @pytest.mark.slow
            def test_unmarked_skip():
                pytest.skip("whatever")

            def test_runs():
                pass
            """
        )
    )
    return pytester


def test_every_entry_says_why():
    assert ALLOWED
    for entry in ALLOWED:
        assert entry.pattern and len(entry.why) > 10


def test_skips_are_allowed_outside_ci(suite, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    suite.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1, skipped=3)


def test_unlisted_skips_of_marked_tests_fail_in_ci(suite, monkeypatch):
    """The cluster skip is not listed: a failure; "needs two ranks" is listed; the unmarked
    skip is not this policy's business."""
    monkeypatch.setenv("CI", "true")
    res = suite.runpytest("-p", "no:cacheprovider")
    res.assert_outcomes(passed=1, skipped=2, errors=1)
    res.stdout.fnmatch_lines(["*CI=true: a test marked cluster was skipped*"])


def test_a_file_skipped_as_a_whole_fails_in_ci(pytester, monkeypatch):
    pytester.syspathinsert(TESTS)
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makepyfile(
        test_whole="import pytest\npytest.skip('no backend', allow_module_level=True)\n"
    )
    monkeypatch.setenv("CI", "true")
    res = pytester.runpytest("-p", "no:cacheprovider")
    assert res.ret != 0
    res.stdout.fnmatch_lines(["*CI=true: the whole file*no backend*"])
    monkeypatch.delenv("CI")
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(skipped=1)


def test_allowlist_conditions():
    assert allowed("Skipped: needs two ranks") is not None
    assert allowed("teams=4 is not a new case at P=4") is not None
    assert allowed("needs root to drop privileges") is None
    assert allowed("cannot run here: no ip") is None


@pytest.mark.mpi
def test_runs_under_mpiexec_report_their_counts(tmp_path, monkeypatch):
    """A folder run under mpiexec with one pass and one unlisted skip: counted outside CI, a
    failure in CI."""
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS / 'mpi')!r})\n"
        "from mpiutil import (  # noqa\n"
        "    pytest_collectreport, pytest_runtest_logreport, pytest_runtest_makereport,\n"
        "    pytest_sessionfinish,\n)\n"
    )
    (tmp_path / "test_inner.py").write_text(
        "import pytest\n\n"
        "def test_ok():\n    pass\n\n"
        "def test_skipped():\n    pytest.skip('no such thing here')\n"
    )
    monkeypatch.delenv("CI", raising=False)
    counts = run_pytest_under_mpiexec(2, [str(tmp_path)], timeout=300)
    assert (counts.passed, counts.skipped, counts.failed) == (1, 1, 0)
    assert counts.skips[0][1] == "no such thing here"
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no such thing here"):
        run_pytest_under_mpiexec(2, [str(tmp_path)], timeout=300)
    with pytest.raises(pytest.fail.Exception, match="fewer than 5 passed"):
        monkeypatch.delenv("CI")
        run_pytest_under_mpiexec(2, [str(tmp_path)], timeout=300, min_passed=5)
