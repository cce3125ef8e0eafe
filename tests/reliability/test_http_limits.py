"""Trust under faults at the HTTP door (issue 18, findings 3, 4, 5, 7, 8), against a real `omnigraph serve`.

One server, started under `ulimit -n 1024` with short read deadlines, takes: 1,100 connections that
never finish their request head, over-limit bodies from the standard library's client, a client
that hangs up mid-body, `json_schema`s built to cost unbounded work, and choice labels that print
as the same answer key.
"""

from __future__ import annotations

import http.client
import json
import resource
import selectors
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from omnigraph.pipelines.processor import RequestInvalid
from omnigraph.pipelines.system_one.request import parse_request

from ..serving import ServerProcess
from .http_server import metric_samples, open_descriptors, start_server

FD_LIMIT = 1024
IDLE_CLIENTS = 1100
HEAD_TIMEOUT_S = 2
BODY_TIMEOUT_S = 3
BODY_LIMIT = 4 * 1024 * 1024
ROUTES = ("/v1/systemone", "/v1/systemone/batch", "/v1/chat/completions")
REFUND = {"state": "Please refund the duplicate charge.",
          "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("http-limits") / "server.log"
    process = start_server(log, fd_limit=FD_LIMIT, env={"OMNIGRAPH_HEAD_TIMEOUT_S": str(HEAD_TIMEOUT_S),
                                                         "OMNIGRAPH_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)})
    yield process
    process.stop()


def _internal_errors(url: str) -> float:
    return sum(value for name, value in metric_samples(url).items()
               if name.startswith("omnigraph_http_requests_total{") and 'status="500"' in name)


def _chat(schema: dict) -> dict:
    return {"model": "laya", "messages": [{"role": "user", "content": "Please refund the duplicate charge."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "decision", "schema": schema}}}


def _raise_own_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"this test opens {needed} sockets; the open-file hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def test_idle_partial_connections_neither_lock_out_good_clients_nor_stay_open(server: ServerProcess) -> None:
    _raise_own_fd_limit(IDLE_CLIENTS + 200)
    idle = []
    try:
        for _ in range(IDLE_CLIENTS):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl")
            idle.append(sock)
        # More clients than the server has descriptors, all half-way through a request head:
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        answer = httpx.post(f"{server.url}/v1/systemone", json=REFUND, timeout=60)
        assert answer.status_code == 200, answer.text
        assert open_descriptors(server.process.pid) < FD_LIMIT - 64
        # Every idle connection is closed by the server (shed for newer clients, or past the head deadline).
        selector = selectors.DefaultSelector()
        for sock in idle:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        deadline = time.monotonic() + HEAD_TIMEOUT_S + 60
        statuses = set()
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=1):
                try:
                    data = key.fileobj.recv(65536)
                except ConnectionError:
                    data = b""
                if data.startswith(b"HTTP/1.1 "):
                    statuses.add(int(data[9:12]))
                if not data or b"\r\n\r\n" in data:
                    selector.unregister(key.fileobj)
        assert not selector.get_map(), f"{len(selector.get_map())} idle connections still open"
        assert statuses <= {408, 503}
    finally:
        for sock in idle:
            sock.close()
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def _answer_then_close(sock: socket.socket, wait_s: float) -> bytes:
    """Everything the server sends until it closes the connection (at most `wait_s` seconds)."""
    sock.settimeout(wait_s)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_a_body_that_stops_arriving_gets_a_408_and_the_connection_closes(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"state\": ")
        answer = _answer_then_close(sock, BODY_TIMEOUT_S + 30)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"the request body stopped arriving" in answer


def test_a_request_head_over_64_kib_is_431(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     + b"".join(b"X-Padding-%d: %s\r\n" % (i, b"p" * 1000) for i in range(100)) + b"\r\n")
        answer = _answer_then_close(sock, 30)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]


def _chunks(total: int, size: int = 64 * 1024) -> Iterator[bytes]:
    for start in range(0, total, size):
        yield b" " * min(size, total - start)


@pytest.mark.parametrize("route", ROUTES)
def test_every_over_limit_body_gets_a_413_the_client_can_read(server: ServerProcess, route: str) -> None:
    """The standard library's client sends the whole body, then reads: the server must let it."""
    bodies = {"content-length 4 MiB + 1": b" " * (BODY_LIMIT + 1), "content-length 32 MiB": b" " * (32 << 20),
              "chunked 8 MiB": None}
    for name, body in bodies.items():
        for connection in ("keep-alive", "close"):
            client = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            headers = {"Content-Type": "application/json", "Connection": connection}
            try:
                if body is None:
                    client.request("POST", route, body=_chunks(8 << 20), headers=headers, encode_chunked=True)
                else:
                    client.request("POST", route, body=body, headers=headers)
                response = client.getresponse()
                text = response.read().decode()
            finally:
                client.close()
            assert response.status == 413, (name, connection, text)
            assert "too large" in text and str(BODY_LIMIT) in text, (name, connection, text)
    assert httpx.post(f"{server.url}/v1/systemone", json=REFUND, timeout=60).status_code == 200


def test_a_client_hanging_up_mid_body_is_counted_as_a_disconnect(server: ServerProcess) -> None:
    before = metric_samples(server.url)
    errors_before = _internal_errors(server.url)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"state\": \"Please")
        time.sleep(0.5)  # the route is reading the body when the client goes
    name = 'omnigraph_http_requests_total{model_name="laya",route="/v1/systemone",status="499"}'
    deadline = time.monotonic() + 30
    while metric_samples(server.url).get(name, 0) == before.get(name, 0):
        assert time.monotonic() < deadline, "the hang-up was never counted"
        time.sleep(0.1)
    after = metric_samples(server.url)
    disconnects = 'omnigraph_client_disconnects_total{model_name="laya"}'
    assert after[disconnects] == before[disconnects] + 1
    assert _internal_errors(server.url) == errors_before
    log = server.log.read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log
    assert '"POST /v1/systemone HTTP/1.1" 499' in log


