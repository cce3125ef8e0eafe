"""The placement group: node placement reports checked against a route's rules.

`send`: `{"target_provider", "nodes": {node: [provider, op]}, "allowed_providers",
"min_fraction_on_target"}` (empty `nodes`: a report without information, as when ORT's profile
holds no node events); `expect`: accepted, or refused with code `placement_refused` and the names
the message must contain; `fraction_on_target`, when given, must equal the report's. Runs
in-process against `omnigraph.workers.placement`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from omnigraph.conformance.expect import check_accepted, check_refused
from omnigraph.conformance.report import CaseFailed, CaseRunner
from omnigraph.conformance.suite import Case, FixtureInvalid, Group
from omnigraph.conformance.targets import Target

FRACTION_TOLERANCE = 1e-9


@contextlib.contextmanager
def open_runner(group: Group, target: Target) -> Iterator[CaseRunner]:
    from omnigraph.workers.errors import PlacementRefused
    from omnigraph.workers.placement import PlacementReport, check_placement

    def check(case: Case) -> None:
        send, expect = case.send, case.expect
        try:
            nodes = {name: (provider, op) for name, (provider, op) in send["nodes"].items()}
            report = PlacementReport.from_nodes(send["target_provider"], nodes)
            allowed, minimum = send["allowed_providers"], send["min_fraction_on_target"]
        except (KeyError, TypeError, ValueError) as exc:
            raise FixtureInvalid(
                f"{case.id}: send needs target_provider, nodes, allowed_providers, min_fraction_on_target ({exc})"
            ) from None
        fraction = expect.get("fraction_on_target")
        if fraction is not None and abs(report.fraction_on_target - fraction) > FRACTION_TOLERANCE:
            raise CaseFailed(f"fraction_on_target {report.fraction_on_target} "
                             f"!= expected {expect['fraction_on_target']}")
        try:
            check_placement(report, allowed, minimum)
        except PlacementRefused as refusal:
            check_refused(expect, refusal.code, refusal.message, case_id=case.id)
            if refusal.report is not report:
                raise CaseFailed("the refusal does not carry the report it judged") from None
            return
        check_accepted(expect, case_id=case.id)

    yield check
