"""The two answers most cases expect: accepted, or refused with a stable code and a message naming things.

`expect`: `{"outcome": "accepted"}` or `{"outcome": "refused", "code": CODE, "names"?: [words]}`,
where every word in `names` must appear in the refusal's message (a refusal must say what it
refused, e.g. the file or the tensor).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omnigraph.conformance.report import CaseFailed
from omnigraph.conformance.suite import FixtureInvalid

OUTCOMES = ("accepted", "refused")


def expected_outcome(expect: Mapping[str, Any], *, case_id: str) -> str:
    outcome = expect.get("outcome")
    if outcome not in OUTCOMES:
        raise FixtureInvalid(f"{case_id}: expect.outcome must be one of {OUTCOMES}, got {outcome!r}")
    if outcome == "refused" and not isinstance(expect.get("code"), str):
        raise FixtureInvalid(f"{case_id}: a refusal needs expect.code")
    return outcome


def check_refused(expect: Mapping[str, Any], code: str, message: str, *, case_id: str) -> None:
    """The target refused: pass only if the case expects this refusal."""
    if expected_outcome(expect, case_id=case_id) != "refused":
        raise CaseFailed(f"refused ({code}: {message}), expected accepted")
    if code != expect["code"]:
        raise CaseFailed(f"refused with code {code!r}, expected {expect['code']!r} ({message})")
    missing = [word for word in expect.get("names", []) if word not in message]
    if missing:
        raise CaseFailed(f"the refusal message does not name {missing}: {message!r}")


def check_accepted(expect: Mapping[str, Any], *, case_id: str) -> None:
    """The target accepted: pass only if the case expects that (outputs are checked by the caller)."""
    if expected_outcome(expect, case_id=case_id) != "accepted":
        raise CaseFailed(f"accepted, expected refused with code {expect['code']!r}")
