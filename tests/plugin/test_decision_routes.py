"""The decision routes of a real `omnigraph serve` (the embedded demo), as a laya-serve client sees them."""

import json
import socket

import httpx
import pytest

REFUND_REQUEST = {"state": "Please refund the duplicate charge.",
                  "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}}

AUDIT_KEYS = {"model_hash", "adapter_hash", "calibration_version", "prompt_template_sha256", "allowed_token_set_hash",
              "precision", "backend", "input_tokens"}


def _post(server, path, body=None, **kwargs):
    if body is not None:
        kwargs["json"] = body
    return httpx.post(f"{server.url}{path}", timeout=60, **kwargs)


def test_readme_refund_example_is_a_well_formed_answer(demo_server):
    # README.md: curl -s localhost:8000/v1/systemone -H 'content-type: application/json' -d '{...refund...}'
    response = _post(demo_server, "/v1/systemone", content=json.dumps(REFUND_REQUEST),
                     headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == "laya"
    refund = body["answers"]["refund"]
    assert refund["type"] == "noul"
    assert 0.0 <= refund["noul"] <= 1.0 and refund["confidence"] == round(max(refund["noul"], 1 - refund["noul"]), 4)
    assert 0.0 <= refund["action"]["act_probability"] <= 1.0
    assert body["usage"]["input_tokens"] > 0 and body["usage"]["output_tokens"] == 0
    assert body["audit"].keys() == AUDIT_KEYS
    assert body["audit"]["input_tokens"] == [body["usage"]["input_tokens"]]  # one per question, in order
    assert body["audit"]["backend"].startswith("onnxruntime ") and "CPUExecutionProvider" in body["audit"]["backend"]


def test_choice_and_score_answers_carry_probabilities(demo_server):
    body = _post(demo_server, "/v1/systemone", {
        "state": "The invoice total is wrong.",
        "questions": {"team": {"type": "choice", "instructions": "Who handles this?",
                               "criteria": {"billing": "invoices", "support": "bugs"}},
                      "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high"]}},
    }).json()
    team, urgency = body["answers"]["team"], body["answers"]["urgency"]
    assert team["choice"] in ("billing", "support") and set(team["probabilities"]) == {"billing", "support"}
    assert sum(team["probabilities"].values()) == pytest.approx(1.0, abs=1e-3)
    assert set(urgency["probabilities"]) == {"0", "1", "2"} and 0.0 <= urgency["score"] <= 2.0


def test_an_invalid_question_is_422_naming_the_field(demo_server):
    response = _post(demo_server, "/v1/systemone", {"state": "x", "questions": {"refund": {"type": "maybe"}}})
    assert response.status_code == 422
    assert response.json()["field"] == "questions.refund.type"
    assert "questions.refund.type" in response.json()["detail"] or "maybe" in response.json()["detail"]


def test_a_path_or_a_checkpoint_this_server_does_not_serve_is_422(demo_server):
    for model in ("./english", "cua_s1"):
        response = _post(demo_server, "/v1/systemone", {**REFUND_REQUEST, "model": model})
        assert response.status_code == 422 and response.json()["field"] == "model"


def test_a_client_model_id_that_names_no_checkpoint_is_the_served_model(demo_server):
    # laya-serve's reading: a Jev client's own id is "no explicit model"
    response = _post(demo_server, "/v1/systemone", {**REFUND_REQUEST, "model": "jev-latest"})
    assert response.status_code == 200 and response.json()["model"] == "laya"


