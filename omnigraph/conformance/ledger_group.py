"""The ledger group: sequences of reservations against a ResourceLedger and the snapshots they leave.

`send`: `{"capacities": {constraint: amount}, "steps": [step, ...]}` where a step is one of

    {"op": "declare", "capacities": {...}, "declared_by": str}
    {"op": "reserve", "as": ref, "owner": str, "demands": {...}}
    {"op": "reserve_all", "as": [ref, ...], "requests": [[owner, {...}], ...]}
    {"op": "release" | "quarantine" | "release_quarantined", "ref": ref}
    {"op": "snapshot"}

`expect.steps` has one entry per step: `{"outcome": "accepted"}`, `{"outcome": "refused", "code": CODE,
"names"?: [...]}` (codes: `reservation_refused`, `capacity_conflict`, `invalid_state`,
`invalid_amount`), or for a snapshot `{"snapshot": {"constraints": {name: {"capacity", "held",
"quarantined", "free"}}, "reservations": [{"owner", "state", "demands"}]}}` (reservations in any
order). A refused step must change nothing: the fixtures follow refusals with snapshots.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

from omnigraph.conformance.expect import check_accepted, check_refused
from omnigraph.conformance.report import CaseFailed, CaseRunner
from omnigraph.conformance.suite import Case, FixtureInvalid, Group
from omnigraph.conformance.targets import Target


@contextlib.contextmanager
def open_runner(group: Group, target: Target) -> Iterator[CaseRunner]:
    from omnigraph.stages.errors import CapacityConflict, ReservationRefused, StageError
    from omnigraph.stages.ledger import ResourceLedger

    def refusal_code(exc: Exception) -> str | None:
        if isinstance(exc, ReservationRefused):
            return "reservation_refused"
        if isinstance(exc, CapacityConflict):
            return "capacity_conflict"
        if isinstance(exc, StageError):
            return "invalid_state"
        if isinstance(exc, ValueError):
            return "invalid_amount"
        return None

    def check(case: Case) -> None:
        steps, expected = case.send.get("steps"), case.expect.get("steps")
        if not isinstance(steps, list) or not isinstance(expected, list) or len(steps) != len(expected):
            raise FixtureInvalid(f"{case.id}: send.steps and expect.steps must be lists of the same length")
        ledger = ResourceLedger(case.send["capacities"])
        refs: dict[str, Any] = {}
        for index, (step, want) in enumerate(zip(steps, expected)):
            where = f"step {index} ({step.get('op')})"
            if step.get("op") == "snapshot":
                _compare_snapshot(ledger.snapshot(), want.get("snapshot"), where=where, case_id=case.id)
                continue
            try:
                _apply(ledger, step, refs, case_id=case.id)
            except FixtureInvalid:
                raise
            except Exception as exc:
                code = refusal_code(exc)
                if code is None:
                    raise
                try:
                    check_refused(want, code, str(exc), case_id=case.id)
                except CaseFailed as failure:
                    raise CaseFailed(f"{where}: {failure}") from None
                continue
            try:
                check_accepted(want, case_id=case.id)
            except CaseFailed as failure:
                raise CaseFailed(f"{where}: {failure}") from None

    yield check


def _apply(ledger: Any, step: Mapping[str, Any], refs: dict[str, Any], *, case_id: str) -> None:
    op = step.get("op")
    if op == "declare":
        ledger.declare_capacities(step["capacities"], declared_by=step["declared_by"])
    elif op == "reserve":
        refs[step["as"]] = ledger.reserve(step["owner"], step["demands"])
    elif op == "reserve_all":
        made = ledger.reserve_all([(owner, demands) for owner, demands in step["requests"]])
        refs.update(zip(step["as"], made, strict=True))
    elif op in ("release", "quarantine", "release_quarantined"):
        if step.get("ref") not in refs:
            raise FixtureInvalid(f"{case_id}: step {op} names unknown reservation {step.get('ref')!r}")
        getattr(ledger, op)(refs[step["ref"]])
    else:
        raise FixtureInvalid(f"{case_id}: unknown ledger op {op!r}")


def _compare_snapshot(actual: Mapping[str, Any], expected: Any, *, where: str, case_id: str) -> None:
    if not isinstance(expected, dict):
        raise FixtureInvalid(f"{case_id}: {where}: expect a {{'snapshot': ...}} entry")
    got = {
        "constraints": actual["constraints"],
        "reservations": sorted(
            ({"owner": r["owner"], "state": r["state"], "demands": r["demands"]} for r in actual["reservations"]),
            key=_canonical,
        ),
    }
    want = {"constraints": expected["constraints"], "reservations": sorted(expected["reservations"], key=_canonical)}
    if got != want:
        raise CaseFailed(f"{where}: snapshot {_canonical(got)} != expected {_canonical(want)}")


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
