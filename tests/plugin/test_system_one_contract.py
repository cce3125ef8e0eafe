"""The System One schema, as a System One SDK validates it, against a real `omnigraph serve`.

The pydantic models below are the schema written out here, on purpose not imported from omnigraph:
a response that drifts from the schema fails these tests even when the server's own models drift
with it. Strict types: a dict where a list belongs, or a string where a number belongs, is refused.
"""

from __future__ import annotations

import signal
import time
from typing import Any, Literal

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from ..serving import STARTUP_TIMEOUT_S

SHA256_HEX = 64


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class Usage(_Strict):
    input_tokens: int
    output_tokens: int


class Audit(_Strict):
    model_hash: str
    adapter_hash: str | None
    calibration_version: str
    backend: str
    precision: str
    prompt_template_sha256: list[str]
    allowed_token_set_hash: list[str]
    input_tokens: list[int]


class Answer(_Open):
    type: Literal["choice", "score", "noul"]
    confidence: float


class DecisionResponse(_Strict):
    model: str
    answers: dict[str, Answer]
    usage: Usage
    audit: Audit


class BatchAnswer(_Open):
    id: str
    answers: dict[str, Answer]


class BatchErrorBody(_Strict):
    code: str
    message: str
    field: str | None


class BatchError(_Strict):
    id: str
    error: BatchErrorBody


class BatchResponse(_Open):
    results: list[BatchAnswer | BatchError]
    total_usage: Usage


class Health(_Strict):
    status: Literal["ok"]
    model_hash: str
    calibration_version: str
    prompt_template_sha256: str
    backend: str
    precision: str


class HealthUnavailable(_Open):
    status: Literal["backend_unavailable"]
    model_hash: str | None
    calibration_version: str | None
    prompt_template_sha256: str | None
    backend: str | None
    precision: str | None


class Avrik(_Strict):
    hashes: dict[str, str | None]
    backend: str
    limits: dict[str, int | float]


class ModelEntry(_Open):
    name: str
    description: str | None
    release_date: str | None
    avrik: Avrik


class ModelList(_Open):
    data: list[ModelEntry]


QUESTIONS = {
    "team": {"type": "choice", "instructions": "Who handles this?",
             "criteria": {"billing": "invoices and charges", "support": "bugs", "sales": "new plans"}},
    "urgency": {"type": "score", "instructions": "How urgent is it?", "criteria": ["low", "mid", "high"]},
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
}
REQUEST = {"state": "I was charged twice for my invoice, please refund the duplicate.", "questions": QUESTIONS}


