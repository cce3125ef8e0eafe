"""benchmarks/laya_gpu.py (issue 7's harness) on CPU with the tiny checkpoint.

The harness is a script, not part of the package: it is loaded from its file for its pure helpers,
and run as a command for the smoke test, exactly as the H200 driver runs it (with `--device cpu`
and a few requests). No timing is asserted, only that every case produced its rows or said why not.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "laya_gpu.py"


def _load_harness():
    spec = importlib.util.spec_from_file_location("laya_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


harness = _load_harness()


def _response(**answers: dict) -> dict:
    return {"answers": answers}


def test_percentile_is_nearest_rank() -> None:
    samples = [float(i) for i in range(1, 201)]  # 1 .. 200
    assert harness.percentile(samples, 50) == 100.0
    assert harness.percentile(samples, 99) == 198.0
    assert harness.percentile([3.0, 1.0, 2.0], 99) == 3.0
    assert harness.percentile([5.0], 50) == 5.0


def test_compare_answers_counts_drift_and_only_decisive_flips() -> None:
    reference = [_response(
        refund={"type": "noul", "noul": 0.9},
        team={"type": "choice", "probabilities": {"a": 0.5, "b": 0.495, "c": 0.005}},  # a near-tie
        urgency={"type": "score", "probabilities": {"0": 0.2, "1": 0.7, "2": 0.1}},
    )]
    candidate = [_response(
        refund={"type": "noul", "noul": 0.3},                                        # flipped
        team={"type": "choice", "probabilities": {"a": 0.49, "b": 0.505, "c": 0.005}},  # flipped, but a near-tie
        urgency={"type": "score", "probabilities": {"0": 0.2, "1": 0.7, "2": 0.1}},
    )]
    result = harness.compare_answers(reference, candidate)
    assert result == {"max_prob_drift": pytest.approx(0.6), "decision_flips": 1, "decisive_questions": 2}


def test_compare_answers_refuses_mismatched_option_counts() -> None:
    reference = [_response(team={"type": "choice", "probabilities": {"a": 0.6, "b": 0.4}})]
    candidate = [_response(team={"type": "choice", "probabilities": {"a": 0.6, "b": 0.3, "c": 0.1}})]
    with pytest.raises(ValueError, match="question 'team'"):
        harness.compare_answers(reference, candidate)


def _p50_rows(case: str, values: dict[int, float]) -> list[dict]:
    return [{"case": case, "metric": "p50_ms", "value": v, "unit": "ms", "length": length}
            for length, v in values.items()]


def test_targets_compare_the_product_with_measured_or_stated_bars() -> None:
    rows = (_p50_rows("ort-fast-graph e2e", {64: 0.5, 176: 1.0, 512: 1.2})
            + _p50_rows("laya", {64: 40.0, 176: 40.0, 512: 3.0})
            + _p50_rows("ort-bf16 engine", {512: 3.0}) + _p50_rows("ort-fast engine", {512: 1.5}))
    by_name = {(row["metric"], row["length"]): row for row in harness.targets(rows, {})}

    met = by_name[("ort-fast-graph e2e p50 <= 0.6 ms", 64)]
    assert (met["status"], met["margin"]) == ("met", 1.2)
    missed = by_name[("ort-fast-graph e2e p50 <= 0.9 ms", 176)]
    assert (missed["status"], missed["margin"]) == ("missed", 0.9)
    speedup = by_name[("laya reference p50 / ort-fast-graph e2e p50 >= 3.0x", 512)]
    assert (speedup["value"], speedup["margin"], speedup["status"]) == (2.5, 0.833, "missed")
    assert "measured in this run" in speedup["detail"]
    # laya-cuda did not run: its stated bar (4.56 ms at 512) stands in, and says so.
    versus_cuda = by_name[("laya-cuda p50 / ort-fast-graph e2e p50 > 1.0x", 512)]
    assert (versus_cuda["value"], versus_cuda["status"]) == (3.8, "met")
    assert "stated bar" in versus_cuda["detail"]
    assert by_name[("ort-bf16 engine p50 / ort-fast engine p50 >= 1.5x", 512)]["status"] == "met"


def test_drift_target_fails_on_a_decisive_flip_however_small_the_drift() -> None:
    rows = [{"case": "ort-fast e2e", "metric": "max_prob_drift", "value": 0.001, "unit": "probability"},
            {"case": "ort-fast e2e", "metric": "decision_flips", "value": 1, "unit": "count"},
            {"case": "ort-bf16 e2e", "metric": "max_prob_drift", "value": 0.001, "unit": "probability"},
            {"case": "ort-bf16 e2e", "metric": "decision_flips", "value": 0, "unit": "count"}]
    drift = {row["metric"].split()[0]: row for row in harness.targets(rows, {}) if "p_fp32" in row["metric"]}
    assert (drift["ort-fast"]["status"], drift["ort-fast"]["margin"]) == ("missed", 2.0)
    assert (drift["ort-bf16"]["status"], drift["ort-bf16"]["margin"]) == ("met", 2.0)


def test_targets_without_the_product_are_not_measured() -> None:
    statuses = {row["status"] for row in harness.targets(_p50_rows("laya", {64: 40.0}), {})}
    assert statuses == {"not measured"}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    """One harness run on CPU: the laya reference, two CUDA-only cases and the bf16 bundle."""
    out = tmp_path_factory.mktemp("laya_gpu") / "laya_gpu.json"
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--size", "tiny", "--lengths", "64",
               "--requests", "3", "--warmup", "1", "--cases", "laya", "laya-cuda", "ort-fast-graph", "ort-bf16",
               "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "ort-bf16 e2e" in result.stdout  # the report printed last
    return json.loads(out.read_text()), out


def _rows(rows: list[dict], case: str, metric: str) -> list[dict]:
    return [row for row in rows if row["case"] == case and row["metric"] == metric]


@pytest.mark.slow
def test_every_row_says_what_ran_where(smoke_run: tuple[list[dict], Path]) -> None:
    rows, _ = smoke_run
    for row in rows:
        assert {"case", "metric", "value", "unit", "device", "cpu", "versions", "date", "command"} <= row.keys()
    assert rows[0]["device"] == "cpu"
    assert rows[0]["versions"]["laya"] == "0.4.15"
    assert "--size tiny" in rows[0]["command"]
    (tokens,) = _rows(rows, "requests", "tokens")
    assert abs(tokens["value"] - 64) <= 4 and tokens["length"] == 64


@pytest.mark.slow
def test_laya_reference_is_timed_and_is_the_fp32_reference(smoke_run: tuple[list[dict], Path]) -> None:
    rows, _ = smoke_run
    (p50,) = _rows(rows, "laya", "p50_ms")
    (p99,) = _rows(rows, "laya", "p99_ms")
    assert p50["requests"] == 3 and p50["precision"] == "float32" and p99["value"] >= p50["value"] > 0
    assert p50["usage_tokens"] == p50["tokens"]  # laya counts the row as omnigraph does
    # On CPU the timed agent already runs fp32, so it matches its own fp32 reference exactly.
    assert _rows(rows, "laya", "max_prob_drift")[0]["value"] == 0.0
    assert _rows(rows, "laya", "status")[0]["value"] == "ok"


@pytest.mark.slow
def test_cuda_only_cases_are_skipped_with_the_reason(smoke_run: tuple[list[dict], Path]) -> None:
    rows, _ = smoke_run
    (laya_cuda,) = _rows(rows, "laya-cuda", "status")
    assert laya_cuda["value"] == "skipped" and "needs CUDA" in laya_cuda["detail"]
    (graph,) = _rows(rows, "ort-fast-graph", "status")
    assert graph["value"] == "skipped" and "enable_cuda_graph" in graph["detail"]
    assert not _rows(rows, "ort-fast-graph e2e", "p50_ms")


@pytest.mark.slow
def test_bundle_case_runs_engine_and_end_to_end(smoke_run: tuple[list[dict], Path]) -> None:
    rows, _ = smoke_run
    for path in ("engine", "e2e"):
        case = f"ort-bf16 {path}"
        assert _rows(rows, case, "status")[0]["value"] == "ok"
        (p50,) = _rows(rows, case, "p50_ms")
        assert p50["length"] == 64 and p50["requests"] == 3 and p50["value"] > 0
        # bf16-stored weights against the fp32 reference: small drift, no decisive flip.
        assert _rows(rows, case, "max_prob_drift")[0]["value"] <= 0.01
        assert _rows(rows, case, "decision_flips")[0]["value"] == 0
    (placement,) = _rows(rows, "ort-bf16 engine", "fraction_on_target")
    assert placement["value"] == 1.0 and placement["target"] == "CPUExecutionProvider"


@pytest.mark.slow
def test_targets_are_written_and_the_report_reads_the_json(smoke_run: tuple[list[dict], Path]) -> None:
    rows, path = smoke_run
    targets = [row for row in rows if row["case"] == "target"]
    e2e = [row for row in targets if row["metric"].startswith("ort-fast-graph e2e p50 <=")]
    assert len(e2e) == 3 and {row["status"] for row in e2e} == {"not measured"}  # no CUDA graph case on CPU
    host = [row for row in targets if " p50 - " in row["metric"]]  # issue 20: e2e - engine, http - e2e
    assert [row["length"] for row in host] == [64, 64] and {row["status"] for row in host} == {"not measured"}
    assert any(row["metric"].startswith("ort-bf16 e2e max |p - p_fp32|") for row in targets)
    report = subprocess.run([sys.executable, str(SCRIPT), "--report", str(path)], capture_output=True, text=True,
                            timeout=120)
    assert report.returncode == 0, report.stderr
    assert "laya-cuda: skipped: laya-cuda needs CUDA" in report.stdout
    assert "ort-bf16 e2e" in report.stdout
