"""The OpenAI structured-output mapping: schema -> questions, answers -> assistant JSON + logprobs."""

import json
import math

import pytest

from omnigraph.plugin.api.errors import ApiError
from omnigraph.plugin.api.openai_schema import (
    completion_content,
    conversation_state,
    decision_prompt,
    parse_chat_request,
    plan_decisions,
)

TICKET = {
    "type": "object",
    "properties": {
        "department": {"type": "string", "enum": ["billing", "support", "sales"],
                       "description": "Which team should handle this?"},
        "refund": {"type": "boolean", "description": "Does the customer ask for a refund?"},
        "urgency": {"type": "integer", "minimum": 1, "maximum": 3},
    },
    "required": ["department", "refund", "urgency"],
    "additionalProperties": False,
}


def _request(schema=TICKET, **extra):
    body = {"model": "laya", "messages": [{"role": "user", "content": "Please refund the duplicate charge."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "ticket", "schema": schema}}}
    return parse_chat_request({**body, **extra})


def _refusal(schema=None, **extra) -> ApiError:
    with pytest.raises(ApiError) as caught:
        plan_decisions(_request(schema, **extra) if schema is not None else _request(**extra))
    return caught.value


def test_each_property_becomes_one_question_in_schema_order():
    chat = _request()
    prompt = decision_prompt(chat, plan_decisions(chat))
    assert prompt == {
        "state": "Please refund the duplicate charge.",
        "questions": {
            "department": {"type": "choice", "instructions": "Which team should handle this?",
                           "criteria": {"billing": None, "support": None, "sales": None}},
            "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
            "urgency": {"type": "score", "instructions": "Score `urgency` from 1 to 3", "criteria": ["1", "2", "3"]},
        },
    }


def test_pydantic_style_refs_and_optionals_unwrap():
    schema = {"$defs": {"Team": {"enum": ["a", "b"], "title": "Team", "type": "string",
                                 "description": "An enumeration."}},
              "properties": {"team": {"$ref": "#/$defs/Team", "description": "Who?"},
                             "flag": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
                             "level": {"type": ["integer", "null"], "minimum": 0, "maximum": 2}},
              "type": "object"}
    plan = plan_decisions(_request(schema))
    assert [(d.name, d.kind) for d in plan] == [("team", "choice"), ("flag", "noul"), ("level", "score")]
    assert plan[0].question["instructions"] == "Who?"


@pytest.mark.parametrize("prop, words", [
    ({"type": "string"}, "free text"),
    ({"type": "integer", "minimum": 0}, "unbounded"),
    ({"type": "integer", "minimum": 0, "maximum": 100}, "levels exceed"),
    ({"type": "number"}, "number"),
    ({"type": "object", "properties": {"x": {"type": "boolean"}}}, "nested objects"),
    ({"type": "array", "items": {"type": "boolean"}}, "arrays"),
    ({"enum": [1, 2]}, "strings"),
    ({"anyOf": [{"type": "boolean"}, {"type": "integer"}]}, "Optional"),
])
def test_what_cannot_be_decided_is_400_naming_the_property(prop, words):
    error = _refusal({"type": "object", "properties": {"ok": {"type": "boolean"}, "bad": prop}})
    assert error.status == 400
    assert error.field == "response_format.json_schema.schema.properties.bad"
    assert words in error.message


def test_no_response_format_is_400():
    with pytest.raises(ApiError) as caught:
        plan_decisions(parse_chat_request({"model": "laya", "messages": [{"role": "user", "content": "hi"}]}))
    assert caught.value.status == 400 and caught.value.field == "response_format"


def test_json_object_format_is_400():
    error = _refusal(response_format={"type": "json_object"})
    assert error.field == "response_format" and "json_object" in error.message


@pytest.mark.parametrize("extra, field", [({"n": 2}, "n"), ({"tools": [{"type": "function"}]}, "tools"),
                                          ({"messages": []}, "messages"), ({"top_logprobs": 21}, "top_logprobs")])
def test_envelope_errors_name_the_parameter(extra, field):
    with pytest.raises(ApiError) as caught:
        _request(**extra)
    assert caught.value.status == 400 and caught.value.field == field


def test_a_conversation_becomes_role_lines():
    chat = parse_chat_request({"model": "m", "messages": [
        {"role": "system", "content": "You route tickets."},
        {"role": "user", "content": [{"type": "text", "text": "Refund"}, {"type": "text", "text": "please"}]}]})
    assert conversation_state(chat.messages) == "system: You route tickets.\nuser: Refund\nplease"


def test_non_text_content_is_400():
    chat = parse_chat_request({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(ApiError) as caught:
        conversation_state(chat.messages)
    assert caught.value.field == "messages.0.content.0"


ANSWERS = {
    "department": {"type": "choice", "choice": "billing",
                   "probabilities": {"billing": 0.7, "support": 0.2, "sales": 0.1}},
    "refund": {"type": "noul", "noul": 0.8364},
    "urgency": {"type": "score", "score": 1.2, "probabilities": {"0": 0.1, "1": 0.6, "2": 0.3}},
}


def test_answers_become_the_json_object_and_logprobs():
    content, logprobs = completion_content(plan_decisions(_request()), ANSWERS, top_logprobs=2)
    assert json.loads(content) == {"department": "billing", "refund": True, "urgency": 2}
    department, refund, urgency = logprobs.content
    assert department.token == '"billing"' and department.logprob == pytest.approx(math.log(0.7))
    assert [t.token for t in department.top_logprobs] == ['"billing"', '"support"']
    assert refund.token == "true" and refund.logprob == pytest.approx(math.log(0.8364))
    assert [t.token for t in refund.top_logprobs] == ["true", "false"]
    assert urgency.token == "2" and urgency.top_logprobs[1].logprob == pytest.approx(math.log(0.3))


def test_a_zero_probability_has_openai_floor_logprob():
    answers = {**ANSWERS, "department": {**ANSWERS["department"],
                                         "probabilities": {"billing": 1.0, "support": 0.0, "sales": 0.0}}}
    _, logprobs = completion_content(plan_decisions(_request()), answers, top_logprobs=3)
    assert logprobs.content[0].top_logprobs[2].logprob == -9999.0
