"""Case results and the suite report: the table a person reads and the JSON a machine keeps."""

from __future__ import annotations

import enum
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnigraph.conformance.suite import Case

# How many failures are printed in full under the table (the JSON report keeps them all).
FAILURES_SHOWN = 5


class Status(str, enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


class CaseFailed(Exception):
    """Raised by a group runner: the target answered, and the answer is not the expected one."""


class CaseSkipped(Exception):
    """Raised by a group runner: the case cannot be checked on this target; the message says why."""


# Checks one case: returns when it passed, raises CaseFailed or CaseSkipped otherwise.
CaseRunner = Callable[[Case], None]


@dataclass(frozen=True)
class CaseResult:
    case_id: str
    group: str
    description: str
    status: Status
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.case_id,
            "group": self.group,
            "description": self.description,
            "status": self.status.value,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class SuiteReport:
    suite: str
    target: str
    results: tuple[CaseResult, ...]

    @property
    def ok(self) -> bool:
        """True when no case failed (skips are allowed: each one says why)."""
        return not self.failures

    @property
    def failures(self) -> tuple[CaseResult, ...]:
        return tuple(result for result in self.results if result.status is Status.FAILED)

    def counts(self) -> dict[str, dict[str, int]]:
        """{group: {"passed": n, "failed": n, "skipped": n}} in the order groups were run."""
        counts: dict[str, dict[str, int]] = {}
        for result in self.results:
            row = counts.setdefault(result.group, {status.value: 0 for status in Status})
            row[result.status.value] += 1
        return counts

    def totals(self) -> dict[str, int]:
        totals = {status.value: 0 for status in Status}
        for row in self.counts().values():
            for key, value in row.items():
                totals[key] += value
        return totals

    def format_table(self) -> str:
        """The groups with passed / failed / skipped, then the first failures and the skip reasons."""
        lines = [f"conformance suite {self.suite} against {self.target}", ""]
        header = f"{'group':<12} {'passed':>7} {'failed':>7} {'skipped':>8}"
        lines += [header, "-" * len(header)]
        for group, row in self.counts().items():
            lines.append(f"{group:<12} {row['passed']:>7} {row['failed']:>7} {row['skipped']:>8}")
        totals = self.totals()
        lines += ["-" * len(header),
                  f"{'total':<12} {totals['passed']:>7} {totals['failed']:>7} {totals['skipped']:>8}"]
        failures = self.failures
        if failures:
            lines += ["", f"first {min(len(failures), FAILURES_SHOWN)} of {len(failures)} failures:"]
            for result in failures[:FAILURES_SHOWN]:
                lines += [f"FAILED {result.case_id}: {result.description}", f"    {result.detail}"]
        skips = Counter((r.group, r.detail) for r in self.results if r.status is Status.SKIPPED)
        if skips:
            lines += ["", "skipped:"]
            for (group, reason), count in sorted(skips.items()):
                lines.append(f"  {group}: {count} case(s): {reason}")
        lines += ["", "PASS" if self.ok else "FAIL"]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "suite": self.suite,
            "target": self.target,
            "ok": self.ok,
            "counts": self.counts(),
            "totals": self.totals(),
            "results": [result.to_dict() for result in self.results],
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
