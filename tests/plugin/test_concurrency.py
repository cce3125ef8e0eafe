"""64 concurrent clients against a real server for 20 s: every request answered exactly once, as itself."""

import asyncio
import re
import time

import httpx
import pytest

CLIENTS = 64
SECONDS = 20.0


async def _client(base: str, client_id: int, stop_at: float) -> tuple[int, list[str]]:
    """Send requests one after another; each asks a question whose id only this request uses."""
    sent, problems = 0, []
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        while time.monotonic() < stop_at:
            qid = f"c{client_id}_r{sent}"
            response = await http.post("/v1/systemone", json={
                "state": f"Client {client_id} asks for a refund of order {sent}.",
                "questions": {qid: {"type": "noul", "instructions": "Does the customer ask for a refund?"}}})
            sent += 1
            if response.status_code != 200:
                problems.append(f"{qid}: {response.status_code} {response.text[:200]}")
            elif list(response.json()["answers"]) != [qid]:
                problems.append(f"{qid}: answered {list(response.json()['answers'])}")
    return sent, problems


@pytest.mark.slow
def test_64_clients_for_20_s_each_get_exactly_their_answers(start_server, demo_deploy_config):
    # The admission bound must fit every client's one request in flight.
    server = start_server("--deploy-config", str(demo_deploy_config(CLIENTS)))

    async def run():
        stop_at = time.monotonic() + SECONDS
        return await asyncio.gather(*(_client(server.url, i, stop_at) for i in range(CLIENTS)))

    results = asyncio.run(run())
    sent = sum(count for count, _ in results)
    problems = [problem for _, client_problems in results for problem in client_problems]
    assert not problems, problems[:5]
    assert all(count > 0 for count, _ in results)
    # The server answered exactly as many decisions as were sent: none lost, none duplicated.
    metrics = httpx.get(f"{server.url}/metrics").text
    answered = re.search(r'omnigraph_http_requests_total\{model_name="laya",route="/v1/systemone",status="200"\} (\S+)',
                         metrics)
    assert float(answered.group(1)) == sent
    assert server.metric("omnigraph_queue_depth") == 0
