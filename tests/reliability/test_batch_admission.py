"""A `/v1/systemone/batch` is admitted as a unit: every state answered, or one 503 for the whole
batch when the queue cannot take it now (never a batch half refused inside a 200)."""

from __future__ import annotations

import re
import signal
import threading

import httpx

from ..plugin.conftest import ServerProcess

QUESTION = {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}


def _batch(states: int) -> dict:
    return {"states": [f"Customer {i}: please refund the duplicate charge." for i in range(states)],
            "questions": QUESTION}


def test_a_batch_of_64_on_an_idle_server_is_answered_whole_and_a_busy_queue_refuses_it_whole(tmp_path):
    server = ServerProcess([], {}, tmp_path / "server.log")
    server.wait_ready()
    try:
        answered = httpx.post(f"{server.url}/v1/systemone/batch", json=_batch(64), timeout=120)
        assert answered.status_code == 200, answered.text
        results = answered.json()["results"]
        assert len(results) == 64 and all("answers" in result for result in results)

        # 100 single requests held in the queue (the worker paused) leave fewer than 64 of the 128 slots free
        server.signal_workers(signal.SIGSTOP)
        with httpx.Client(base_url=server.url, timeout=60) as client:
            singles = [threading.Thread(target=lambda: client.post("/v1/systemone", json={
                "state": "x", "questions": QUESTION}), daemon=True) for _ in range(100)]
            for thread in singles:
                thread.start()
            while (depth := server.metric("omnigraph_queue_depth")) < 100:
                pass
            # its own connection: the singles hold all of the client's pool (100 connections)
            refused = httpx.post(f"{server.url}/v1/systemone/batch", json=_batch(64), timeout=10)
            assert refused.status_code == 503 and "Retry-After" in refused.headers
            assert re.search(r"64 requests to admit as a unit, \d+ slots free \(max_queued_requests=128\)", refused.text)
            assert server.metric("omnigraph_queue_depth") <= depth  # the refused batch took nothing
            server.signal_workers(signal.SIGCONT)
            for thread in singles:
                thread.join(60)
    finally:
        server.stop()
