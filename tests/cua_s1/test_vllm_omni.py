"""End to end through AsyncOmni with vLLM (CPU) running the merged backbone and ONNX Runtime the head.

The reference is transformers on the bundle's backbone folder plus NumPy: the causal LM's logits
of the option letters at the last prompt position, softmaxed per question. The answers must agree
within 1e-3, usage must count prompt tokens only, concurrent requests must not mix their
questions, and bad requests must be refused whole and leave the pipeline as it was.
"""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest

from omnigraph.pipelines.processor import RequestInvalid, RequestTooLarge

from .conftest import reference_letter_probabilities

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REQUESTS = [
    {"model": "cua_s1",
     "state": '- Edit "Email" value="" required=True\n- CheckBox "I agree" checked=False\n- Button "Create account"',
     "questions": {"next": {"type": "choice", "instructions": "Create the account for jane@example.com.",
                            "criteria": {"fill": 'Fill "Email"', "tick": 'Tick "I agree"',
                                         "submit": 'Click "Create account"'}}}},
    {"state": {"window": "Invoice 日本", "rows": [{"cell": "B7", "value": 12.5}]},
     "questions": {"cells": {"type": "choice", "instructions": "Which cell holds the total?",
                             "criteria": [f"cell {i}" for i in range(26)], "option_order": list(range(25, -1, -1))},
                   "go": {"type": "choice", "instructions": {"task": "continue?"}, "criteria": [True, False]}}},
    {"state": "- Button \"OK\"\n" * 200,
     "questions": {f"q{i}": {"type": "choice", "instructions": f"Step {i}: which button?",
                             "criteria": {"ok": "OK", "cancel": "Cancel", "help": None}} for i in range(6)}},
]


def reference_response(processor, model, letter_ids: list[int], request: dict) -> dict[str, np.ndarray]:
    """Per question: the reference probabilities in option order (the prompts are the processor's,
    checked against transformers' chat template in test_prompt.py)."""
    prepared = processor.prepare(request)
    expected = {}
    for work, question in zip(prepared.calls, prepared.context.request.questions):
        by_letter = reference_letter_probabilities(model, work["prompt_token_ids"].tolist(), letter_ids,
                                                   len(question.keys))
        probabilities = np.empty(len(question.keys))
        probabilities[list(question.slot_order)] = by_letter
        expected[question.qid] = probabilities
    return expected


@pytest.fixture(scope="module")
def omni(cua_bundle):
    from omnigraph.plugin.omni import AsyncOmni

    omni = AsyncOmni(model="cua_s1", bundle=cua_bundle.root)
    try:
        yield omni
    finally:
        omni.shutdown()


@pytest.fixture(scope="module")
def reference_model(cua_bundle):
    return transformers.AutoModelForCausalLM.from_pretrained(str(cua_bundle.root / "backbone"),
                                                             dtype=torch.float32).eval()


async def _answer(omni, request: dict):
    async for output in omni.generate(request):
        return output


def test_answers_match_transformers_and_numpy(omni, cua_bundle, cua_processor, reference_model):
    async def run_all():
        return await asyncio.gather(*(_answer(omni, request) for request in REQUESTS))

    outputs = asyncio.run(run_all())
    for request, output in zip(REQUESTS, outputs):
        assert output.error is None and output.finished
        response = output.custom_output
        expected = reference_response(cua_processor, reference_model,
                                      cua_bundle.manifest.metadata.layout["letter_token_ids"], request)
        assert list(response["answers"]) == list(request["questions"])
        for qid, probabilities in expected.items():
            answer = response["answers"][qid]
            keys = list(answer["probabilities"])
            np.testing.assert_allclose([answer["probabilities"][k] for k in keys], probabilities, rtol=0, atol=1e-3)
            top, second = np.sort(probabilities)[::-1][:2]
            if top - second > 2e-3:  # a closer race may flip within the tolerance
                assert answer["choice"] == keys[int(probabilities.argmax())]
        prepared = cua_processor.prepare(request)
        assert response["usage"] == {"input_tokens": sum(len(w["prompt_token_ids"]) for w in prepared.calls),
                                     "output_tokens": 0}


def test_bad_requests_are_refused_whole_and_change_nothing(omni):
    before = asyncio.run(_answer(omni, REQUESTS[0])).custom_output
    bad = [
        ({"state": "s", "questions": {"a": {"type": "choice", "instructions": "x", "criteria": ["1", "2"]},
                                      "b": {"type": "score", "instructions": "y", "criteria": ["lo", "hi"]}}},
         RequestInvalid, "questions.b.type"),
        ({"state": "s", "questions": {"a": {"type": "choice", "instructions": "x",
                                            "criteria": [str(i) for i in range(27)]}}},
         RequestTooLarge, "questions.a.criteria"),
        ({"state": "zq" * 20_000, "questions": {"a": {"type": "choice", "instructions": "x", "criteria": ["1", "2"]}}},
         RequestTooLarge, "questions.a"),
    ]
    for request, error, field in bad:
        kept = copy.deepcopy(request)
        with pytest.raises(error) as info:
            asyncio.run(_answer(omni, request))
        assert info.value.field == field and request == kept
    assert omni.queue_depth() == 0
    after = asyncio.run(_answer(omni, REQUESTS[0])).custom_output
    assert after["answers"] == before["answers"] and after["usage"] == before["usage"]


def test_audit_names_the_bundle(omni, cua_bundle):
    audit = omni.audit()
    assert audit["prompt_template_sha256"] == cua_bundle.manifest.files["prompt_template.json"]
