"""Shows, at the end of the test run, how many v1 cases each conformance target passed."""

from __future__ import annotations

import pytest

from omnigraph.conformance.report import SuiteReport

_REPORTS: list[SuiteReport] = []


@pytest.fixture
def conformance_reports() -> list[SuiteReport]:
    """Append a suite report here to have its counts printed in the terminal summary."""
    return _REPORTS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _REPORTS:
        return
    terminalreporter.section("conformance")
    for report in _REPORTS:
        totals = report.totals()
        terminalreporter.write_line(
            f"suite {report.suite} against {report.target}: {totals['passed']} passed, "
            f"{totals['failed']} failed, {totals['skipped']} skipped (of {len(report.results)} cases)")
