"""No skip hides in CI: a pytest plugin (tests/conftest.py takes its hooks; test_skip_guard.py
loads it alone with `-p skip_guard` on planted modules).

With CI=true, a skip not listed in tests/suite_plan.py EXPECTED_SKIPS fails the run, whether a
test skips while it runs (`pytest.skip`, a fixture's `importorskip`) or a whole module skips while
it is collected (a module-level `pytest.importorskip` or `pytest.skip(..., allow_module_level=
True)`, which produces no per-test report at all: only the collector's report sees it). Everything
the project installs (the CPU kernels, the Gemma wheels, every test extra) must be there.
"""

from __future__ import annotations

import os

import pytest
from suite_plan import EXPECTED_SKIPS

PREFIX = "unexpected skip in CI (not in tests/suite_plan.py EXPECTED_SKIPS)"


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def _reason(longrepr) -> str:
    """A skip report's reason: its longrepr is (path, line, "Skipped: reason")."""
    return str(longrepr[-1]) if isinstance(longrepr, tuple) else str(longrepr)


def skip_expected(module: str, reason: str) -> bool:
    """Whether a skip of `module` (a file name) with this reason is listed in EXPECTED_SKIPS."""
    return any(module == m and fragment in reason for m, fragment in EXPECTED_SKIPS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that skips while it runs."""
    outcome = yield
    report = outcome.get_result()
    if not _in_ci() or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _reason(report.longrepr)
    if not skip_expected(item.path.name, reason):
        report.outcome = "failed"
        report.longrepr = f"{PREFIX}: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module that skips while it is collected: its report turns into a collection error as it
    is made, before any `pytest_collectreport` hook reads it (pytest's Session counts failures in
    one, and a plugin's own `pytest_collectreport` may run after it: then the error shows and the
    run still exits 0), so the run stops as on any other collection error."""
    outcome = yield
    report = outcome.get_result()
    if not _in_ci() or not report.skipped:
        return
    module = report.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    reason = _reason(report.longrepr)
    if not skip_expected(module, reason):
        report.outcome = "failed"
        report.longrepr = f"{PREFIX}: {module} skipped at collection: {reason}"
