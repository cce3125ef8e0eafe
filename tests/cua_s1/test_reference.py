"""The whole decision on CPU without vLLM: transformers' hidden state through the exported head and
the processor gives the probabilities of the causal LM's own letter logits, and the merged backbone
answers as the base model with the adapter applied by PEFT."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from .conftest import reference_hidden_state, reference_letter_probabilities

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REQUEST = {
    "state": '- Edit "Email" value="" required=True\n- CheckBox "I agree" checked=False\n- Button "Create account"',
    "questions": {
        "next": {"type": "choice", "instructions": "Create the account for jane@example.com.",
                 "criteria": {"fill": 'Fill "Email"', "tick": 'Tick "I agree"', "submit": 'Click "Create account"'}},
        "cells": {"type": "choice", "instructions": "Which cell holds the total?",
                  "criteria": [f"cell {i}" for i in range(26)], "option_order": list(range(25, -1, -1))},
    },
}


@pytest.fixture(scope="module")
def merged_model(cua_bundle):
    return transformers.AutoModelForCausalLM.from_pretrained(str(cua_bundle.root / "backbone"),
                                                             dtype=torch.float32).eval()


def _probabilities(answer: dict) -> np.ndarray:
    return np.array(list(answer["probabilities"].values()))


def test_head_and_processor_reproduce_the_language_models_letter_probabilities(cua_bundle, cua_processor,
                                                                               merged_model):
    prepared = cua_processor.prepare(REQUEST)
    head = ort.InferenceSession(str(cua_bundle.graph_path), providers=["CPUExecutionProvider"])
    outputs = []
    for work in prepared.calls:
        hidden = reference_hidden_state(merged_model, work["prompt_token_ids"].tolist())
        (logits,) = head.run(["letter_logits"], {"hidden_states": hidden[None, :]})
        outputs.append({"letter_logits": logits})
    response = cua_processor.finish(prepared, outputs)
    letter_ids = cua_bundle.manifest.metadata.layout["letter_token_ids"]
    for work, question in zip(prepared.calls, prepared.context.request.questions):
        n = len(question.keys)
        by_letter = reference_letter_probabilities(merged_model, work["prompt_token_ids"].tolist(), letter_ids, n)
        expected = np.empty(n)
        expected[list(question.slot_order)] = by_letter
        answer = response["answers"][question.qid]
        np.testing.assert_allclose(_probabilities(answer), expected, rtol=0, atol=1.5e-4)
        assert answer["choice"] == question.keys[int(expected.argmax())]
    # The random model is not indifferent: the answers are decided by the letter rows, not uniform.
    assert response["answers"]["next"]["confidence"] > 0.01


def test_merged_backbone_answers_as_base_plus_adapter(cua_checkpoint, cua_bundle, cua_processor, merged_model):
    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(cua_checkpoint / "base"), dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, str(cua_checkpoint / "text")).eval()
    letter_ids = cua_bundle.manifest.metadata.layout["letter_token_ids"]
    work = cua_processor.prepare(REQUEST).calls[0]
    ids = work["prompt_token_ids"].tolist()
    merged = reference_letter_probabilities(merged_model, ids, letter_ids, 3)
    unmerged = reference_letter_probabilities(adapted, ids, letter_ids, 3)
    np.testing.assert_allclose(merged, unmerged, rtol=0, atol=1e-5)
    with adapted.disable_adapter():
        without = reference_letter_probabilities(adapted, ids, letter_ids, 3)
    assert np.abs(without - merged).max() > 1e-3  # the adapter changes the answer's probabilities
