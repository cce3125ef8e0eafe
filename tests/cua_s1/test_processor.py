"""CuaS1Processor: whole-request validation naming the field, one prompt per question, and answers
decoded from the letter logits exactly as the contract states (checked against NumPy here)."""

from __future__ import annotations

import copy
import dataclasses
import math
import re

import numpy as np
import pytest

from omnigraph.pipelines.cua_s1.processor import CuaS1Processor, allowed_token_set_hash
from omnigraph.pipelines.processor import ProcessorOutputInvalid, RequestInvalid, RequestTooLarge


def _choice(criteria, **extra) -> dict:
    return {"type": "choice", "instructions": "Choose the next action.", "criteria": criteria, **extra}


def _request(**questions) -> dict:
    return {"state": '- Button "OK"', "questions": questions}


def _logits(*values: float) -> dict[str, np.ndarray]:
    row = np.full((1, 26), 50.0, dtype=np.float32)  # letters past the options must never count
    row[0, :len(values)] = values
    return {"letter_logits": row}


@pytest.mark.parametrize("request_body, field, error", [
    (_request(q={"type": "score", "instructions": "How?", "criteria": ["a", "b"]}), "questions.q.type", RequestInvalid),
    (_request(q={"type": "noul", "instructions": "Is it?"}), "questions.q.type", RequestInvalid),
    (_request(q=_choice(["only"])), "questions.q.criteria", RequestInvalid),
    (_request(q=_choice([f"o{i}" for i in range(27)])), "questions.q.criteria", RequestTooLarge),
    (_request(q=_choice(["a", "b"], labels={"false": "n", "true": "y"})), "questions.q.labels", RequestInvalid),
    (_request(q=_choice(["a", "a"])), "questions.q.criteria.1", RequestInvalid),
    (_request(q=_choice(["a", "b"], option_order=[0, 0])), "questions.q.option_order", RequestInvalid),
    ({"questions": {"q": _choice(["a", "b"])}}, "state", RequestInvalid),
    ({**_request(q=_choice(["a", "b"])), "extra": 1}, "extra", RequestInvalid),
    # A state within the character limit whose prompt is longer than the backbone's 4096 tokens.
    ({"state": "zq" * 20_000, "questions": {"ok": _choice(["a", "b"])}}, "questions.ok", RequestTooLarge),
])
def test_invalid_requests_name_the_field(cua_processor, request_body, field, error):
    before = copy.deepcopy(request_body)
    with pytest.raises(error) as info:
        cua_processor.prepare(request_body)
    assert info.value.field == field
    assert request_body == before


def test_a_bad_question_refuses_the_whole_request(cua_processor):
    with pytest.raises(RequestInvalid, match="questions.second.type"):
        cua_processor.prepare(_request(first=_choice(["a", "b"]), second={"type": "noul", "instructions": "x"}))


def test_one_prompt_per_question_in_request_order(cua_processor):
    prepared = cua_processor.prepare(_request(b=_choice(["x", "y"]), a=_choice({"p": "go", "q": None, "r": "stay"})))
    assert len(prepared.calls) == 2
    for work in prepared.calls:
        assert set(work) == {"prompt_token_ids", "prompt_lengths"}
        assert work["prompt_lengths"].tolist() == [len(work["prompt_token_ids"])]
    assert [q.qid for q in prepared.context.request.questions] == ["b", "a"]
    assert prepared.context.request.questions[1].labels == ("go", "q", "stay")


def test_finish_is_a_softmax_over_the_questions_own_letters(cua_processor):
    prepared = cua_processor.prepare(_request(three=_choice({"fill": "Fill it", "tick": None, "submit": "Go"}),
                                              two=_choice([True, 7])))
    logits = [_logits(1.5, -0.25, 0.75), _logits(-2.0, 1.0)]
    response = cua_processor.finish(prepared, logits)
    z = np.array([1.5, -0.25, 0.75])
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    three = response["answers"]["three"]
    assert three["choice"] == "fill"
    assert three["probabilities"] == {k: round(float(v), 4) for k, v in zip(("fill", "tick", "submit"), p)}
    assert three["confidence"] == round(1 + float((p * np.log(p)).sum()) / math.log(3), 4)
    assert three["answer_confidence"] == round(float(p.max()), 4)
    two = response["answers"]["two"]
    assert two["choice"] == 7 and list(two["probabilities"]) == [True, 7]
    assert response["model"] == "cua_s1"
    assert response["usage"] == {"input_tokens": sum(len(w["prompt_token_ids"]) for w in prepared.calls),
                                 "output_tokens": 0}
    # the audit's lists follow question order; each question may answer with its own first n letters
    audit = response["audit"]
    assert audit["input_tokens"] == [len(w["prompt_token_ids"]) for w in prepared.calls]
    assert audit["prompt_template_sha256"] == [cua_processor.audit()["prompt_template_sha256"]] * 2
    ids = cua_processor._letter_ids
    assert audit["allowed_token_set_hash"] == [allowed_token_set_hash(ids[:3]), allowed_token_set_hash(ids[:2])]
    assert len(set(audit["allowed_token_set_hash"])) == 2