def test_batch_answers_or_fails_each_state_on_its_own(demo_server):
    response = _post(demo_server, "/v1/systemone/batch",
                     {"states": ["Refund me please.", 42, {"turns": ["where is my parcel?"]}],
                      "questions": REFUND_REQUEST["questions"]})
    assert response.status_code == 200, response.text
    body = response.json()
    first, failed, third = body["results"]
    assert first["answers"]["refund"]["type"] == "noul" and third["answers"]["refund"]["type"] == "noul"
    assert failed["error"]["code"] == "invalid_request" and failed["error"]["field"] == "state"
    assert [result["id"].rsplit("-", 1)[1] for result in body["results"]] == ["0", "1", "2"]
    assert body["total_usage"]["input_tokens"] == first["usage"]["input_tokens"] + third["usage"]["input_tokens"]
    assert body["audit"].keys() == AUDIT_KEYS and first["audit"].keys() == AUDIT_KEYS
    assert body["audit"]["input_tokens"] == [first["usage"]["input_tokens"] + third["usage"]["input_tokens"]]


def test_a_batch_answer_equals_the_single_answer(demo_server):
    single = _post(demo_server, "/v1/systemone", REFUND_REQUEST).json()
    batch = _post(demo_server, "/v1/systemone/batch",
                  {"states": [REFUND_REQUEST["state"]], "questions": REFUND_REQUEST["questions"]}).json()
    assert batch["results"][0]["answers"] == single["answers"]


@pytest.mark.parametrize("states", [[], "one state", ["s"] * 65])
def test_batch_states_outside_1_to_64_are_422(demo_server, states):
    response = _post(demo_server, "/v1/systemone/batch", {"states": states, "questions": REFUND_REQUEST["questions"]})
    assert response.status_code == 422 and response.json()["field"] == "states"


@pytest.mark.parametrize("raw", [b'{"state": NaN, "questions": {}}',
                                 b'{"state": "a", "state": "b", "questions": {}}',
                                 b'{"state": "\\ud800", "questions": {}}',
                                 b'{"state": "\xff", "questions": {}}',
                                 b'{"state": '])
def test_unusable_json_is_400(demo_server, raw):
    response = _post(demo_server, "/v1/systemone", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["detail"]


def test_not_json_is_415(demo_server):
    response = _post(demo_server, "/v1/systemone", content=b"state=x", headers={"content-type": "text/plain"})
    assert response.status_code == 415 and "application/json" in response.json()["detail"]


def test_a_body_over_4_mib_is_413(demo_server):
    big = json.dumps({"state": "x" * (4 * 1024 * 1024), "questions": {}}).encode()
    response = _post(demo_server, "/v1/systemone", content=big, headers={"content-type": "application/json"})
    assert response.status_code == 413


def test_a_chunked_body_over_4_mib_is_413(demo_server):
    # No Content-Length at all: the server counts the bytes as they arrive.
    def chunks():
        yield b'{"state": "'
        for _ in range(5):
            yield b"x" * (1024 * 1024)
        yield b'", "questions": {}}'

    response = _post(demo_server, "/v1/systemone", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413


def test_a_content_length_that_understates_the_body_cannot_smuggle_more(demo_server):
    # A lying Content-Length bounds what is read as this body; the rest is not a valid next request.
    body = json.dumps(REFUND_REQUEST).encode()
    with socket.create_connection(("127.0.0.1", demo_server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 10\r\nconnection: close\r\n\r\n" + body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400")


def test_metrics_count_requests_by_route_and_status(demo_server):
    _post(demo_server, "/v1/systemone", REFUND_REQUEST)
    text = httpx.get(f"{demo_server.url}/metrics").text
    assert 'omnigraph_http_requests_total{model_name="laya",route="/v1/systemone",status="200"}' in text
    assert 'omnigraph_stage_duration_seconds_count{model_name="laya",stage="decision"}' in text
    assert 'omnigraph_queue_depth{model_name="laya"} ' in text
    assert 'omnigraph_ledger_reservations{model_name="laya"} 1.0' in text  # the one graph worker's reservation
    assert 'omnigraph_batch_requests_count{model_name="laya",stage="decision"}' in text  # batcher histograms
    assert 'omnigraph_batch_padding_tokens_total{model_name="laya",stage="decision"}' in text


def test_health_and_ready_of_a_started_server(demo_server):
    assert httpx.get(f"{demo_server.url}/health").json()["status"] == "ok"
    assert httpx.get(f"{demo_server.url}/ready").status_code == 200
