"""Cua-S1 over HTTP: a real `omnigraph serve cua_s1 --bundle ...` on 127.0.0.1 with vLLM (CPU).

Answers equal the transformers + NumPy reference within 1e-3, usage counts prompt tokens only,
and bad requests are 422 naming the field and leave the server answering as before.
"""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import pytest

from ..serving import free_port, running_server
from .conftest import reference_letter_probabilities

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REQUEST = {
    "model": "cua_s1",
    "state": '- Edit "Email" value="" required=True\n- CheckBox "I agree" checked=False\n- Button "Create account"',
    "questions": {
        "next": {"type": "choice", "instructions": "Create the account for jane@example.com.",
                 "criteria": {"fill": 'Fill "Email"', "tick": 'Tick "I agree"', "submit": 'Click "Create account"'}},
        "letters": {"type": "choice", "instructions": "Pick the cell.", "criteria": [f"cell {i}" for i in range(26)]},
    },
}


@pytest.fixture(scope="module")
def server(cua_bundle, tmp_path_factory):
    port = free_port()
    with running_server(["-m", "omnigraph.plugin.cli", "serve", "cua_s1", "--bundle", str(cua_bundle.root),
                         "--port", str(port)], port=port, ready_path="/ready",
                        log_path=tmp_path_factory.mktemp("cua-serve") / "server.log") as url:
        yield url


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/systemone", json=body, timeout=120)


def test_http_answers_match_transformers_and_numpy(server, cua_bundle, cua_processor):
    response = _post(server, REQUEST)
    assert response.status_code == 200, response.text
    body = response.json()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(cua_bundle.root / "backbone"), dtype=torch.float32)
    prepared = cua_processor.prepare(REQUEST)
    letter_ids = cua_bundle.manifest.metadata.layout["letter_token_ids"]
    for work, question in zip(prepared.calls, prepared.context.request.questions):
        expected = reference_letter_probabilities(model.eval(), work["prompt_token_ids"].tolist(), letter_ids,
                                                  len(question.keys))
        answer = body["answers"][question.qid]
        assert answer["type"] == "choice" and list(answer["probabilities"]) == [str(k) for k in question.keys]
        np.testing.assert_allclose(list(answer["probabilities"].values()), expected, rtol=0, atol=1e-3)
    assert body["usage"] == {"input_tokens": sum(len(w["prompt_token_ids"]) for w in prepared.calls),
                             "output_tokens": 0}


@pytest.mark.parametrize("body, field", [
    ({"state": "s", "questions": {"q": {"type": "noul", "instructions": "Is it?"}}}, "questions.q.type"),
    ({"state": "s", "questions": {"q": {"type": "choice", "instructions": "x", "criteria": ["only"]}}},
     "questions.q.criteria"),
    ({"state": "s", "questions": {"q": {"type": "choice", "instructions": "x",
                                        "criteria": [str(i) for i in range(27)]}}}, "questions.q.criteria"),
    ({"state": "zq" * 20_000, "questions": {"q": {"type": "choice", "instructions": "x", "criteria": ["a", "b"]}}},
     "questions.q"),
])
def test_bad_requests_are_422_and_change_nothing(server, body, field):
    before = _post(server, REQUEST).json()
    response = _post(server, body)
    assert response.status_code == 422 and response.json()["field"] == field
    after = _post(server, REQUEST).json()
    assert after["answers"] == before["answers"] and after["usage"] == before["usage"]


def test_openai_client_gets_a_choice_from_an_enum_schema(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    assert [model.id for model in client.models.list()] == ["cua_s1"]
    schema = {"type": "json_schema", "json_schema": {"name": "step", "strict": True, "schema": {
        "type": "object", "additionalProperties": False, "required": ["action"],
        "properties": {"action": {"type": "string", "enum": ["fill", "tick", "submit"],
                                  "description": "Which action comes next?"}}}}}
    completion = client.chat.completions.create(
        model="cua_s1", messages=[{"role": "user", "content": REQUEST["state"]}], response_format=schema,
        logprobs=True, top_logprobs=3)
    answer = json.loads(completion.choices[0].message.content)
    assert answer["action"] in ("fill", "tick", "submit") and completion.usage.prompt_tokens > 0
    (action,) = completion.choices[0].logprobs.content
    assert sum(math.exp(t.logprob) for t in action.top_logprobs) == pytest.approx(1.0, abs=2e-3)
    # A boolean property is a noul question, which Cua-S1 does not answer: refused as OpenAI
    # refuses a bad parameter (400), naming the property.
    refused = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
        "model": "cua_s1", "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "yes", "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}})
    assert refused.status_code == 400 and "choice questions only" in refused.json()["error"]["message"]
    assert refused.json()["error"]["param"].endswith("properties.ok")