def test_a_chain_of_50000_refs_is_refused_at_the_nesting_limit(server: ServerProcess) -> None:
    count = 50_000
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(count)}
    defs[f"d{count}"] = {"type": "boolean"}
    schema = {"type": "object", "properties": {"refund": {"$ref": "#/$defs/d0"}}, "$defs": defs}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=_chat(schema), timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "schema_too_deep" and "MAX_SCHEMA_NESTING" in error["message"]
    assert error["param"] == "response_format.json_schema.schema.properties.refund"


def test_a_1000_deep_anyof_and_ref_chain_is_refused_not_a_500(server: ServerProcess) -> None:
    depth = 1000  # each level an Optional of the next: 1,000 nested unwraps, in a 60 KB body
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "boolean"}
    schema = {"type": "object", "properties": {"refund": {"$ref": "#/$defs/d0"}}, "$defs": defs}
    response = httpx.post(f"{server.url}/v1/chat/completions",
                          json=_chat(schema), timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "schema_too_deep"
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


LOOK_ALIKE_LABELS = [[1, "1"], [True, "true"], [1.5, "1.5"], ["false", False]]


@pytest.mark.parametrize("labels", LOOK_ALIKE_LABELS, ids=lambda labels: repr(labels))
def test_labels_that_print_as_one_answer_key_are_422(server: ServerProcess, labels: list) -> None:
    request = {"state": "The parcel arrived broken.",
               "questions": {"pick": {"type": "choice", "instructions": "Which label?", "criteria": labels}}}
    response = httpx.post(f"{server.url}/v1/systemone", json=request, timeout=60)
    assert response.status_code == 422, response.text
    assert response.json()["field"] == "questions.pick.criteria.1"
    assert "repeats label 0" in response.json()["detail"]
    with pytest.raises(RequestInvalid) as refused:  # the Python API refuses it as well
        parse_request(request)
    assert refused.value.field == "questions.pick.criteria.1"


def test_labels_of_mixed_types_that_print_apart_answer_with_one_key_each(server: ServerProcess) -> None:
    request = {"state": "The parcel arrived broken.",
               "questions": {"pick": {"type": "choice", "instructions": "Which label?",
                                      "criteria": [2, "3", True, 2.5, "True"]}}}
    response = httpx.post(f"{server.url}/v1/systemone", json=request, timeout=60)
    assert response.status_code == 200, response.text
    pairs = json.loads(response.text, object_pairs_hook=list)
    answers = dict(pairs)["answers"]
    keys = [key for key, _ in dict(dict(answers)["pick"])["probabilities"]]
    assert keys == ["2", "3", "true", "2.5", "True"]


def test_the_server_answers_after_all_of_it(server: ServerProcess) -> None:
    assert httpx.post(f"{server.url}/v1/systemone", json=REFUND, timeout=60).status_code == 200
    assert _internal_errors(server.url) == 0

