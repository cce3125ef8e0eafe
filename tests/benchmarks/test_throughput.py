"""benchmarks/throughput.py (issue 9's benchmark): its load generator, rows and targets, and a
CPU run of every case on the tiny checkpoint, as benchmarks/gpu/throughput_run.sh runs it on the
H200 (the CUDA-only laya-cuda case skipped, saying why). No timing is asserted.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "throughput.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


throughput = _load_script()


def test_closed_loop_keeps_exactly_concurrency_requests_in_flight() -> None:
    in_flight, most = 0, 0

    async def call() -> None:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.001)
        in_flight -= 1

    load = asyncio.run(throughput.closed_loop(call, 5, seconds=0.05, warmup_s=0.01))
    assert most == 5 and in_flight == 0
    assert load.concurrency == 5 and len(load.latencies) >= 5 and load.seconds > 0


def test_load_rows_count_every_decision_of_a_request() -> None:
    load = throughput.Load(concurrency=1, latencies=[0.5, 0.5], seconds=2.0, cpu_seconds=0.064,
                           decisions_per_request=64)
    rows = {metric: (value, unit) for metric, value, unit in load.rows()}
    assert rows["decisions_per_s"] == (64.0, "1/s")      # 2 calls x 64 decisions in 2 s
    assert rows["p50_ms"] == (500.0, "ms") and rows["requests"] == (2, "count")
    assert rows["cpu_us_per_decision"] == (500.0, "us")  # 64 ms over 128 decisions


def _rows(case: str, concurrency: int, **values: float) -> list[dict]:
    return [{"case": case, "metric": metric, "value": value, "concurrency": concurrency}
            for metric, value in values.items()]


def test_cpu_targets_compare_batching_on_with_off_and_with_its_own_c1_p99() -> None:
    rows = (_rows(throughput.OFF, 32, decisions_per_s=10.0)
            + _rows(throughput.ON, 32, decisions_per_s=25.0, p99_ms=90.0)
            + _rows(throughput.ON, 1, p99_ms=20.0))
    speedup, p99 = throughput.targets(rows, "cpu")
    assert (speedup["value"], speedup["status"]) == (2.5, "met")
    assert (p99["value"], p99["status"]) == (4.5, "missed")


def test_gpu_targets_use_the_measured_bars_or_say_they_are_the_issues() -> None:
    rows = _rows(throughput.ON, 64, decisions_per_s=4000.0) + _rows(throughput.LAYA_CUDA, 64, decisions_per_s=2000.0)
    absolute, versus_cuda, versus_laya = throughput.targets(rows, "cuda")
    assert (absolute["value"], absolute["status"]) == (4000.0, "met")
    assert (versus_cuda["value"], versus_cuda["status"]) == (2.0, "met")
    assert "measured in this run" in versus_cuda["detail"]
    assert versus_laya["value"] == round(4000 / throughput.BAR_LAYA_PREDICT_BATCH_64, 3)
    assert "stated bar" in versus_laya["detail"]
    assert {row["status"] for row in throughput.targets([], "cuda")} == {"not measured"}


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path, str]:
    """Every case on CPU with the tiny checkpoint, a fraction of a second per point."""
    out = tmp_path_factory.mktemp("throughput") / "throughput.json"
    command = [sys.executable, str(SCRIPT), "--size", "tiny", "--concurrency", "1", "4", "--seconds", "0.3",
               "--warmup-s", "0", "--host-calls", "200", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text()), out, result.stdout


def _values(rows: list[dict], case: str, metric: str) -> list:
    return [row["value"] for row in rows if row["case"] == case and row["metric"] == metric]


@pytest.mark.slow
def test_omnigraph_runs_every_concurrency_with_batching_off_and_on(cpu_run) -> None:
    rows, _, _ = cpu_run
    for case in (throughput.OFF, throughput.ON):
        points = [row for row in rows if row["case"] == case and row["metric"] == "decisions_per_s"]
        assert [row["concurrency"] for row in points] == [1, 4]
        assert all(row["value"] > 0 for row in points)
        for row in points:
            assert {"device", "cpu", "versions", "date", "command", "load_average_1m"} <= row.keys()
    (off_plan,) = [row["batching"] for row in rows if row["case"] == throughput.OFF and row["metric"] == "load_s"]
    (on_plan,) = [row["batching"] for row in rows if row["case"] == throughput.ON and row["metric"] == "load_s"]
    assert off_plan["max_batch_rows"] == 1 and on_plan["max_batch_rows"] == 32  # the laya pipeline's declaration
    assert {row["replicas"] for row in rows if row["metric"] == "load_s" and "omnigraph" in row["case"]} == {1}
    assert _values(rows, f"{throughput.ON} vs off", "equal_answers") == [1]  # bit for bit on CPU fp32


@pytest.mark.slow
def test_the_comparisons_run_or_say_why_not(cpu_run) -> None:
    rows, _, _ = cpu_run
    (skipped,) = [row for row in rows if row["case"] == "laya-cuda" and row["metric"] == "status"]
    assert skipped["value"] == "skipped" and "needs CUDA" in skipped["detail"]
    assert _values(rows, "laya", "status") == ["ok"]
    (batch,) = [row for row in rows if row["case"] == throughput.LAYA_BATCH and row["metric"] == "decisions_per_s"]
    assert batch["concurrency"] == throughput.PREDICT_BATCH and batch["value"] > 0
    (drift,) = _values(rows, f"{throughput.LAYA_BATCH} vs {throughput.OFF}", "max_prob_drift")
    assert drift <= 1e-4  # the fp32 reference and the fp32 bundle, both on CPU


@pytest.mark.slow
def test_host_costs_and_the_report(cpu_run) -> None:
    rows, path, stdout = cpu_run
    prepare = [row for row in rows if row["case"] == "host prepare" and row["metric"] == "p50_us"]
    assert [row["length"] for row in prepare] == [108, throughput.HOST_COST_TOKENS]
    assert all(row["value"] > 0 and row["requests"] == 200 for row in prepare)
    # The CPU targets are read at c=32, which this run leaves out: there, and saying so.
    assert [row["status"] for row in rows if row["case"] == "target"] == ["not measured"] * 2
    report = subprocess.run([sys.executable, str(SCRIPT), "--report", str(path)], capture_output=True, text=True,
                            timeout=120)
    assert report.returncode == 0, report.stderr
    assert report.stdout == stdout
    assert "laya-cuda: status skipped laya-cuda needs CUDA" in report.stdout
