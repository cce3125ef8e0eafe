"""Limits and failures of a real `omnigraph serve`: readiness, queue full, deadline, disconnect, dead stage.

The graph worker is paused with SIGSTOP to hold requests in flight, and killed with SIGKILL to fail
its stage: real processes, real signals, no fake engine.
"""

import shutil
import signal
import threading
import time

import httpx
import pytest

REFUND_REQUEST = {"state": "Please refund the duplicate charge.",
                  "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}}


def _decide(server, timeout=60.0):
    return httpx.post(f"{server.url}/v1/systemone", json=REFUND_REQUEST, timeout=timeout)


def _in_background(call):
    """Run `call()` in a thread; the returned list receives its result (or exception)."""
    result: list = []

    def run():
        try:
            result.append(call())
        except Exception as exc:
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def _wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_not_ready_until_the_warmup_request_passed(start_server):
    server = start_server(ready=False)
    server.wait_listening()
    early = httpx.get(f"{server.url}/ready")
    assert early.status_code == 503 and early.headers["retry-after"] == "1"
    assert _decide(server).status_code == 503
    server.wait_ready()
    assert httpx.get(f"{server.url}/ready").json() == {"ready": True, "model": "laya"}
    assert _decide(server).status_code == 200


def test_a_full_queue_is_503_with_retry_after(start_server, demo_deploy_config):
    server = start_server("--deploy-config", str(demo_deploy_config(1)))
    server.signal_workers(signal.SIGSTOP)
    thread, first = _in_background(lambda: _decide(server))
    _wait_for(lambda: server.metric("omnigraph_queue_depth") == 1)
    refused = _decide(server)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "queue full" in refused.json()["detail"]
    server.signal_workers(signal.SIGCONT)
    thread.join(60)
    assert first[0].status_code == 200
    assert _decide(server).status_code == 200


def test_a_client_disconnect_aborts_its_request_and_frees_its_slot(start_server):
    server = start_server()
    server.signal_workers(signal.SIGSTOP)
    thread, in_flight = _in_background(lambda: _decide(server))
    _wait_for(lambda: server.metric("omnigraph_queue_depth") == 1)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        _decide(server, timeout=1.0)
    _wait_for(lambda: server.metric("omnigraph_client_disconnects_total") == 1)
    assert server.metric("omnigraph_queue_depth") == 1  # only the request in flight holds a slot
    server.signal_workers(signal.SIGCONT)
    thread.join(60)
    assert in_flight[0].status_code == 200
    _wait_for(lambda: server.metric("omnigraph_queue_depth") == 0)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_request_past_its_deadline_is_504(start_server):
    server = start_server(env={"OMNIGRAPH_REQUEST_DEADLINE_S": "1.5"})
    server.signal_workers(signal.SIGSTOP)
    started = time.monotonic()
    response = _decide(server)
    assert response.status_code == 504 and "deadline" in response.json()["detail"]
    assert time.monotonic() - started > 1.4  # not before its deadline (how soon after: benchmarks' business)
    _wait_for(lambda: server.metric("omnigraph_queue_depth") == 0)


def test_a_dead_stage_without_restarts_turns_health_to_503_and_requests_fail_fast(start_server, demo_deploy_config):
    server = start_server("--deploy-config", str(demo_deploy_config(32, max_restarts=0)))
    server.signal_workers(signal.SIGKILL)
    # Failing fast is in the status: a request that waited for the dead stage would end in 504 at
    # the 30 s default deadline, not 503.
    response = _decide(server)
    assert response.status_code == 503, response.text
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and "stage 0" in health.json()["reason"]
    assert httpx.get(f"{server.url}/ready").status_code == 503
    later = _decide(server)
    assert later.status_code == 503 and "stage" in later.json()["detail"]


def test_a_killed_worker_is_replaced_and_the_server_recovers(start_server):
    server = start_server()
    (killed,) = server.signal_workers(signal.SIGKILL)
    statuses = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        response = _decide(server)
        statuses.append(response.status_code)
        if response.status_code == 200:
            break
        assert response.status_code == 503, response.text  # failing fast while the replacement starts
        assert "Retry-After" in response.headers
        time.sleep(0.2)
    assert statuses[-1] == 200, statuses
    assert killed not in server.worker_pids() and len(server.worker_pids()) == 1
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_pipeline_that_cannot_start_stops_the_server_with_the_reason(start_server, tmp_path):
    from omnigraph.pipelines.laya.export import default_bundle

    bundle = shutil.copytree(default_bundle(), tmp_path / "tampered-bundle")
    weights = max((path for path in bundle.iterdir() if path.name != "manifest.json"), key=lambda p: p.stat().st_size)
    with weights.open("r+b") as file:  # its manifest reads fine; its bytes are not the ones it names
        byte = file.read(1)
        file.seek(0)
        file.write(bytes([byte[0] ^ 0xFF]))
    server = start_server("--bundle", str(bundle), ready=False)
    assert server.process.wait(120) == 1
    last_line = server.log.read_text().strip().splitlines()[-1]
    assert last_line.startswith("omnigraph: error: ServerStartupError: startup failed:")
    assert "tampered-bundle" in last_line
