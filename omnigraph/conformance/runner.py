"""Run a fixture suite against a target and report per group: passed / failed / skipped.

Each group has a runner module (`<group>_group.py`) whose `open_runner(group, target)` is a context
manager yielding a function that checks one case: it returns when the case passed and raises
CaseFailed (the target answered wrongly) or CaseSkipped (the case cannot be checked here, and why).
Setting a group up (a worker process, generated bundles) happens once per group; a setup that fails
fails every case of the group with the reason, because a target that cannot start is not conformant.
"""

from __future__ import annotations

import sys
import traceback
from contextlib import AbstractContextManager
from pathlib import Path

from omnigraph.conformance.report import CaseFailed, CaseResult, CaseRunner, CaseSkipped, Status, SuiteReport
from omnigraph.conformance.suite import Case, FixtureInvalid, Group, load_suite
from omnigraph.conformance.targets import GROUPS_BY_KIND, Target, parse_target


class GroupNotApplicable(ValueError):
    """--group names a group that does not exist, or that the chosen kind of target does not run."""


def run_suite(suite: str = "v1", target: str | Target = "inproc", group: str | None = None) -> SuiteReport:
    """Check every case of `suite` that applies to `target` (or only `group`); never raises for a bad target answer."""
    fixtures = load_suite(suite)
    target = parse_target(target) if isinstance(target, str) else target
    if group is not None:
        if group not in (known := [g.name for g in fixtures.groups]):
            raise GroupNotApplicable(f"suite {suite} has no group {group!r} (groups: {', '.join(known)})")
        if not target.runs(group):
            raise GroupNotApplicable(
                f"group {group!r} does not apply to the {target.kind} target "
                f"(it runs: {', '.join(GROUPS_BY_KIND[target.kind])})"
            )
    results: list[CaseResult] = []
    for fixture_group in fixtures.groups:
        if group is not None and fixture_group.name != group:
            continue
        if target.runs(fixture_group.name):
            results += _run_group(fixture_group, target)
        else:
            reason = f"group {fixture_group.name} does not apply to the {target.kind} target"
            results += [_result(fixture_group, case, Status.SKIPPED, reason) for case in fixture_group.cases]
    return SuiteReport(suite=suite, target=str(target), results=tuple(results))


def run_suite_cli(*, suite: str, target: str, group: str | None, report: str | None,
                  listen_wait_s: float = 0.0) -> int:
    """`omnigraph conformance run`: print the table, write the JSON report if asked; 0 only when nothing failed."""
    outcome = run_suite(suite, parse_target(target, listen_wait_s=listen_wait_s), group)
    print(outcome.format_table())
    if report is not None:
        outcome.write_json(Path(report))
        print(f"report written to {report}", file=sys.stderr)
    return 0 if outcome.ok else 1


def _run_group(group: Group, target: Target) -> list[CaseResult]:
    results = []
    try:
        with _open_runner(group, target) as check:
            for case in group.cases:
                results.append(_check(group, case, check))
    except FixtureInvalid:
        raise  # a broken fixture is the suite's fault, not the target's: stop loudly
    except Exception as exc:  # setup or teardown of the target failed: every unchecked case fails with it
        detail = f"group setup failed: {type(exc).__name__}: {exc}"
        done = {result.case_id for result in results}
        results += [_result(group, case, Status.FAILED, detail) for case in group.cases if case.id not in done]
    return results


def _check(group: Group, case: Case, check: CaseRunner) -> CaseResult:
    try:
        check(case)
    except CaseFailed as failure:
        return _result(group, case, Status.FAILED, str(failure))
    except CaseSkipped as skip:
        return _result(group, case, Status.SKIPPED, str(skip))
    except FixtureInvalid:
        raise
    except Exception as exc:  # the target (or the runner) broke on this case: report it, go on
        where = traceback.extract_tb(exc.__traceback__)[-1]
        detail = f"unexpected {type(exc).__name__}: {exc} (at {Path(where.filename).name}:{where.lineno})"
        return _result(group, case, Status.FAILED, detail)
    return _result(group, case, Status.PASSED)


def _result(group: Group, case: Case, status: Status, detail: str = "") -> CaseResult:
    return CaseResult(case_id=case.id, group=group.name, description=case.description, status=status, detail=detail)


def _open_runner(group: Group, target: Target) -> AbstractContextManager[CaseRunner]:
    if group.name == "wire":
        from omnigraph.conformance.wire_group import open_runner
    elif group.name == "manifest":
        from omnigraph.conformance.manifest_group import open_runner
    elif group.name == "ledger":
        from omnigraph.conformance.ledger_group import open_runner
    elif group.name == "placement":
        from omnigraph.conformance.placement_group import open_runner
    elif group.name == "decision":
        from omnigraph.conformance.decision_group import open_runner
    else:  # load_suite admits only known groups
        raise AssertionError(group.name)
    return open_runner(group, target)

