"""The decision group: HTTP requests to a server and the status (and answers) each must get.

`send`: `{"method"?: "POST", "path": "/v1/systemone", "content_type"?: str | null,` and one body:
`"json": value` (serialised compactly), `"text": str` (sent as UTF-8, surrogates kept as their
bytes), `"hex": str` (raw bytes), or `"repeat": {"prefix", "unit", "times", "suffix"}` (a large text
body built here)`}`. `content_type` defaults to `application/json` when a body is sent; null
sends none.

`setup`: `{"ready_path", "ready_timeout_s", "answers_for"?}`: before the first case the runner polls
GET ready_path until it answers 200 (a server answers 503 while it warms up), failing the group if
it never does; a target where nothing listens (connections refused for longer than the target's
`listen_wait_s`, by default at the first refusal) fails it at once. `answers_for`: `{"model",
"checkpoint_revision", "precision"}`, the model the expected answers were produced on: the runner
reads the served model's
`avrik.hashes.checkpoint_revision` (GET /v1/models) and `precision` (GET /health) first, and a
server that serves another model, or does not say which, has every case that expects answers
skipped with that reason (the status cases still run).

`expect`: `{"status": int, "field"?: str}` where `field` is the dotted input the error body must
blame; for a 200 from `/v1/systemone` also `"answers"` and `"usage"` as the reference produced
them (see README: generated once with the `laya` package on the synthetic tiny checkpoint),
compared within `tolerance` (numbers) and exactly (answer labels, types, keys).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from omnigraph.conformance.report import CaseFailed, CaseRunner, CaseSkipped
from omnigraph.conformance.suite import Case, FixtureInvalid, Group
from omnigraph.conformance.targets import Target

# Why: the first request may wait for a cold worker; none of these takes long on a warm server.
REQUEST_TIMEOUT_S = 120.0
JSON_CONTENT_TYPE = "application/json"
READY_POLL_S = 0.5


class ServerNotReady(RuntimeError):
    """The server did not report ready within the group's ready_timeout_s."""


@contextlib.contextmanager
def open_runner(group: Group, target: Target) -> Iterator[CaseRunner]:
    parts = urlsplit(target.base_url)
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    _wait_ready(connection_class, parts.netloc, group.setup["ready_path"], group.setup["ready_timeout_s"],
                target.listen_wait_s)
    answers_for = group.setup.get("answers_for")
    other_model = None if answers_for is None else _other_model(connection_class, parts.netloc, answers_for)

    def check(case: Case) -> None:
        if other_model is not None and "answers" in case.expect:
            raise CaseSkipped(other_model)
        status, body = _request(connection_class, parts.netloc, case)
        _check_response(case, status, body)

    yield check


def _other_model(connection_class: type, netloc: str, answers_for: Any) -> str | None:
    """Why the group's answer fixtures do not apply to the served model (None: they do)."""
    if not isinstance(answers_for, dict) or set(answers_for) != {"model", "checkpoint_revision", "precision"}:
        raise FixtureInvalid("setup.answers_for must be {model, checkpoint_revision, precision}, "
                             f"got {answers_for!r}")
    cards = _get_json(connection_class, netloc, "/v1/models")
    health = _get_json(connection_class, netloc, "/health")
    entries = cards.get("data") if isinstance(cards, dict) else None
    # the first entry with System One's fields (inside `vllm serve`, vLLM's own models are listed too)
    avrik = next((entry["avrik"] for entry in entries if isinstance(entry, dict) and "avrik" in entry), None) \
        if isinstance(entries, list) else None
    hashes = avrik.get("hashes") if isinstance(avrik, dict) else None
    revision = hashes.get("checkpoint_revision") if isinstance(hashes, dict) else None
    precision = health.get("precision") if isinstance(health, dict) else None
    fixtures = f"answer fixtures belong to {answers_for['model']}"
    if revision is None or precision is None:
        return (f"{fixtures}; this server does not say which checkpoint it serves (GET /v1/models "
                "avrik.hashes.checkpoint_revision, GET /health precision)")
    if (revision, precision) != (answers_for["checkpoint_revision"], answers_for["precision"]):
        return f"{fixtures}; this server serves checkpoint_revision {revision} at {precision}"
    return None


