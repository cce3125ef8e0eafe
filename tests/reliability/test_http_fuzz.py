"""Fuzz proof of the HTTP door (issue 18): 10,000 generated bodies per POST route against a real server.

Bodies are seeded mutations of a valid request of each route: values swapped for wrong types, huge
or non-finite numbers, unicode oddities, deep nesting; keys removed or added; the JSON text itself
broken (NaN, duplicate keys, lone surrogates, invalid UTF-8, truncation); odd content types; and, for
the OpenAI route, odd `json_schema`s. Every answer must be a real HTTP answer below 500 with a JSON
error body when it is an error, no connection may drop, the server must answer a good request
afterwards, and its memory must not grow by 10% once warm.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from ..serving import ServerProcess
from .http_server import start_server

BODIES_PER_ROUTE = 10_000
WARMUP_BODIES = 1_000  # per route, before the memory baseline: caches and allocator pools fill first
MAX_RSS_DRIFT = 0.10
SEED = 18

DECISION = {"model": "laya", "state": "Please refund the duplicate charge.",
            "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
                          "topic": {"type": "choice", "instructions": "What is it about?",
                                    "criteria": {"billing": "money", "shipping": None, "other": ""}},
                          "urgency": {"type": "score", "instructions": "How urgent?",
                                      "criteria": ["not", "somewhat", "very"]}}}
BATCH = {"model": "laya", "states": ["Please refund the duplicate charge.", {"turns": ["hi", "refund?"]}],
         "questions": DECISION["questions"]}
CHAT = {"model": "laya", "messages": [{"role": "system", "content": "Decide."},
                                      {"role": "user", "content": "Please refund the duplicate charge."}],
        "logprobs": True, "top_logprobs": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "decision", "schema": {
            "type": "object",
            "properties": {"refund": {"type": "boolean", "description": "Does the customer ask for a refund?"},
                           "topic": {"$ref": "#/$defs/Topic"},
                           "urgency": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "null"}]}},
            "$defs": {"Topic": {"enum": ["billing", "shipping", "other"]}}}}}}
VALID = {"/v1/systemone": DECISION, "/v1/systemone/batch": BATCH, "/v1/chat/completions": CHAT}

ODD_STRINGS = ["", " ", "\u0000", "\u202e\u0644\u0627", "e\u0301\u0301\u0301", "\U0001f4a9" * 50, "\ufeff",
               "NaN", "Infinity", "null", "true", "1", "#/$defs/Topic", "#/$defs/Missing", "../../etc/passwd",
               "x" * 70_000, "choice", "score", "noul", "boolean", "integer", "object", "laya", "jev-latest"]
ODD_NUMBERS = [0, -1, 1, 2**31, -(2**63), 10**40, 1e308, -1e-308, 0.5, 3.0, 2**53 + 1]
ODD_SCHEMAS = [{"enum": []}, {"enum": [1, "1"]}, {"enum": [True, False]}, {"enum": [None]}, {"const": {"a": 1}},
               {"type": ["integer", "null"], "minimum": 0, "maximum": 2}, {"type": "integer", "minimum": 5, "maximum": 1},
               {"type": "integer", "minimum": 0, "maximum": 10**30}, {"type": ["string", "boolean"]},
               {"anyOf": "boolean"}, {"anyOf": [{"type": "null"}]}, {"oneOf": [{"type": "boolean"}, {"type": "integer"}]},
               {"$ref": 7}, {"$ref": "#/$defs/Loop"}, {"$ref": "http://example.com/schema"}, {"type": {"deep": [1]}},
               {"type": "array", "items": {"type": "boolean"}}, {"type": "number"}, {"description": 5, "type": "boolean"}]


def _paths(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path into `value` (dict keys and list indices), the value itself first."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, prefix + (index,))


def _odd_value(rng: random.Random) -> Any:
    kind = rng.randrange(9)
    if kind == 0:
        return rng.choice(ODD_STRINGS)
    if kind == 1:
        return rng.choice(ODD_NUMBERS)
    if kind == 2:
        return rng.choice([None, True, False, [], {}])
    if kind == 3:
        return copy.deepcopy(rng.choice(ODD_SCHEMAS))
    if kind == 4:
        nested: Any = rng.choice(["leaf", 1, None])
        for _ in range(rng.randrange(2, 60)):
            nested = [nested] if rng.random() < 0.5 else {"k": nested}
        return nested
    if kind == 5:
        return [rng.choice(ODD_STRINGS[:14]) for _ in range(rng.randrange(0, 200))]
    if kind == 6:
        return {rng.choice(ODD_STRINGS[:14]) + str(i): rng.choice(ODD_NUMBERS) for i in range(rng.randrange(0, 80))}
    if kind == 7:
        return "".join(chr(rng.randrange(0x20, 0x2FFFF)) for _ in range(rng.randrange(1, 300))
                       ).encode("utf-8", "ignore").decode("utf-8", "ignore")
    return rng.choice([1, "1", True, "true", 1.5, "1.5", False, "false"])


def _mutate_structure(body: Any, rng: random.Random) -> Any:
    """Replace, remove or add one value somewhere in `body` (in place when possible)."""
    path = rng.choice(list(_paths(body)))
    if not path:
        return _odd_value(rng)
    parent = body
    for step in path[:-1]:
        parent = parent[step]
    action = rng.randrange(3)
    if action == 0 or (action == 1 and isinstance(parent, list) and len(parent) == 1):
        parent[path[-1]] = _odd_value(rng)
    elif action == 1:
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[rng.choice(ODD_STRINGS[:14] + ["extra", "model", "states", "questions", "labels", "option_order"])] = \
            _odd_value(rng)
    else:
        parent.insert(rng.randrange(len(parent) + 1), _odd_value(rng))
    return body


def _break_text(text: bytes, rng: random.Random) -> bytes:
    """Damage the JSON text itself: what a strict parser must refuse with a 400."""
    cut = rng.randrange(len(text) + 1)
    damage = rng.randrange(8)
    if damage == 0:
        return text[:cut]
    if damage == 1:
        return text[:cut] + rng.choice([b"NaN", b"-Infinity", b"\xff\xfe", b"\"\\ud800\"", b"\x00", b"}"]) + text[cut:]
    if damage == 2:
        return text.replace(b'"state"', b'"state": 1, "state"', 1)
    if damage == 3:
        depth = rng.choice([100, 1000, 5000, 50_000])
        return text.replace(b'"Decide."', b"[" * depth + b"]" * depth, 1).replace(
            b'"Please refund', b"[" * depth + b"]" * depth + b', "x', 1)
    if damage == 4:
        return text.replace(b": ", b": \"\\udfff\" ,", 1)
    if damage == 5:
        return text + rng.choice([b" trailing", b"{}", b"\n\n\n", b"\x80"])
    if damage == 6:
        return rng.choice([b"", b"null", b"[]", b"0", b"\"text\"", b"{" * 10_000])
    return text.replace(b"1", b"1e999", 1)


def _ref_chain(length: int) -> dict:
    """A chat request whose one property is `length` Optional-wrapped `$ref`s deep."""
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]} for i in range(length)}
    defs[f"d{length}"] = {"type": "boolean"}
    body = copy.deepcopy(CHAT)
    body["response_format"]["json_schema"]["schema"] = {"type": "object", "$defs": defs,
                                                        "properties": {"refund": {"$ref": "#/$defs/d0"}}}
    return body


def generate_bodies(route: str, seed: int) -> Iterator[tuple[bytes, str]]:
    """An endless, seeded stream of (body, content type) for `route`: a valid request once in 20."""
    rng = random.Random(seed)
    while True:
        body = copy.deepcopy(VALID[route])
        if route == "/v1/chat/completions" and rng.random() < 0.01:
            body = _ref_chain(rng.choice([2, 15, 16, 17, 2000]))
        content_type = "application/json"
        roll = rng.random()
        if roll >= 0.05:
            for _ in range(rng.randrange(1, 4)):
                body = _mutate_structure(body, rng)
        text = json.dumps(body, ensure_ascii=rng.random() < 0.5).encode()
        if roll > 0.8:
            text = _break_text(text, rng)
        if rng.random() < 0.03:
            content_type = rng.choice(["text/plain", "application/json; charset=latin-1", "application/x+json",
                                       "multipart/form-data; boundary=x", ""])
        yield text, content_type


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    keys = [key for key, _ in pairs]
    assert len(set(keys)) == len(keys), f"duplicate keys in a response object: {keys}"
    return dict(pairs)


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start_server(tmp_path_factory.mktemp("http-fuzz") / "server.log")
    yield process
    process.stop()


def _send_all(client: httpx.Client, route: str, bodies: Iterator[tuple[bytes, str]], count: int,
              check: Callable[[httpx.Response, bytes], None]) -> None:
    for _ in range(count):
        body, content_type = next(bodies)
        headers = {"content-type": content_type} if content_type else {}
        response = client.post(route, content=body, headers=headers)  # a dropped connection raises here
        check(response, body)


@pytest.mark.parametrize("route", list(VALID))
def test_10000_generated_bodies_get_real_answers_below_500(server: ServerProcess, route: str) -> None:
    statuses: dict[int, int] = {}

    def check(response: httpx.Response, body: bytes) -> None:
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (response.status_code, response.text[:500], body[:500])
        payload = json.loads(response.text, object_pairs_hook=_refuse_duplicate_keys)  # strict JSON out
        if response.status_code >= 400:
            message = payload["error"]["message"] if route.startswith("/v1/chat/") else payload["detail"]
            assert isinstance(message, str) and message, (response.text[:500], body[:500])

    bodies = generate_bodies(route, SEED)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        _send_all(client, route, bodies, WARMUP_BODIES, check)
        baseline = _rss_bytes(server.process.pid)
        _send_all(client, route, bodies, BODIES_PER_ROUTE - WARMUP_BODIES, check)
        final = _rss_bytes(server.process.pid)
        good = client.post(route, json=VALID[route])
    assert good.status_code == 200, good.text
    assert sum(statuses.values()) == BODIES_PER_ROUTE
    assert statuses.get(200, 0) > 0 and len(statuses) > 3, statuses  # the bodies reach both sides of validation
    drift = (final - baseline) / baseline
    print(f"{route}: {BODIES_PER_ROUTE} bodies, statuses {dict(sorted(statuses.items()))}, "
          f"RSS {baseline / 2**20:.1f} -> {final / 2**20:.1f} MiB ({drift:+.1%})")
    assert drift < MAX_RSS_DRIFT