def _post(server, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def _decision(server, body: dict) -> DecisionResponse:
    response = _post(server, "/v1/systemone", body)
    assert response.status_code == 200, response.text
    return DecisionResponse.model_validate(response.json())


def test_a_decision_matches_the_schema_with_audit_lists_in_question_order(demo_server):
    decision = _decision(demo_server, REQUEST)
    assert list(decision.answers) == list(QUESTIONS)
    audit = decision.audit
    assert len(audit.model_hash) == SHA256_HEX and audit.adapter_hash is None  # Laya has no adapter
    for hashes in (audit.prompt_template_sha256, audit.allowed_token_set_hash):
        assert len(hashes) == len(QUESTIONS) and all(len(value) == SHA256_HEX for value in hashes)
    assert len(audit.input_tokens) == len(QUESTIONS) and all(tokens > 0 for tokens in audit.input_tokens)
    assert sum(audit.input_tokens) == decision.usage.input_tokens and decision.usage.output_tokens == 0
    assert audit.backend.startswith("onnxruntime ") and audit.precision


def test_per_question_input_tokens_follow_question_order(demo_server):
    # A longer question costs more tokens: the list follows the order the request gives them.
    short = {"type": "noul", "instructions": "Refund?"}
    long = {"type": "noul", "instructions": "Does the customer, in any words at all, ask for money back? " * 4}
    forward = _decision(demo_server, {"state": "refund please", "questions": {"a": short, "b": long}}).audit
    backward = _decision(demo_server, {"state": "refund please", "questions": {"b": long, "a": short}}).audit
    assert forward.input_tokens[0] < forward.input_tokens[1]
    assert backward.input_tokens == forward.input_tokens[::-1]


def test_a_batch_answers_every_good_state_and_an_error_entry_for_a_bad_one(demo_server):
    states = ["Refund me please.", 42, {"turns": ["where is my parcel?"]}]
    response = _post(demo_server, "/v1/systemone/batch", {"states": states, "questions": QUESTIONS})
    assert response.status_code == 200, response.text
    batch = BatchResponse.model_validate(response.json())
    first, failed, third = batch.results
    assert isinstance(first, BatchAnswer) and isinstance(third, BatchAnswer)
    assert list(first.answers) == list(QUESTIONS) and list(third.answers) == list(QUESTIONS)
    assert isinstance(failed, BatchError)
    assert failed.error.field == "state" and failed.error.code == "invalid_request" and failed.error.message
    ids = [result.id for result in batch.results]
    assert len(set(ids)) == 3 and [result_id.rsplit("-", 1)[1] for result_id in ids] == ["0", "1", "2"]
    # each answered entry carries the single route's usage and audit
    for answered in (first, third):
        assert Audit.model_validate(answered.audit).input_tokens  # type: ignore[attr-defined]
    assert batch.total_usage.input_tokens == first.usage["input_tokens"] + third.usage["input_tokens"]  # type: ignore[attr-defined]
    Audit.model_validate(response.json()["audit"])


def test_a_batch_answer_equals_the_single_answer(demo_server):
    single = _decision(demo_server, REQUEST)
    batch = BatchResponse.model_validate(
        _post(demo_server, "/v1/systemone/batch", {"states": [REQUEST["state"]], "questions": QUESTIONS}).json())
    (only,) = batch.results
    assert isinstance(only, BatchAnswer)
    assert {qid: answer.model_dump() for qid, answer in only.answers.items()} == \
        {qid: answer.model_dump() for qid, answer in single.answers.items()}


def test_health_matches_the_schema_and_the_answers_audit(demo_server):
    response = httpx.get(f"{demo_server.url}/health", timeout=10)
    assert response.status_code == 200
    health = Health.model_validate(response.json())
    audit = _decision(demo_server, REQUEST).audit
    assert health.model_hash == audit.model_hash and health.calibration_version == audit.calibration_version
    assert [health.prompt_template_sha256] * len(QUESTIONS) == audit.prompt_template_sha256
    assert (health.backend, health.precision) == (audit.backend, audit.precision)


def test_health_while_starting_and_after_a_stage_failed_matches_the_schema(start_server, demo_deploy_config):
    server = start_server("--deploy-config", str(demo_deploy_config(32, max_restarts=0)), ready=False)
    server.wait_listening()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while (response := httpx.get(f"{server.url}/health", timeout=10)).json()["status"] != "ok":
        # still starting: alive (200), the backend not yet available, nothing known of it yet
        assert response.status_code == 200 and time.monotonic() < deadline, response.text
        HealthUnavailable.model_validate(response.json())
        time.sleep(0.05)
    Health.model_validate(response.json())
    server.signal_workers(signal.SIGKILL)  # no restarts allowed: the stage fails for good
    while (response := httpx.get(f"{server.url}/health", timeout=10)).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    failed = HealthUnavailable.model_validate(response.json())
    assert failed.model_hash and failed.backend and "stage" in response.json()["reason"]


def test_models_match_the_schema_and_name_the_served_model(demo_server):
    response = httpx.get(f"{demo_server.url}/v1/models", timeout=10)
    assert response.status_code == 200
    (entry,) = ModelList.model_validate(response.json()).data
    assert entry.name == "laya" and entry.release_date is None and entry.description
    audit = _decision(demo_server, REQUEST).audit
    assert entry.avrik.hashes["model_hash"] == audit.model_hash and entry.avrik.hashes["adapter_hash"] is None
    assert entry.avrik.backend == audit.backend
    assert entry.avrik.limits["max_questions"] > 0 and entry.avrik.limits["max_batch_states"] == 64


@pytest.mark.parametrize("model", ["jev-latest", "jev-1", "english", "laya", "", "  "])
def test_a_client_model_id_naming_no_checkpoint_gets_the_served_model(demo_server, model):
    decision = _decision(demo_server, {**REQUEST, "model": model})
    assert decision.model == "laya" and list(decision.answers) == list(QUESTIONS)


@pytest.mark.parametrize("model", ["./checkpoints/english", "~/laya", "/models/laya", "org/some-model",
                                   "C:\\models\\laya", "cua_s1", "open_jev", 7])
def test_a_path_or_another_checkpoint_is_refused_naming_model(demo_server, model):
    response = _post(demo_server, "/v1/systemone", {**REQUEST, "model": model})
    assert response.status_code == 422, response.text
    assert response.json()["field"] == "model"
    batch = _post(demo_server, "/v1/systemone/batch", {"states": ["x"], "questions": QUESTIONS, "model": model})
    assert batch.status_code == 422 and batch.json()["field"] == "model"


def test_served_model_names_are_aliases_and_the_first_is_the_answered_name(start_server):
    server = start_server("--served-model-name", "english", "laya-demo")
    for model in ("english", "laya-demo", "laya", "jev-latest", None):
        body = REQUEST if model is None else {**REQUEST, "model": model}
        assert _decision(server, body).model == "english"
    entries = ModelList.model_validate(httpx.get(f"{server.url}/v1/models", timeout=10).json()).data
    assert [entry.name for entry in entries] == ["english", "laya-demo"]
    assert _post(server, "/v1/systemone", {**REQUEST, "model": "cua_s1"}).status_code == 422
    chat = _post(server, "/v1/chat/completions", {
        "model": "laya-demo", "messages": [{"role": "user", "content": "Refund?"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": {
            "type": "object", "properties": {"refund": {"type": "boolean"}}, "required": ["refund"]}}}})
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == "english"
    Audit.model_validate(chat.json()["audit"])


def test_the_schema_models_refuse_the_old_shape():
    # The shape omnigraph sent before: string hashes and input tokens keyed by question.
    old = {"model_hash": "a" * 64, "adapter_hash": None, "calibration_version": "v1", "backend": "ort",
           "precision": "fp32", "prompt_template_sha256": "b" * 64, "allowed_token_set_hash": "c" * 64,
           "input_tokens": {"refund": 12}}
    with pytest.raises(ValidationError):
        Audit.model_validate(old)
