"""`omnigraph serve --api-key` / OMNIGRAPH_API_KEY: bearer auth on every route but the probes."""

import httpx
import pytest

KEY = "s3cret-key"
QUESTION = {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}
DECISION = {"state": "Please refund me.", "questions": QUESTION}


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    from .conftest import ServerProcess

    server = ServerProcess([], {"OMNIGRAPH_API_KEY": KEY}, tmp_path_factory.mktemp("auth") / "server.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}])
def test_a_missing_or_wrong_key_gets_401_and_nothing_else(keyed_server, headers):
    for method, path, body in (("POST", "/v1/systemone", DECISION), ("GET", "/v1/models", None),
                               ("GET", "/docs", None), ("POST", "/no/such/route", DECISION)):
        response = httpx.request(method, f"{keyed_server.url}{path}", json=body, headers=headers, timeout=30)
        assert response.status_code == 401, (path, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
        text = response.text
        assert KEY not in text and "wrong" not in text and "route" not in text


def test_the_right_key_is_served_and_the_probes_need_none(keyed_server):
    answer = httpx.post(f"{keyed_server.url}/v1/systemone", json=DECISION, headers={"Authorization": f"Bearer {KEY}"},
                        timeout=60)
    assert answer.status_code == 200 and "answers" in answer.json()
    for probe in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{keyed_server.url}{probe}", timeout=30).status_code == 200, probe


def test_openai_routes_answer_401_in_openai_shape(keyed_server):
    response = httpx.get(f"{keyed_server.url}/v1/models", timeout=30)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "unauthorized"


def test_a_refused_decision_is_counted_as_unauthorized_under_its_route(keyed_server):
    from ..reliability.http_server import metric_samples

    def counts() -> tuple[float, float]:
        samples = metric_samples(keyed_server.url)
        outcome = sum(v for k, v in samples.items()
                      if k.startswith("omnigraph_request_outcomes_total{") and 'outcome="unauthorized"' in k)
        requests = sum(v for k, v in samples.items()
                       if k.startswith("omnigraph_http_requests_total{") and 'route="/v1/systemone"' in k
                       and 'status="401"' in k)
        return outcome, requests

    before = counts()
    assert httpx.post(f"{keyed_server.url}/v1/systemone", json=DECISION, timeout=30).status_code == 401
    assert httpx.post(f"{keyed_server.url}/no/such/route", json=DECISION, timeout=30).status_code == 401
    outcome, requests = counts()
    assert (outcome - before[0], requests - before[1]) == (1, 1)  # the unknown path is "unmatched", not a label
