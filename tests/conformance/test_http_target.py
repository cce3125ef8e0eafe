"""The v1 decision group against a live `omnigraph serve` (the embedded tiny Laya) on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Iterator

import pytest

from omnigraph.conformance.runner import run_suite
from omnigraph.conformance.suite import load_suite
from omnigraph.conformance.targets import Target, TargetInvalid, parse_target

# Starting the server exports (once) and loads the embedded bundle, then warms it up.
pytestmark = pytest.mark.slow

SHUTDOWN_GRACE_S = 20.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """`omnigraph serve` just started: the runner retries refused connections while it binds its port."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "omnigraph.plugin.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy(),
        )
    try:
        yield parse_target(f"http://127.0.0.1:{port}", listen_wait_s=60)
    finally:
        process.terminate()
        try:
            process.wait(SHUTDOWN_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        print(log_path.read_text(errors="replace")[-2000:])


def test_v1_decision_group_passes_against_omnigraph_serve(server: Target, conformance_reports) -> None:
    report = run_suite("v1", server)  # the runner waits for GET /ready first
    conformance_reports.append(report)
    print(report.format_table())
    assert report.ok, report.format_table()
    counts = report.counts()
    suite = load_suite("v1")
    assert counts["decision"] == {"passed": len(suite.group("decision").cases), "failed": 0, "skipped": 0}
    assert {group: row["skipped"] for group, row in counts.items() if group != "decision"} == {
        group: len(suite.group(group).cases) for group in ("wire", "manifest", "ledger", "placement")}


def test_a_server_answering_wrong_statuses_fails_named_cases(server: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    """Proof the decision group can fail: the same server asked through a path that 404s everything."""
    from omnigraph.conformance import decision_group

    original = decision_group._request

    def misrouted(connection_class, netloc, case):
        case = type(case)(case.id, case.description, {**case.send, "path": "/nowhere"}, case.expect)
        return original(connection_class, netloc, case)

    monkeypatch.setattr(decision_group, "_request", misrouted)
    report = run_suite("v1", server, "decision")
    failed = {r.case_id for r in report.failures}
    assert "decision.answer.noul_refund" in failed and "decision.json_nan" in failed
    assert "status 404, expected 200" in next(r.detail for r in report.failures if r.case_id == "decision.answer.noul_refund")


def test_a_dead_target_fails_the_group_at_once_with_the_reason() -> None:
    started = time.monotonic()
    report = run_suite("v1", f"http://127.0.0.1:{_free_port()}", "decision")  # nothing listens there
    assert time.monotonic() - started < 5  # not the group's 300 s ready timeout
    assert report.failures and all("nothing listens at 127.0.0.1:" in r.detail and "connection refused (" in r.detail
                                   for r in report.failures)


def test_listen_wait_retries_refused_connections_that_long_then_fails() -> None:
    started = time.monotonic()
    report = run_suite("v1", parse_target(f"http://127.0.0.1:{_free_port()}", listen_wait_s=1.5), "decision")
    assert 1.5 <= time.monotonic() - started < 10
    assert all("connection refused for 1.5 s" in r.detail for r in report.failures)
    with pytest.raises(TargetInvalid, match="listen_wait_s must be"):
        parse_target("http://127.0.0.1:1", listen_wait_s=-1)


def test_a_server_of_another_model_skips_the_answer_fixtures_with_the_reason(server: Target,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Answer fixtures belong to the demo checkpoint at fp32: a server of another checkpoint (here, the
    same server made to name another) runs the status cases and skips the answer cases, saying why."""
    from omnigraph.conformance import decision_group

    original = decision_group._get_json

    def other_checkpoint(connection_class, netloc, path):
        body = original(connection_class, netloc, path)
        if path == "/v1/models":
            body["data"][0]["avrik"]["hashes"]["checkpoint_revision"] = "sha256:" + "0" * 64
        return body

    monkeypatch.setattr(decision_group, "_get_json", other_checkpoint)
    report = run_suite("v1", server, "decision")
    answer_cases = {case.id for case in load_suite("v1").group("decision").cases if "answers" in case.expect}
    skipped = {r.case_id: r.detail for r in report.results if r.status.value == "skipped"}
    assert set(skipped) == answer_cases and not report.failures
    assert all(detail.startswith("answer fixtures belong to the synthetic tiny Laya checkpoint") and
               "this server serves checkpoint_revision sha256:000" in detail for detail in skipped.values())
