"""The official `openai` client, unchanged, against a real `omnigraph serve`."""

import enum
import json
import math
import typing

import httpx
import openai
import pydantic
import pytest

TICKET_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "ticket", "strict": True, "schema": {
        "type": "object",
        "properties": {
            "team": {"type": "string", "enum": ["billing", "support", "sales"],
                     "description": "Which team should handle this message?"},
            "refund": {"type": "boolean", "description": "Does the customer ask for a refund?"},
            "urgency": {"type": "integer", "minimum": 1, "maximum": 3, "description": "How urgent is it?"},
        },
        "required": ["team", "refund", "urgency"], "additionalProperties": False}},
}
MESSAGES = [{"role": "user", "content": "Please refund the duplicate charge."}]


@pytest.fixture
def client(demo_server):
    return openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="unused", max_retries=0)


def test_models_list_names_the_served_model(client):
    assert [model.id for model in client.models.list()] == ["laya"]


def test_structured_output_is_one_decision_per_property(client, demo_server):
    completion = client.chat.completions.create(model="laya", messages=MESSAGES, response_format=TICKET_FORMAT,
                                                logprobs=True, top_logprobs=3)
    answer = json.loads(completion.choices[0].message.content)
    assert answer["team"] in ("billing", "support", "sales") and isinstance(answer["refund"], bool)
    assert answer["urgency"] in (1, 2, 3)
    assert completion.choices[0].finish_reason == "stop" and completion.usage.prompt_tokens > 0

    team, refund, urgency = completion.choices[0].logprobs.content
    assert team.token == json.dumps(answer["team"]) and len(team.top_logprobs) == 3
    assert sum(math.exp(t.logprob) for t in team.top_logprobs) == pytest.approx(1.0, abs=2e-3)
    assert {t.token for t in refund.top_logprobs} == {"true", "false"}
    assert urgency.top_logprobs[0].token == str(answer["urgency"])

    # The same question on the decision route gives the same probability.
    decision = httpx.post(f"{demo_server.url}/v1/systemone", timeout=60, json={
        "state": MESSAGES[0]["content"],
        "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}}).json()
    assert math.exp(refund.logprob) == pytest.approx(
        max(decision["answers"]["refund"]["noul"], 1 - decision["answers"]["refund"]["noul"]), abs=1e-6)


def test_streaming_sends_the_same_answer_as_sse(client):
    plain = client.chat.completions.create(model="laya", messages=MESSAGES, response_format=TICKET_FORMAT)
    stream = client.chat.completions.create(model="laya", messages=MESSAGES, response_format=TICKET_FORMAT,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert json.loads(content) == json.loads(plain.choices[0].message.content)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_stream_ends_with_done(demo_server):
    with httpx.stream("POST", f"{demo_server.url}/v1/chat/completions", timeout=60, json={
            "model": "laya", "messages": MESSAGES, "response_format": TICKET_FORMAT, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


@pytest.mark.parametrize("prop, words", [({"type": "string"}, "free text"),
                                         ({"type": "integer"}, "unbounded"),
                                         ({"type": "object", "properties": {}}, "nested")])
def test_what_cannot_be_decided_is_400_in_openai_shape(client, prop, words):
    schema = {"type": "object", "properties": {"refund": {"type": "boolean"}, "note": prop}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="laya", messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    error = caught.value.body
    assert error["param"] == "response_format.json_schema.schema.properties.note" and words in error["message"]
    assert error["type"] == "invalid_request_error"


def test_no_response_format_is_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="laya", messages=MESSAGES)
    assert caught.value.body["param"] == "response_format"


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, response_format=TICKET_FORMAT)
    assert caught.value.body["code"] == "model_not_found"


def test_openai_routes_answer_body_errors_in_openai_shape(demo_server):
    response = httpx.post(f"{demo_server.url}/v1/chat/completions", content=b'{"model": NaN}',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    response = httpx.post(f"{demo_server.url}/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"})
    assert response.status_code == 415 and "error" in response.json()


class Team(str, enum.Enum):
    billing = "billing"
    support = "support"


class Ticket(pydantic.BaseModel):
    team: Team = pydantic.Field(description="Which team should handle this message?")
    refund: bool = pydantic.Field(description="Does the customer ask for a refund?")
    urgency: int = pydantic.Field(ge=1, le=3, description="How urgent is it?")
    tone: typing.Literal["calm", "angry"]


def test_the_clients_pydantic_parse_helper_works(client):
    # The client turns the model into a strict json_schema ($defs for the enum) and parses the answer back.
    completion = client.chat.completions.parse(model="laya", messages=MESSAGES, response_format=Ticket)
    ticket = completion.choices[0].message.parsed
    assert isinstance(ticket, Ticket) and 1 <= ticket.urgency <= 3 and ticket.tone in ("calm", "angry")


def test_a_question_the_model_refuses_is_400_naming_the_property(client):
    # A blank description becomes blank instructions, which the processor refuses (422 on the decision
    # route); the chat route reports it as OpenAI's 400 on the property the question came from.
    schema = {"type": "object", "properties": {"refund": {"type": "boolean", "description": "   "}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="laya", messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert caught.value.body["param"] == "response_format.json_schema.schema.properties.refund"
