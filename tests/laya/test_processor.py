"""LayaProcessor as the engine sees it: tensors per forward batch, padding, finish, audit."""

from __future__ import annotations

import copy
import hashlib
import json

import shutil

import numpy as np
import pytest

from omnigraph.bundles import MANIFEST_NAME, pack_bundle
from omnigraph.pipelines.laya.processor import LayaProcessor
from omnigraph.pipelines.laya.sequence import PROMPT_TEMPLATE
from omnigraph.pipelines.processor import PreparedRequest, ProcessorOutputInvalid, RequestInvalid

REQUEST = {
    "state": {"ticket": "Please refund the duplicate charge.", "priority": 2},
    "questions": {
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        "team": {"type": "choice", "instructions": "Which team?",
                 "criteria": {"billing": "money matters", "shipping": "parcels", "other": None}},
        "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high"]},
    },
}


@pytest.fixture(scope="module")
def processor(laya_tiny_bundle):
    return LayaProcessor({0: laya_tiny_bundle})


def _fake_outputs(prepared: PreparedRequest, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Graph-shaped outputs: random logits, -1e4 on padded marker slots."""
    rng = np.random.default_rng(seed)
    outputs = []
    for work in prepared.calls:
        logits = rng.normal(0, 2, work["marker_pos"].shape).astype(np.float32)
        logits[~work["marker_mask"]] = -1e4
        outputs.append({"logits": logits,
                        "act_logits": rng.normal(0, 2, (len(work["qtype"]), 2)).astype(np.float32)})
    return outputs


def test_prepare_builds_bucketed_tensors_with_the_graph_dtypes(processor):
    prepared = processor.prepare(REQUEST)
    (work,) = prepared.calls
    assert {name: array.dtype for name, array in work.items()} == {
        "input_ids": np.int64, "attention_mask": np.int64, "marker_pos": np.int64,
        "marker_mask": np.bool_, "qtype": np.int64}
    rows, length = work["input_ids"].shape
    # Real rows only (the stage's batch adapter pads a call's rows), each padded in length and
    # marker slots to their buckets.
    assert rows == 3
    assert length % 16 == 0 and work["marker_pos"].shape == (3, 4)
    assert work["qtype"].tolist() == [2, 0, 1]
    assert work["marker_mask"].sum(axis=1).tolist() == [2, 3, 3]
    pad_id = processor.layout.pad_id
    assert np.all(work["input_ids"][work["attention_mask"] == 0] == pad_id)
    assert prepared.context.row_tokens == tuple(int(n) for n in work["attention_mask"].sum(axis=1))


@pytest.mark.parametrize("length, bucket", [(1, 16), (16, 16), (17, 32), (256, 256), (257, 320),
                                            (449, 512), (512, 512)])
def test_length_buckets(processor, length, bucket):
    assert processor.layout.length_bucket(length) == bucket


def test_rows_and_markers_round_up_to_powers_of_two(processor):
    layout = processor.layout
    assert [layout.rows_bucket(n) for n in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert [layout.markers_bucket(n) for n in (1, 2, 3, 33, 100)] == [2, 2, 4, 64, 128]


def test_finish_answers_every_question_in_request_order(processor):
    prepared = processor.prepare(REQUEST)
    response = processor.finish(prepared, _fake_outputs(prepared))
    assert list(response) == ["model", "answers", "usage", "audit"]
    assert response["model"] == "laya"
    assert list(response["answers"]) == ["refund", "team", "urgency"]
    assert [a["type"] for a in response["answers"].values()] == ["noul", "choice", "score"]
    assert list(response["answers"]["team"]["probabilities"]) == ["billing", "shipping", "other"]
    tokens = dict(zip(["refund", "team", "urgency"], prepared.context.row_tokens))
    assert response["usage"] == {"input_tokens": sum(tokens.values()), "output_tokens": 0}
    audit = processor.audit()
    assert response["audit"] == {"prompt_template_sha256": [audit["prompt_template_sha256"]] * 3,
                                 "allowed_token_set_hash": [audit["allowed_token_set_hash"]] * 3,
                                 "input_tokens": list(tokens.values())}  # lists in question order
    assert processor.finish(processor.prepare({**REQUEST, "model": "english"}),
                            _fake_outputs(prepared))["model"] == "english"


def test_padding_slots_do_not_change_answers(processor):
    prepared = processor.prepare(REQUEST)
    outputs = _fake_outputs(prepared)
    disturbed = copy.deepcopy(outputs)
    disturbed[0]["logits"][0, 2:] = 50.0                       # slots past the noul's two options
    disturbed[0]["logits"][1:, 3] = -50.0                      # past the 3-option questions' own
    assert processor.finish(prepared, disturbed) == processor.finish(prepared, outputs)


def test_probabilities_are_per_question(processor):
    """A question's answer depends on its own row only, never on its batch neighbours."""
    alone = {"state": REQUEST["state"], "questions": {"team": REQUEST["questions"]["team"]}}
    prepared_all, prepared_one = processor.prepare(REQUEST), processor.prepare(alone)
    outputs_all = _fake_outputs(prepared_all)
    team_row = prepared_all.context.batches[0].index(1)
    outputs_one = [{"logits": outputs_all[0]["logits"][[team_row]][:, :4],
                    "act_logits": outputs_all[0]["act_logits"][[team_row]]}]
    assert prepared_one.calls[0]["marker_pos"].shape == (1, 4)
    assert (processor.finish(prepared_one, outputs_one)["answers"]["team"]
            == processor.finish(prepared_all, outputs_all)["answers"]["team"])


MEMO_REQUESTS = [
    REQUEST,
    {"state": "I'm asking   for a refund:\n the charge (#4521) came twice, didn't it?  ",
     "questions": {"refund": REQUEST["questions"]["refund"], "team": REQUEST["questions"]["team"]}},
    {"state": [{"role": "user", "content": "café crème, s'il vous plaît [SEP] 😀"}],
     "questions": {"urgency": REQUEST["questions"]["urgency"]}},
    {"state": "refund " * 400, "questions": REQUEST["questions"]},
]


def test_remembered_encodings_build_the_same_tensors_as_cold_ones(laya_tiny_bundle, monkeypatch):
    """State pieces, head and option texts come from the tokenizer's memos once seen, question
    heads from the processor's; the tensors (ids, masks, marker positions) are bit-identical to a
    processor that remembers nothing."""
    from omnigraph.pipelines.laya import processor as processor_module
    from omnigraph.pipelines.laya import sequence

    warm = LayaProcessor({0: laya_tiny_bundle})
    monkeypatch.setattr(sequence, "_MEMO_ENTRIES", 0)
    monkeypatch.setattr(sequence, "_PIECE_MEMO_ENTRIES", 0)
    monkeypatch.setattr(processor_module, "_HEAD_MEMO_MAX_CHARS", -1)
    cold = LayaProcessor({0: laya_tiny_bundle})
    for _ in range(2):  # the second round from the warm processor's memos
        for request in MEMO_REQUESTS:
            expected, got = cold.prepare(request), warm.prepare(request)
            assert got.context.row_tokens == expected.context.row_tokens
            assert len(got.calls) == len(expected.calls)
            for got_item, expected_item in zip(got.calls, expected.calls):
                assert got_item.keys() == expected_item.keys()
                for name, array in expected_item.items():
                    assert got_item[name].dtype == array.dtype and np.array_equal(got_item[name], array), name
    assert warm._tokenizer._pieces.ids and warm._tokenizer._texts.ids and warm._heads
    assert not cold._tokenizer._pieces.ids and not cold._tokenizer._texts.ids and not cold._heads


def test_the_memo_of_question_heads_stays_bounded(laya_tiny_bundle, monkeypatch):
    from omnigraph.pipelines.laya import processor as processor_module

    monkeypatch.setattr(processor_module, "_HEAD_MEMO_ENTRIES", 2)
    processor = LayaProcessor({0: laya_tiny_bundle})
    for text in ("Refund?", "Angry?", "Late?"):
        processor.prepare({"state": "x", "questions": {"q": {"type": "noul", "instructions": text}}})
        assert len(processor._heads) <= 2
    assert [key[1] for key in processor._heads] == ["Late?"]  # full after two: it started over
    long_question = {"type": "noul", "instructions": "refund " * 300}
    processor.prepare({"state": "x", "questions": {"q": long_question}})
    assert all(key[1] != long_question["instructions"] for key in processor._heads)  # too long to keep


def test_a_request_without_questions_needs_no_forward_pass(processor):
    prepared = processor.prepare({"state": "anything", "questions": {}})
    assert prepared.calls == ()
    assert processor.finish(prepared, []) == {
        "model": "laya", "answers": {}, "usage": {"input_tokens": 0, "output_tokens": 0},
        "audit": {"prompt_template_sha256": [], "allowed_token_set_hash": [], "input_tokens": []}}


@pytest.mark.parametrize("damage, message", [
    (lambda outputs: outputs + outputs, "expected 1 outputs"),
    (lambda outputs: [{"logits": outputs[0]["logits"]}], "no 'act_logits'"),
    (lambda outputs: [{**outputs[0], "logits": outputs[0]["logits"][:, :2]}], "'logits' has shape"),
])
def test_outputs_that_do_not_fit_the_work_are_refused(processor, damage, message):
    prepared = processor.prepare(REQUEST)
    with pytest.raises(ProcessorOutputInvalid, match=message):
        processor.finish(prepared, damage(_fake_outputs(prepared)))


def test_invalid_requests_are_refused_before_any_tokenization(processor):
    request = copy.deepcopy(REQUEST)
    request["questions"]["urgency"]["criteria"] = []
    with pytest.raises(RequestInvalid) as raised:
        processor.prepare(request)
    assert raised.value.field == "questions.urgency.criteria"


def _repacked(bundle, out, **layout):
    """A copy of `bundle` whose manifest layout has `layout` changes."""
    shutil.copytree(bundle.root, out, ignore=shutil.ignore_patterns(MANIFEST_NAME))
    metadata = {key: getattr(bundle.manifest.metadata, key) for key in (
        "graph_file", "example_inputs_file", "checkpoint_revision", "precision", "exporter",
        "calibration", "validation")}
    return pack_bundle(out, component=bundle.manifest.component, graph_file=metadata.pop("graph_file"),
                       example_inputs_file=metadata.pop("example_inputs_file"),
                       metadata={**metadata, "layout": {**bundle.manifest.metadata.layout, **layout}})


def test_options_that_do_not_fit_max_len_are_refused(laya_tiny_bundle, tmp_path):
    narrow = LayaProcessor({0: _repacked(laya_tiny_bundle, tmp_path / "narrow", max_len=40)})
    with pytest.raises(RequestInvalid, match="option markers fit") as raised:
        narrow.prepare({"state": "", "questions": {"q": {
            "type": "choice", "instructions": "x", "criteria": [f"option {i}" for i in range(30)]}}})
    assert raised.value.field == "questions.q.criteria"


def test_warmup_request_is_a_real_request(processor):
    warmup = processor.warmup_request()
    prepared = processor.prepare(warmup)
    assert len(prepared.calls) == 1
    warmup["questions"].clear()                                # a copy: the next one is whole
    assert processor.warmup_request()["questions"]


def test_audit_names_what_produces_the_answers(processor, laya_tiny_bundle):
    audit = processor.audit()
    assert audit["model_hash"] == laya_tiny_bundle.manifest_sha256
    assert audit["calibration_version"] == laya_tiny_bundle.manifest.metadata.calibration["version"]
    assert audit["prompt_template_sha256"] == hashlib.sha256(PROMPT_TEMPLATE.encode()).hexdigest()
    assert audit["precision"] == laya_tiny_bundle.manifest.metadata.precision
    vocab = json.loads(laya_tiny_bundle.file("tokenizer.json").read_text())["model"]["vocab"]
    assert len(audit["allowed_token_set_hash"]) == 64 and len(vocab) > 256


@pytest.mark.parametrize("layout, message", [
    ({"pad_id": 0}, "layout pad_id"),
    ({"option_tokens": 32}, "layout option_tokens"),
    ({"marker_bucket": "multiple_of_8"}, "layout marker_bucket"),
    ({"length_multiple": 0}, "length_multiple"),
])
def test_a_layout_this_processor_cannot_build_is_refused(laya_tiny_bundle, tmp_path, layout, message):
    with pytest.raises(ValueError, match=message):
        LayaProcessor({0: _repacked(laya_tiny_bundle, tmp_path / "bundle", **layout)})


def test_a_bundle_per_stage_is_one_bundle(laya_tiny_bundle):
    with pytest.raises(ValueError, match="one bundle"):
        LayaProcessor({0: laya_tiny_bundle, 1: laya_tiny_bundle})
