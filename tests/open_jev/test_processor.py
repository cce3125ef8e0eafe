"""OpenJevProcessor: prompts and token ids as the reference builds them, per-question decoding, refusals."""

from __future__ import annotations

import copy
import math

import numpy as np
import onnxruntime as ort
import pytest

from omnigraph.pipelines.open_jev.processor import OpenJevProcessor
from omnigraph.pipelines.processor import ProcessorOutputInvalid, RequestInvalid, RequestTooLarge

from .conftest import assert_matches_reference

REQUEST = {
    "model": "open-jev-tiny",
    "state": {"ticket": "My parcel is late and I was billed twice.", "priority": 2},
    "questions": {
        "team": {"type": "choice", "instructions": "Which team handles it?",
                 "criteria": {"billing": "payments, refunds", "shipping": {"what": "parcels", "also": "déjà"},
                              "other": None}},
        "urgency": {"type": "score", "instructions": {"task": "How urgent?", "scale": [0, 2]},
                    "criteria": ["none", "some", {"very": True}]},
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        "angry": {"type": "noul", "instructions": "Is the customer angry?",
                  "criteria": {"True": "uses strong words", "false": ["calm", "polite"]}},
        "labels": {"type": "choice", "instructions": "Pick a tag", "criteria": ["late", "billing", 7]},
    },
}


def _split(work: dict) -> list[list[int]]:
    ends = np.cumsum(work["prompt_lengths"])
    return [ids.tolist() for ids in np.split(work["prompt_token_ids"], ends[:-1])]


def test_prompts_and_token_ids_equal_the_transformers_reference(jev_processor, jev_reference):
    """Structured values (the state, instructions, criteria) are shown as JSON with sorted keys."""
    prepared = jev_processor.prepare(REQUEST)
    expected = jev_reference.token_ids(REQUEST)
    assert len(prepared.calls) == len(REQUEST["questions"])  # one work item per question
    for work, (qid, ids) in zip(prepared.calls, expected.items()):
        assert work["prompt_token_ids"].dtype == np.int64 and work["prompt_lengths"].dtype == np.int64
        assert int(work["prompt_lengths"].sum()) == len(work["prompt_token_ids"])
        assert _split(work) == ids, qid
    assert [len(ids) for ids in expected.values()] == [3, 3, 1, 1, 3]


def test_answers_match_the_reference_scores(jev_processor, jev_reference):
    prepared = jev_processor.prepare(REQUEST)
    outputs = [{"scores": jev_reference.scores(_split(work))} for work in prepared.calls]
    response = jev_processor.finish(prepared, outputs)
    assert response["model"] == "open-jev-tiny"
    assert_matches_reference(response, REQUEST, jev_reference, tol=1e-4)
    assert response["answers"]["labels"]["probabilities"].keys() == {"late", "billing", 7}
    assert response["audit"]["input_tokens"] == [int(work["prompt_lengths"].sum()) for work in prepared.calls]
    assert response["audit"]["prompt_template_sha256"] == [jev_processor.audit()["prompt_template_sha256"]] * len(
        prepared.calls)


def _finish(processor, request, scores_by_question):
    prepared = processor.prepare(request)
    return processor.finish(prepared, [{"scores": np.asarray(s, dtype=np.float64)} for s in scores_by_question])


def test_each_question_is_normalised_over_its_own_candidates_only(jev_processor):
    request = {"state": "s", "questions": {
        "a": {"type": "choice", "instructions": "a?", "criteria": ["x", "y"]},
        "b": {"type": "choice", "instructions": "b?", "criteria": ["x", "y", "z"]},
    }}
    base = _finish(jev_processor, request, [[0.0, 1.0], [2.0, 2.0, -1.0]])
    shifted = _finish(jev_processor, request, [[50.0, 51.0], [2.0, 2.0, -1.0]])
    assert base["answers"] == shifted["answers"]  # a's scale never reaches b, nor a's own softmax
    t = jev_processor.audit()["temperature"]
    assert base["answers"]["a"]["probabilities"]["y"] == round(1 / (1 + math.exp(-1 / t)), 4)
    assert base["answers"]["b"]["choice"] == "x"  # a tie goes to the first candidate
    assert sum(base["answers"]["b"]["probabilities"].values()) == pytest.approx(1, abs=2e-4)


def test_noul_logits_are_zero_and_the_score(jev_processor):
    request = {"state": "s", "questions": {"n": {"type": "noul", "instructions": "yes?"}}}
    t = jev_processor.audit()["temperature"]
    for s in (-3.0, 0.0, 2.5):
        answer = _finish(jev_processor, request, [[s]])["answers"]["n"]
        p_true = 1 / (1 + math.exp(-s / t))
        assert answer == {"type": "noul", "noul": round(p_true, 4), "confidence": round(max(p_true, 1 - p_true), 4),
                          "answer_confidence": round(max(p_true, 1 - p_true), 4)}


def test_score_answer_is_the_expected_level_with_its_legend(jev_processor):
    request = {"state": "s", "questions": {"u": {"type": "score", "instructions": "how?",
                                                 "criteria": ["low", "mid", "high"]}}}
    answer = _finish(jev_processor, request, [[0.0, 0.0, 3.0]])["answers"]["u"]
    p = np.exp(np.array([0.0, 0.0, 3.0]) / jev_processor.audit()["temperature"])
    p /= p.sum()
    assert answer["score"] == round(float(p[1] + 2 * p[2]), 4)
    assert answer["legend"] == {"0": "low", "1": "mid", "2": "high"}
    assert answer["confidence"] == round(1 - float(-(p * np.log(p)).sum()) / math.log(3), 4)


