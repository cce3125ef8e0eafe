"""PromptTemplate: the prompt wording as data, checked once, rendered per candidate."""

from __future__ import annotations

import json

import pytest

from omnigraph.pipelines.open_jev.prompt import (
    DEFAULT_PROMPT_TEMPLATE, PROMPT_TEMPLATE_FORMAT, PromptTemplate, PromptTemplateInvalid, content_text,
    question_prompts,
)


def test_the_default_template_renders_one_prompt_per_candidate():
    choice = question_prompts(DEFAULT_PROMPT_TEMPLATE, "S", "Which?", ["a: first", "b"])
    noul = question_prompts(DEFAULT_PROMPT_TEMPLATE, "S", "Yes?", None)
    ask = "\nIs this proposed answer correct? Answer Yes or No."
    assert choice == (f"Context:\nS\n\nQuestion: Which?\nProposed answer: a: first{ask}",
                      f"Context:\nS\n\nQuestion: Which?\nProposed answer: b{ask}")
    assert noul == ("Context:\nS\n\nQuestion: Yes?\nIs the answer to this question yes? Answer Yes or No.",)


def test_noul_criteria_follow_the_instructions():
    (prompt,) = question_prompts(DEFAULT_PROMPT_TEMPLATE, "S", "Late?", None, ("on time", "after the date"))
    assert prompt.startswith("Context:\nS\n\nQuestion: Late?\nYes means: after the date\nNo means: on time\nIs ")


def test_user_text_with_braces_is_not_a_placeholder():
    (prompt,) = question_prompts(DEFAULT_PROMPT_TEMPLATE, "{state}", "{x}?", None)
    assert prompt.startswith("Context:\n{state}\n\nQuestion: {x}?\n")


def test_structured_values_are_sorted_json_and_strings_stay_as_they_are():
    assert content_text({"z": ["é", 1], "a": None}) == '{"a": null, "z": ["é", 1]}'
    assert content_text(' {"z": 1} ') == ' {"z": 1} '
    assert content_text(3) == "3"


def test_the_json_form_round_trips_canonically():
    text = DEFAULT_PROMPT_TEMPLATE.to_json()
    assert json.loads(text)["format"] == PROMPT_TEMPLATE_FORMAT
    assert PromptTemplate.from_dict(json.loads(text)) == DEFAULT_PROMPT_TEMPLATE
    assert PromptTemplate.from_dict(json.loads(text)).to_json() == text


@pytest.mark.parametrize("change, message", [
    ({"prefix": "Context: {state}\n"}, "prefix must use the placeholders \\['instructions', 'state'\\]"),
    ({"candidate": "{candidate} {candidate}"}, "once each"),
    ({"noul": "Yes {state}?"}, "noul must use"),
    ({"noul_criteria": "{true"}, "noul_criteria"),
    ({"candidate": 3}, "candidate must be a string"),
    ({"noul": " "}, "must not be blank"),
    ({"format": "other"}, "format must be"),
    ({"extra": "x"}, "needs exactly the keys"),
])
def test_a_bad_template_is_refused_with_the_field(change, message):
    data = {**json.loads(DEFAULT_PROMPT_TEMPLATE.to_json()), **change}
    with pytest.raises(PromptTemplateInvalid, match=message):
        PromptTemplate.from_dict(data)
