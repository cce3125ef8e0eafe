"""The fault model (DESIGN.md "Wire"): ordinary client behaviour never takes a stage down.

A request past its deadline, or whose client hung up, while its call runs is fenced: it fails at
once, its late result is discarded, and the worker serves on. A worker that dies is noticed at
once, even while idle, and replaced. The worker is paused with SIGSTOP so that a call is surely in
flight when its deadline passes or its client goes: real processes and signals, no fake engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from omnigraph import AsyncOmni

from ..plugin.conftest import REFUND_REQUEST, ServerProcess
from .plans import demo_plan

ROUNDS = 100  # the bar: a hundred overruns and a hundred hang-ups in a row


def _serve(tmp_path: Path, tmpdir: Path, **env: str) -> ServerProcess:
    """The embedded demo, its workers' private folders under `tmpdir`."""
    server = ServerProcess([], {"TMPDIR": str(tmpdir), **env}, tmp_path / "server.log")
    server.wait_ready()
    return server


def _worker_folders(tmpdir: Path) -> list[str]:
    return sorted(path.name for path in tmpdir.glob("omnigraph-worker-*"))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def _assert_a_new_generation_serves(server: ServerProcess, retired: int) -> None:
    _wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200, "a new generation serves")
    (replacement,) = server.worker_pids()
    assert replacement != retired
    assert httpx.post(f"{server.url}/v1/systemone", json=REFUND_REQUEST, timeout=30).status_code == 200


@pytest.mark.slow
def test_a_hundred_deadline_overruns_and_hang_ups_leave_the_same_worker_serving(tmp_path, tmpdir_env):
    server = _serve(tmp_path, tmpdir_env, OMNIGRAPH_REQUEST_DEADLINE_S="0.3")
    try:
        (worker,) = server.worker_pids()
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for _ in range(ROUNDS):
                os.kill(worker, signal.SIGSTOP)  # the call cannot finish before its deadline
                late = client.post("/v1/systemone", json=REFUND_REQUEST)
                os.kill(worker, signal.SIGCONT)
                assert late.status_code == 504, late.text
                assert client.post("/v1/systemone", json=REFUND_REQUEST).status_code == 200
                assert client.get("/health").status_code == 200
            for _ in range(ROUNDS):
                os.kill(worker, signal.SIGSTOP)
                with pytest.raises(httpx.ReadTimeout):  # the client hangs up while its call runs
                    httpx.post(f"{server.url}/v1/systemone", json=REFUND_REQUEST, timeout=0.2)
                os.kill(worker, signal.SIGCONT)
                assert client.post("/v1/systemone", json=REFUND_REQUEST).status_code == 200
                assert client.get("/health").status_code == 200
        assert server.worker_pids() == [worker]  # never retired: no restart budget was spent
    finally:
        server.stop()
    assert not _alive(worker)
    assert _worker_folders(tmpdir_env) == []  # no worker folder left behind


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_a_worker_killed_while_idle_turns_health_to_503_at_once_and_is_replaced(tmp_path, tmpdir_env, sig):
    server = _serve(tmp_path, tmpdir_env)
    try:
        (worker,) = server.worker_pids()
        os.kill(worker, sig)
        _wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 503, "health reports the dead worker", 5)
        health = httpx.get(f"{server.url}/health")
        assert health.json()["status"] == "backend_unavailable" and "exited while idle" in health.json()["reason"]
        assert "Retry-After" in health.headers
        _assert_a_new_generation_serves(server, worker)  # started without any request asking for it
    finally:
        server.stop()
    assert _worker_folders(tmpdir_env) == []


def test_a_worker_silent_past_the_hang_bound_after_a_fence_is_replaced(tmp_path, tmpdir_env):
    """SIGSTOP: the request gets its 504 at its deadline; the fenced call's worker, still silent
    `hang_grace_s` later, is hung: it is killed (its exit verified) and a new generation serves."""
    server = ServerProcess(["--deploy-config", str(demo_plan(tmp_path, hang_grace_s=0.5))], {"TMPDIR": str(tmpdir_env), "OMNIGRAPH_REQUEST_DEADLINE_S": "0.3"},
                           tmp_path / "server.log")
    try:
        server.wait_ready()
        (worker,) = server.worker_pids()
        os.kill(worker, signal.SIGSTOP)
        late = httpx.post(f"{server.url}/v1/systemone", json=REFUND_REQUEST, timeout=30)
        assert late.status_code == 504, late.text
        _wait_for(lambda: not _alive(worker), "the hung worker is killed", 10)
        _assert_a_new_generation_serves(server, worker)
    finally:
        server.stop()
    assert _worker_folders(tmpdir_env) == []


def test_cancelling_ten_generate_tasks_one_by_one_never_fails_the_pipeline():
    async def first(omni, request_id):
        async for output in omni.generate(REFUND_REQUEST, request_id=request_id):
            return output

    async def main():
        async with AsyncOmni() as omni:  # the embedded demo
            (replica,) = omni.execution_plan["stages"][0]["replicas"]
            os.kill(replica["pid"], signal.SIGSTOP)
            try:
                tasks = [asyncio.create_task(first(omni, f"cancelled-{i}")) for i in range(10)]
                # a call is in flight on the stopped worker before any cancellation (not a 50 ms guess)
                for _ in range(1500):
                    if omni.execution_plan["stages"][0]["replicas"][0]["in_flight"]:
                        break
                    await asyncio.sleep(0.02)
                for task in tasks:
                    await asyncio.sleep(0.05)  # one by one, some while queued
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                # the stopped worker cannot answer: the call whose requests are all gone is fenced
                for _ in range(250):
                    if omni.execution_plan["stages"][0]["replicas"][0]["fenced_calls"] >= 1:
                        break
                    await asyncio.sleep(0.02)
            finally:
                os.kill(replica["pid"], signal.SIGCONT)
            answer = await first(omni, "after")
            (after,) = omni.execution_plan["stages"][0]["replicas"]
            return replica, after, answer, omni.health(), omni.failure()

    before, after, answer, health, failure = asyncio.run(main())
    assert answer.custom_output["answers"]["refund"]["type"] == "noul"
    assert health == {} and failure is None
    assert after["pid"] == before["pid"] and after["state"] == "serving" and after["fenced_calls"] >= 1
