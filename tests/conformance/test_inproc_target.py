"""The v1 suite in-process (codec, verification, ledger, placement), and proof the runner can fail."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from omnigraph.conformance.report import Status
from omnigraph.conformance.runner import GroupNotApplicable, run_suite
from omnigraph.conformance.suite import load_suite
from omnigraph.plugin.cli import main

NBYTES_CASES = {"wire.refuse.nbytes_short", "wire.refuse.nbytes_long", "wire.refuse.nbytes_wrong_itemsize"}


def _lenient_worker_module():
    spec = importlib.util.spec_from_file_location("lenient_worker", Path(__file__).with_name("lenient_worker.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_v1_passes_in_process(conformance_reports) -> None:
    report = run_suite("v1", "inproc")
    conformance_reports.append(report)
    print(report.format_table())
    assert report.ok, report.format_table()
    counts = report.counts()
    assert counts["ledger"] == {"passed": 30, "failed": 0, "skipped": 0}
    assert counts["manifest"]["passed"] == 52 and counts["placement"]["passed"] == 22
    assert counts["wire"]["passed"] >= 90
    skipped = {r.detail for r in report.results if r.status is Status.SKIPPED}
    assert "group decision does not apply to the inproc target" in skipped
    assert any("live worker" in reason for reason in skipped)


def test_cli_prints_the_table_writes_the_report_and_exits_zero(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "report.json"
    assert main(["conformance", "run", "--target", "inproc", "--group", "ledger", "--report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ledger" in printed and "PASS" in printed
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["totals"] == {"passed": 30, "failed": 0, "skipped": 0}


def test_a_decoder_that_ignores_nbytes_fails_named_cases(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr("omnigraph.workers.wire._parse_header", _lenient_worker_module().lenient_parse_header)
    assert main(["conformance", "run", "--target", "inproc", "--group", "wire"]) == 1
    printed = capsys.readouterr().out
    assert "FAIL" in printed and "FAILED wire.refuse.nbytes_short" in printed
    failed = {r.case_id for r in run_suite("v1", "inproc", "wire").failures}
    assert NBYTES_CASES <= failed
    assert all(case.startswith("wire.refuse.") for case in failed)


def test_a_verifier_that_ignores_hash_mismatches_fails_exactly_the_tamper_cases(monkeypatch: pytest.MonkeyPatch) -> None:
    from omnigraph.bundles import BundleHashMismatch, verify_bundle

    def lax_verify(path):
        try:
            return verify_bundle(path)
        except BundleHashMismatch:
            return None  # "looks fine"

    monkeypatch.setattr("omnigraph.conformance.manifest_group.verify_bundle", lax_verify)
    report = run_suite("v1", "inproc", "manifest")
    tamper_cases = {case.id for case in load_suite("v1").group("manifest").cases if case.expect.get("code") == "hash_mismatch"}
    assert len(tamper_cases) >= 5
    assert {r.case_id for r in report.failures} == tamper_cases
    assert all("accepted, expected refused with code 'hash_mismatch'" in r.detail for r in report.failures)


def test_a_ledger_that_charges_partially_fails_the_atomic_cases(monkeypatch: pytest.MonkeyPatch) -> None:
    from omnigraph.stages.ledger import ResourceLedger

    def reserve_each(self, requests):  # charges stage by stage: a late refusal leaves earlier charges
        return [reservation for owner, demands in requests for reservation in ResourceLedger.reserve_all_atomic(self, [(owner, demands)])]

    monkeypatch.setattr(ResourceLedger, "reserve_all_atomic", ResourceLedger.reserve_all, raising=False)
    monkeypatch.setattr(ResourceLedger, "reserve_all", reserve_each)
    failed = {r.case_id for r in run_suite("v1", "inproc", "ledger").failures}
    assert {"ledger.plan.one_stage_breaks_all", "ledger.plan.sum_exceeds"} <= failed


def test_a_group_the_target_does_not_run_is_an_error() -> None:
    with pytest.raises(GroupNotApplicable, match="group 'decision' does not apply to the inproc target"):
        run_suite("v1", "inproc", "decision")
    with pytest.raises(GroupNotApplicable, match="no group 'wires'"):
        run_suite("v1", "inproc", "wires")