def test_the_head_batches_several_requests_without_mixing_their_questions(jev_processor, jev_bundle):
    """As the batcher does: every question's prompts of two requests in one head call, split back."""
    first = {"state": "one", "questions": {"a": {"type": "choice", "instructions": "a?", "criteria": ["x", "y", "z"]},
                                           "b": {"type": "noul", "instructions": "b?"}}}
    second = {"state": "two", "questions": {"c": {"type": "score", "instructions": "c?", "criteria": ["0", "1"]}}}
    rng = np.random.default_rng(0)
    session = ort.InferenceSession(str(jev_bundle.graph_path), providers=["CPUExecutionProvider"])
    prepared = [jev_processor.prepare(first), jev_processor.prepare(second)]
    items = [work for p in prepared for work in p.calls]
    hidden = [rng.standard_normal((len(w["prompt_lengths"]), 128), dtype=np.float32) for w in items]
    (merged,) = session.run(["scores"], {"hidden_states": np.concatenate(hidden)})
    alone = [session.run(["scores"], {"hidden_states": h})[0] for h in hidden]
    rows = np.split(merged, np.cumsum([len(h) for h in hidden])[:-1])
    np.testing.assert_allclose(np.concatenate(rows), np.concatenate(alone), rtol=0, atol=1e-12)
    together = [jev_processor.finish(prepared[0], [{"scores": r} for r in rows[:2]]),
                jev_processor.finish(prepared[1], [{"scores": rows[2]}])]
    separately = [jev_processor.finish(prepared[0], [{"scores": r} for r in alone[:2]]),
                  jev_processor.finish(prepared[1], [{"scores": alone[2]}])]
    assert together == separately
    assert set(together[0]["answers"]) == {"a", "b"} and set(together[1]["answers"]) == {"c"}


@pytest.mark.parametrize("mutate, field", [
    (lambda r: r["questions"]["team"].update(type="rank"), "questions.team.type"),
    (lambda r: r["questions"]["refund"].update(labels={"false": "no", "true": "yes"}), "questions.refund.labels"),
    (lambda r: r["questions"]["urgency"].update(criteria={"a": 1}), "questions.urgency.criteria"),
    (lambda r: r.pop("state"), "state"),
    (lambda r: r.update(extra=1), "extra"),
])
def test_invalid_requests_name_the_field_and_change_nothing(jev_processor, mutate, field):
    request = copy.deepcopy(REQUEST)
    mutate(request)
    before = copy.deepcopy(request)
    with pytest.raises(RequestInvalid) as caught:
        jev_processor.prepare(request)
    assert caught.value.field == field
    assert request == before


def test_a_prompt_over_max_model_len_is_refused_not_truncated(jev_processor):
    words = " ".join(f"w{i}" for i in range(jev_processor.max_model_len))
    request = {"state": "short", "questions": {
        "ok": {"type": "noul", "instructions": "fine?"},
        "long": {"type": "choice", "instructions": "which?", "criteria": {"a": "short", "b": words}},
    }}
    with pytest.raises(RequestTooLarge) as caught:
        jev_processor.prepare(request)
    assert caught.value.field == "questions.long.criteria.b"
    with pytest.raises(RequestTooLarge) as caught:
        jev_processor.prepare({"state": words, "questions": {"n": {"type": "noul", "instructions": "x?"}}})
    assert caught.value.field == "questions.n"


def test_outputs_that_do_not_fit_the_work_are_a_pipeline_fault(jev_processor):
    prepared = jev_processor.prepare(REQUEST)
    good = [{"scores": np.zeros(len(w["prompt_lengths"]))} for w in prepared.calls]
    bad_outputs = [
        good[:-1],
        [*good[:-1], {"logits": np.zeros(3)}],
        [*good[:-1], {"scores": np.zeros(2)}],
        [*good[:-1], {"scores": np.zeros(3, dtype=np.float32)}],
        [*good[:-1], {"scores": np.array([0.0, np.nan, 1.0])}],
    ]
    for outputs in bad_outputs:
        with pytest.raises(ProcessorOutputInvalid):
            jev_processor.finish(prepared, outputs)


def test_an_empty_request_has_no_work(jev_processor):
    prepared = jev_processor.prepare({"state": "s", "questions": {}})
    assert prepared.calls == ()
    assert jev_processor.finish(prepared, [])["answers"] == {}


def test_warmup_request_is_valid_and_audit_names_what_answers(jev_processor, jev_bundle):
    assert len(jev_processor.prepare(jev_processor.warmup_request()).calls) == 2
    audit = jev_processor.audit()
    assert audit["model_hash"] == jev_bundle.manifest_sha256
    assert audit["prompt_template_sha256"] == jev_bundle.manifest.files["prompt_template.json"]
    assert audit["temperature"] == 1.5
    assert audit["calibration_version"] == jev_bundle.manifest.metadata.calibration["version"]


def test_the_processor_takes_only_an_open_jev_head_bundle(jev_bundle):
    with pytest.raises(ValueError, match="one bundle"):
        OpenJevProcessor({0: jev_bundle, 1: jev_bundle})
