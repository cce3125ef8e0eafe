"""The v1 fixtures themselves: enough cases, well formed, and read strictly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from omnigraph.conformance.suite import GROUP_NAMES, FixtureInvalid, load_group, load_suite
from omnigraph.conformance.targets import TargetInvalid, parse_target


def test_v1_has_every_group_and_at_least_150_cases() -> None:
    suite = load_suite("v1")
    counts = {group.name: len(group.cases) for group in suite.groups}
    print(f"conformance v1: {suite.case_count} cases {counts}")
    assert tuple(counts) == GROUP_NAMES
    assert suite.case_count >= 150
    assert all(counts[name] >= 20 for name in GROUP_NAMES)


def test_wire_fixtures_cover_every_rejection_the_issue_names() -> None:
    codes = {case.expect.get("code") for case in load_suite("v1").group("wire").cases}
    assert {
        "byte_length_mismatch", "bad_shape", "payload_too_large", "unknown_dtype", "duplicate_tensor_name",
        "unknown_required_feature", "header_too_large", "truncated_frame", "stale_epoch", "stale_generation",
        "stale_instance", "malformed_header", "unsupported_version",
    } <= codes


def test_manifest_fixtures_cover_every_refusal() -> None:
    codes = {case.expect.get("code") for case in load_suite("v1").group("manifest").cases}
    assert {"hash_mismatch", "file_missing", "unlisted_file", "external_data_outside_bundle", "path_unsafe",
            "manifest_invalid"} <= codes


def test_decision_fixtures_hold_reference_answers_for_every_valid_request() -> None:
    cases = load_suite("v1").group("decision").cases
    answered = [case for case in cases if case.send.get("path") == "/v1/systemone" and case.expect["status"] == 200]
    assert len(answered) >= 10
    for case in answered:
        assert set(case.expect["answers"]) == set(case.send["json"]["questions"]), case.id
        assert case.expect["usage"]["input_tokens"] > 0
        assert case.expect["reference"].startswith("laya 0.4.15")
    assert {400, 413, 415, 422} <= {case.expect["status"] for case in cases}


def _write_group(tmp_path: Path, name: str, document: object) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return path


CASE = {"id": "ledger.one", "description": "d", "send": {}, "expect": {}}


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ('{"group": "ledger", "group": "ledger", "description": "d", "cases": []}', "duplicate key"),
        ({"group": "wire", "description": "d", "cases": [CASE]}, "named for 'ledger'"),
        ({"group": "ledger", "description": "d", "cases": []}, "non-empty list"),
        ({"group": "ledger", "description": "d", "cases": [CASE], "extra": 1}, "unknown keys ['extra']"),
        ({"group": "ledger", "description": "d", "cases": [{**CASE, "id": "wire.one"}]}, "id must look like"),
        ({"group": "ledger", "description": "d", "cases": [{**CASE, "description": " "}]}, "description"),
        ({"group": "ledger", "description": "d", "cases": [{**CASE, "send": []}]}, "'send' must be an object"),
        ('{"group": "ledger", "description": "d", "cases": [{"id": "ledger.x", "description": "d", "send": {"a": NaN}, "expect": {}}]}', "NaN"),
    ],
)
def test_malformed_group_files_are_refused(tmp_path: Path, document: object, message: str) -> None:
    with pytest.raises(FixtureInvalid, match=re.escape(message)):
        load_group(_write_group(tmp_path, "ledger", document))


def test_unknown_suite_is_refused() -> None:
    with pytest.raises(FixtureInvalid, match="no suite 'v99'"):
        load_suite("v99")


@pytest.mark.parametrize(
    ("text", "kind"),
    [("inproc", "inproc"), ("worker:'/usr/bin/python3' -m omnigraph.workers.worker", "worker"), ("http://127.0.0.1:8000", "http")],
)
def test_targets_parse(text: str, kind: str) -> None:
    assert parse_target(text).kind == kind


@pytest.mark.parametrize("text", ["local", "worker:", "http://127.0.0.1:8000/v1", "worker:'unclosed"])
def test_bad_targets_are_refused(text: str) -> None:
    with pytest.raises(TargetInvalid):
        parse_target(text)