def test_ties_go_to_the_first_option_and_uniform_means_no_confidence(cua_processor):
    prepared = cua_processor.prepare(_request(q=_choice(["a", "b", "c", "d"])))
    answer = cua_processor.finish(prepared, [_logits(0.5, 2.0, 2.0, 0.5)])["answers"]["q"]
    assert answer["choice"] == "b"
    uniform = cua_processor.finish(prepared, [_logits(1.0, 1.0, 1.0, 1.0)])["answers"]["q"]
    assert uniform["choice"] == "a" and uniform["confidence"] == 0.0 and uniform["answer_confidence"] == 0.25


def test_option_order_maps_letters_back_to_options(cua_processor):
    prepared = cua_processor.prepare(_request(q=_choice(["first", "second", "third"], option_order=[2, 0, 1])))
    # Letter A shows "third", so the largest logit on A is an answer of "third".
    answer = cua_processor.finish(prepared, [_logits(3.0, 0.0, 1.0)])["answers"]["q"]
    assert answer["choice"] == "third"
    assert answer["probabilities"]["third"] > answer["probabilities"]["second"] > answer["probabilities"]["first"]


def test_outputs_that_do_not_fit_the_work_are_a_pipeline_fault(cua_processor):
    prepared = cua_processor.prepare(_request(q=_choice(["a", "b"])))
    with pytest.raises(ProcessorOutputInvalid, match="expected 1 outputs"):
        cua_processor.finish(prepared, [])
    with pytest.raises(ProcessorOutputInvalid, match="has no 'letter_logits'"):
        cua_processor.finish(prepared, [{"scores": np.zeros(1)}])
    with pytest.raises(ProcessorOutputInvalid, match=r"shape \(2, 26\)"):
        cua_processor.finish(prepared, [{"letter_logits": np.zeros((2, 26), np.float32)}])


def test_empty_questions_need_no_work(cua_processor):
    prepared = cua_processor.prepare({"state": "s", "questions": {}})
    assert prepared.calls == ()
    assert cua_processor.finish(prepared, [])["answers"] == {}


def test_warmup_request_is_valid_and_fresh(cua_processor):
    first = cua_processor.warmup_request()
    assert len(cua_processor.prepare(first).calls) == 1
    first["state"] = "changed"
    assert cua_processor.warmup_request()["state"] != "changed"


def test_audit_names_the_bundle_and_template(cua_processor, cua_bundle):
    audit = cua_processor.audit()
    assert audit["model_hash"] == cua_bundle.manifest_sha256
    assert audit["prompt_template_sha256"] == cua_bundle.manifest.files["prompt_template.json"]
    assert audit["precision"] == "fp32" and audit["calibration_version"]
    # the LoRA merged into the backbone is named by its adapter file's sha256
    assert audit["adapter_hash"] == cua_bundle.manifest.metadata.layout["lora"]["adapter_sha256"]
    assert audit["allowed_token_set_hash"] == allowed_token_set_hash(cua_bundle.manifest.metadata.layout[
        "letter_token_ids"])


def test_processor_refuses_other_bundles(cua_bundle):
    with pytest.raises(ValueError, match="takes one bundle"):
        CuaS1Processor({0: cua_bundle, 1: cua_bundle})


def _with_manifest(bundle, *, component=None, **layout_changes):
    """`bundle` as if its manifest said something else (the processor reads only the manifest)."""
    manifest = bundle.manifest
    metadata = dataclasses.replace(manifest.metadata, layout={**manifest.metadata.layout, **layout_changes})
    return dataclasses.replace(bundle, manifest=dataclasses.replace(
        manifest, component=component or manifest.component, metadata=metadata))


@pytest.mark.parametrize("changes, message", [
    ({"component": "open_jev.head"}, "component 'open_jev.head' is not a cua_s1.head bundle"),
    ({"head_outputs": ["scores"]}, "layout head_outputs ['scores'] is not ['letter_logits']"),
    ({"max_model_len": 0}, "layout max_model_len must be a positive integer, got 0"),
    ({"letter_token_ids": list(range(26))}, "are not the tokenizer's ids of A..Z"),
])
def test_processor_refuses_a_bundle_it_cannot_serve(cua_bundle, changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        CuaS1Processor({1: _with_manifest(cua_bundle, **changes)})
