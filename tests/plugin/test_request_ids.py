"""X-Request-Id: a client's id comes back on the answer and in a decision error's body; without a
usable one the server makes one."""

import re

import httpx
import pytest
from starlette.requests import Request

from omnigraph.plugin.api.request_ids import engine_request_id, request_id

QUESTION = {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}
DECISION = {"state": "Please refund me.", "questions": QUESTION}
GENERATED = re.compile(r"req-[0-9a-f]{32}")


def test_a_clients_id_is_echoed_on_the_answer(demo_server):
    answer = httpx.post(f"{demo_server.url}/v1/systemone", json=DECISION, headers={"X-Request-Id": "order-77:a/b"},
                        timeout=60)
    assert answer.status_code == 200 and answer.headers["x-request-id"] == "order-77:a/b"


def test_without_one_or_with_an_unusable_one_the_server_makes_one(demo_server):
    for headers in ({}, {"X-Request-Id": "two words"}, {"X-Request-Id": "x" * 129}, {"X-Request-Id": '"quoted"'}):
        answer = httpx.post(f"{demo_server.url}/v1/systemone", json=DECISION, headers=headers, timeout=60)
        assert answer.status_code == 200 and GENERATED.fullmatch(answer.headers["x-request-id"]), headers


@pytest.mark.parametrize("body, status", [({"state": "x"}, 422), ("[1, 2", 400)])
def test_a_decision_error_carries_the_id_in_its_body_and_header(demo_server, body, status):
    content = body if isinstance(body, str) else None
    response = httpx.post(f"{demo_server.url}/v1/systemone", json=None if content else body, content=content,
                          headers={"X-Request-Id": "ticket-9", "Content-Type": "application/json"}, timeout=60)
    assert response.status_code == status
    assert response.headers["x-request-id"] == "ticket-9" and response.json()["request_id"] == "ticket-9"


def test_engine_ids_lead_with_the_request_id_and_stay_unique():
    request = Request({"type": "http", "headers": [(b"x-request-id", b"abc")]})
    first, second = engine_request_id(request), engine_request_id(request)
    assert request_id(request) == "abc" and first != second
    assert re.fullmatch(r"abc\.[0-9a-f]{8}", first)