def _get_json(connection_class: type, netloc: str, path: str) -> Any:
    """GET `path`'s JSON body, or None when it has none (another kind of server)."""
    connection = connection_class(netloc, timeout=REQUEST_TIMEOUT_S)
    try:
        connection.request("GET", path, headers={"accept": JSON_CONTENT_TYPE})
        raw = connection.getresponse().read()
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _wait_ready(connection_class: type, netloc: str, path: str, timeout_s: float, listen_wait_s: float) -> None:
    """Poll GET `path` until 200 within `timeout_s`; refused connections past `listen_wait_s`
    fail at once (ServerNotReady), not after the whole timeout."""
    started = time.monotonic()
    deadline = started + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        connection = connection_class(netloc, timeout=READY_POLL_S * 10)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            response.read()
            if response.status == 200:
                return
            last = f"status {response.status}"
        except ConnectionRefusedError as exc:
            if time.monotonic() - started >= listen_wait_s:
                waited = f" for {listen_wait_s:g} s" if listen_wait_s else ""
                raise ServerNotReady(f"nothing listens at {netloc}: connection refused{waited} ({exc}); start "
                                     "the server first, or give it --listen-wait-s to bind its port") from None
            last = f"{type(exc).__name__}: {exc}"
        except (OSError, http.client.HTTPException) as exc:
            last = f"{type(exc).__name__}: {exc}"
        finally:
            connection.close()
        time.sleep(READY_POLL_S)
    raise ServerNotReady(f"GET {path} did not answer 200 within {timeout_s} s (last: {last})")


def request_body(send: Mapping[str, Any], *, where: str) -> bytes | None:
    """The bytes a case sends (None: no body)."""
    kinds = [key for key in ("json", "text", "hex", "repeat") if key in send]
    if len(kinds) > 1:
        raise FixtureInvalid(f"{where}: give at most one of json, text, hex, repeat (got {kinds})")
    if not kinds:
        return None
    kind = kinds[0]
    if kind == "json":
        return json.dumps(send["json"], separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    if kind == "text":
        return send["text"].encode("utf-8", "surrogatepass")
    if kind == "hex":
        return bytes.fromhex(send["hex"])
    repeat = send["repeat"]
    return (repeat["prefix"] + repeat["unit"] * repeat["times"] + repeat["suffix"]).encode()


def _request(connection_class: type, netloc: str, case: Case) -> tuple[int, bytes]:
    send = case.send
    body = request_body(send, where=case.id)
    headers = {"accept": JSON_CONTENT_TYPE}
    content_type = send.get("content_type", JSON_CONTENT_TYPE if body is not None else None)
    if content_type is not None:
        headers["content-type"] = content_type
    connection = connection_class(netloc, timeout=REQUEST_TIMEOUT_S)
    try:
        connection.request(send.get("method", "POST"), send["path"], body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    except (OSError, http.client.HTTPException) as exc:
        # A server may answer an oversized body early and close; that answer is still what counts.
        raise CaseFailed(f"no HTTP answer: {type(exc).__name__}: {exc}") from None
    finally:
        connection.close()


def _check_response(case: Case, status: int, raw: bytes) -> None:
    expect = case.expect
    if status != expect["status"]:
        raise CaseFailed(f"status {status}, expected {expect['status']}; body: {raw[:300]!r}")
    if "field" not in expect and "answers" not in expect:
        return
    try:
        body = json.loads(raw)
    except ValueError:
        raise CaseFailed(f"the {status} body is not JSON: {raw[:300]!r}") from None
    if "field" in expect and (not isinstance(body, dict) or body.get("field") != expect["field"]):
        got = body.get("field") if isinstance(body, dict) else None
        raise CaseFailed(f"the error blames field {got!r}, expected {expect['field']!r}: {raw[:300]!r}")
    if "answers" in expect:
        tolerance = expect["tolerance"]
        problems = _compare(expect["answers"], body.get("answers"), "answers", tolerance)
        usage = body.get("usage") or {}
        problems += [
            f"usage.{key}: {usage.get(key)!r} != expected {value!r}"
            for key, value in expect["usage"].items() if usage.get(key) != value
        ]
        if problems:
            more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
            raise CaseFailed("; ".join(problems[:6]) + more)


def _compare(expected: Any, actual: Any, path: str, tolerance: float) -> list[str]:
    """Differences between an expected and an actual JSON value (numbers within `tolerance`)."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return [f"{path}: {actual!r} is not an object"]
        problems = ([f"{path}: keys {sorted(actual)} != expected {sorted(expected)}"]
                    if set(actual) != set(expected) else [])
        for key in expected.keys() & actual.keys():
            problems += _compare(expected[key], actual[key], f"{path}.{key}", tolerance)
        return problems
    if isinstance(expected, (bool, str)) or expected is None:
        if actual == expected and type(actual) is type(expected):
            return []
        return [f"{path}: {actual!r} != expected {expected!r}"]
    if isinstance(expected, (int, float)):
        if isinstance(actual, bool) or not isinstance(actual, (int, float)) or not math.isfinite(actual):
            return [f"{path}: {actual!r} is not a number"]
        if abs(actual - expected) <= tolerance:
            return []
        return [f"{path}: {actual} != expected {expected} (tolerance {tolerance})"]
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return [f"{path}: {actual!r} != expected {expected!r}"]
        return [p for i, (e, a) in enumerate(zip(expected, actual)) for p in _compare(e, a, f"{path}.{i}", tolerance)]
    raise FixtureInvalid(f"{path}: unexpected value {expected!r} in a fixture")
