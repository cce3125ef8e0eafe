"""Prompt text and token ids: the processor's equal transformers' chat template on the same files.

The reference is built here, from DESIGN.md's prompt contract and `AutoTokenizer` on the bundle's
backbone folder (`apply_chat_template(..., add_generation_prompt=True)`), so a wrong line, a
wrong escape, a missed trim or an extra special token shows as a mismatch.
"""

from __future__ import annotations

import json
import re

import pytest
from tokenizers import Tokenizer

from omnigraph.pipelines.cua_s1.prompt import (
    DEFAULT_OPTION_LINE,
    DEFAULT_SYSTEM_MESSAGE,
    DEFAULT_USER_MESSAGE,
    ChatPrompter,
    PromptTemplate,
    PromptTemplateInvalid,
    letter_token_ids,
)

from .conftest import reference_messages

transformers = pytest.importorskip("transformers")

CASES = [
    # (request, per question: (goal, state, labels in letter order) as the reference shows them)
    ({"state": '- Button "Submit" @ [10, 20, 110, 44]\n- Button "Cancel"',
      "questions": {"next": {"type": "choice", "instructions": "Submit the form.",
                             "criteria": {"submit": 'Click "Submit"', "cancel": None, "wait": ""}}}},
     {"next": ("Submit the form.", '- Button "Submit" @ [10, 20, 110, 44]\n- Button "Cancel"',
               ['Click \\"Submit\\"', "cancel", "wait"])}),
    # JSON state and instructions, a list of labels, unicode, a control token in the user's text,
    # whitespace the template trims and a label holding a newline.
    ({"state": {"window": "Réglages 日本", "focused": None},
      "questions": {"q1": {"type": "choice", "instructions": {"task": "pick  one"},
                           "criteria": ["yes <|im_end|>", "no\nway", 3]},
                    "q2": {"type": "choice", "instructions": "  padded goal  ",
                           "criteria": {"a": {"nested": [1, 2]}, "b": "B"}}}},
     {"q1": ('{"task": "pick  one"}', '{"window": "Réglages 日本", "focused": null}',
             ["yes <|im_end|>", "no\\nway", "3"]),
      "q2": ("  padded goal  ", '{"window": "Réglages 日本", "focused": null}', ['{\\"nested\\": [1, 2]}', "B"])}),
    # option_order puts option 2 under letter A.
    ({"state": "screen", "questions": {"o": {"type": "choice", "instructions": "Go.",
                                             "criteria": ["first", "second", "third"], "option_order": [2, 0, 1]}}},
     {"o": ("Go.", "screen", ["third", "first", "second"])}),
    # All 26 letters.
    ({"state": "grid", "questions": {"g": {"type": "choice", "instructions": "Pick a cell.",
                                           "criteria": [f"cell {i}" for i in range(26)]}}},
     {"g": ("Pick a cell.", "grid", [f"cell {i}" for i in range(26)])}),
]


@pytest.fixture(scope="module")
def hf_tokenizer(cua_bundle):
    return transformers.AutoTokenizer.from_pretrained(str(cua_bundle.root / "backbone"))


@pytest.mark.parametrize("request_body, expected", CASES)
def test_prompt_ids_equal_transformers_chat_template(cua_processor, hf_tokenizer, request_body, expected):
    prepared = cua_processor.prepare(request_body)
    assert len(prepared.calls) == len(expected)
    for work, (qid, (goal, state, labels)) in zip(prepared.calls, expected.items()):
        messages = reference_messages(goal, state, labels)
        text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                               return_dict=False)
        assert text.endswith("<|im_start|>assistant\n<think>\n")
        assert work["prompt_token_ids"].tolist() == ids, qid
        assert work["prompt_token_ids"].dtype.name == "int64"
        assert work["prompt_lengths"].tolist() == [len(ids)]


def test_rendered_text_equals_transformers(cua_bundle, hf_tokenizer):
    template = PromptTemplate.load(cua_bundle.file("prompt_template.json"))
    prompter = ChatPrompter(template, Tokenizer.from_file(str(cua_bundle.file("backbone/tokenizer.json"))))
    labels = ['say "hi"', "tab\there"]
    messages = reference_messages("  Goal with spaces ", "tree", ['say \\"hi\\"', "tab\\there"])
    assert prompter.text("  Goal with spaces ", "tree", labels) == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_bundle_template_holds_the_documented_defaults_and_the_checkpoint_chat_template(cua_bundle, cua_checkpoint):
    data = json.loads(cua_bundle.file("prompt_template.json").read_text(encoding="utf-8"))
    tokenizer_config = json.loads((cua_checkpoint / "base" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert data["system_message"] == DEFAULT_SYSTEM_MESSAGE
    assert data["user_message"] == DEFAULT_USER_MESSAGE
    assert data["option_line"] == DEFAULT_OPTION_LINE
    assert data["chat_template"] == tokenizer_config["chat_template"]
    assert data["special_tokens"] == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def test_letters_are_single_tokens_of_the_backbone(cua_bundle, hf_tokenizer):
    tokenizer = Tokenizer.from_file(str(cua_bundle.file("backbone/tokenizer.json")))
    assert letter_token_ids(tokenizer) == hf_tokenizer.convert_tokens_to_ids(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    assert cua_bundle.manifest.metadata.layout["letter_token_ids"] == letter_token_ids(tokenizer)


@pytest.mark.parametrize("change, message", [
    ({"user_message": "Goal: {goal}\n{state}"}, "user_message: must use each of {goal}, {options}, {state}"),
    ({"user_message": "{goal} {state} {options} {extra}"}, "field {extra} is not one of"),
    ({"option_line": "{letter}. {label.__class__}"}, "field {label.__class__} is not one of"),
    ({"option_line": "{letter!r} {label}"}, "field {letter} is not one of"),
    ({"system_message": ""}, "system_message: must be a non-empty string"),
    ({"special_tokens": {"eos_token": 3}}, "special_tokens.eos_token"),
])
def test_template_refuses_bad_fields(cua_bundle, change, message):
    data = {**json.loads(cua_bundle.file("prompt_template.json").read_text(encoding="utf-8")), **change}
    with pytest.raises(PromptTemplateInvalid, match=re.escape(message)):
        PromptTemplate.from_dict(data)


def test_template_refuses_unknown_format_and_keys(cua_bundle):
    data = json.loads(cua_bundle.file("prompt_template.json").read_text(encoding="utf-8"))
    with pytest.raises(PromptTemplateInvalid, match="format"):
        PromptTemplate.from_dict({**data, "format": "other/1"})
    with pytest.raises(PromptTemplateInvalid, match="extra: not a prompt template key"):
        PromptTemplate.from_dict({**data, "extra": 1})


def test_chat_template_errors_are_the_templates(cua_bundle):
    data = json.loads(cua_bundle.file("prompt_template.json").read_text(encoding="utf-8"))
    with pytest.raises(PromptTemplateInvalid, match="chat_template: line 1"):
        ChatPrompter(PromptTemplate.from_dict({**data, "chat_template": "{% if %}"}), None)
    raising = PromptTemplate.from_dict({**data, "chat_template": "{{ raise_exception('no chat here') }}"})
    tokenizer = Tokenizer.from_file(str(cua_bundle.file("backbone/tokenizer.json")))
    with pytest.raises(Exception, match="no chat here"):
        ChatPrompter(raising, tokenizer).text("goal", "state", ["a", "b"])
