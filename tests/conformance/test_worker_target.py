"""The v1 suite against a live worker process started from a command, as a native worker would be."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from omnigraph.conformance.runner import run_suite
from omnigraph.conformance.suite import load_suite
from omnigraph.plugin.cli import main

# Two worker groups (177 cases), a dozen worker restarts for frames that end the stream.
pytestmark = pytest.mark.slow

OUR_WORKER = f"worker:{shlex.quote(sys.executable)} -m omnigraph.workers.worker"


def test_v1_passes_against_our_own_worker(conformance_reports) -> None:
    report = run_suite("v1", OUR_WORKER)
    conformance_reports.append(report)
    print(report.format_table())
    assert report.ok, report.format_table()
    counts, suite = report.counts(), load_suite("v1")
    for group in ("wire", "manifest"):  # the binary-header wire cases included: our worker announces it
        assert counts[group] == {"passed": len(suite.group(group).cases), "failed": 0, "skipped": 0}
    for group in ("ledger", "placement"):
        assert counts[group]["skipped"] == len(suite.group(group).cases)


def test_a_worker_that_accepts_byte_length_mismatches_fails(capsys: pytest.CaptureFixture) -> None:
    wrapper = Path(__file__).with_name("lenient_worker.py")
    target = f"worker:{shlex.quote(sys.executable)} {shlex.quote(str(wrapper))}"
    assert main(["conformance", "run", "--target", target, "--group", "wire"]) == 1
    printed = capsys.readouterr().out
    assert "FAILED wire.refuse.nbytes_short" in printed
    assert "answered 'result', expected an error frame with code 'byte_length_mismatch'" in printed


def test_a_command_that_is_not_a_worker_fails_every_case() -> None:
    report = run_suite("v1", f"worker:{shlex.quote(sys.executable)} -c pass", "wire")
    assert not report.ok
    assert {r.status.value for r in report.results} == {"failed"}
    assert "exited with status 0 before connecting" in report.results[0].detail
