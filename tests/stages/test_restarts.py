"""A retired replica is replaced by a new worker generation, within the stage's restart budget."""

import asyncio
import os
import signal
import threading

import numpy as np
import pytest

from omnigraph import AsyncOmni, Omni
from omnigraph.bundles import verify_bundle
from omnigraph.stages.errors import StageUnavailable
from omnigraph.stages.restarts import RestartBudget


BIG = {"tensors": {"x": np.zeros((1024, 1024), np.float32)}}  # a call that runs for many seconds
SMALL = {"tensors": {"x": np.ones((4, 4), np.float32)}}
X = {"tensors": {"x": np.ones((2, 4), np.float32)}}


def owners(ledger):
    return sorted((r["owner"], r["state"], tuple(r["demands"].items())) for r in ledger["reservations"])


def test_a_worker_killed_mid_call_is_followed_by_a_new_generation(make_plan, os_processes, engine):
    async def main():
        async with AsyncOmni(deploy_config=make_plan("slow", capacity=1000, demand=300)) as omni:
            before = owners(omni.ledger_snapshot())
            task = asyncio.create_task(engine.first(omni, BIG, "doomed"))
            await engine.until_in_flight(omni, "doomed")
            (old,) = engine.replicas(omni)
            os.kill(old["pid"], signal.SIGKILL)
            with pytest.raises(StageUnavailable, match="WorkerDied") as died:
                await task
            assert died.value.retry_after == 1.0  # worth a retry: a replacement is on its way
            await engine.until_serving(omni, generation=2)
            answer = await engine.first(omni, SMALL, "after")
            (new,) = engine.replicas(omni)
            return old, new, answer, before, omni.ledger_snapshot(), omni.execution_plan["stages"][0]["restart"]

    old, new, answer, before, ledger, restart = asyncio.run(main())
    assert not os_processes.alive(old["pid"])
    assert new["pid"] != old["pid"] and new["generation"] > old["generation"] and new["restarts"] == 1
    assert new["calls"] == 1 and answer.custom_output["h200"].shape == (4, 4)
    assert owners(ledger) == before == [("stage0/replica0", "held", (("machine:ram", 300),))]
    assert ledger["constraints"]["machine:ram"] == {"capacity": 1000, "held": 300, "quarantined": 0, "free": 700}
    assert restart == {"max_restarts": 5, "window_s": 60.0, "restarts": 1, "replacing": []}
    assert os_processes.children() == set()


def test_a_spent_restart_budget_backs_off_and_the_stage_recovers_by_itself(make_plan, os_processes, engine):
    async def main():
        plan = make_plan("affine", capacity=100, demand=10, restart={"max_restarts": 1, "window_s": 2})
        async with AsyncOmni(deploy_config=plan) as omni:
            os.kill(engine.replicas(omni)[0]["pid"], signal.SIGKILL)
            await engine.until_serving(omni, generation=2)
            os.kill(engine.replicas(omni)[0]["pid"], signal.SIGKILL)  # within the window: the budget is spent
            await engine.until(lambda: "backing off" in omni.health().get(0, ""), "the stage backs off")
            with pytest.raises(StageUnavailable, match="backing off") as refused:
                await engine.first(omni, X, "during-backoff")
            assert refused.value.retry_after >= 1.0  # a retry is worth it: the stage is not failed for good
            await engine.until_serving(omni, generation=3)
            answer = await engine.first(omni, X, "recovered")
            return answer, omni.health(), omni.execution_plan["stages"][0]

    answer, health, stage = asyncio.run(main())
    assert answer.custom_output["y"].shape == (2, 4) and health == {} and stage["failure"] is None
    assert stage["state"] == "ok" and stage["restart"]["restarts"] == 2
    assert os_processes.children() == set()


def test_a_replacement_failing_warmup_gives_back_what_it_took_and_backs_off(make_plan, bundles, os_processes, engine):
    plan = make_plan("affine", capacity=100, demand=10, restart={"max_restarts": 2, "window_s": 3600})
    with Omni(deploy_config=plan) as omni:
        stage = omni.runtime.stages[0]
        stage.bundle = verify_bundle(bundles["bad_warmup"])  # from now on, a new worker's warmup fails
        os.kill(engine.replicas(omni)[0]["pid"], signal.SIGKILL)
        asyncio.run(engine.until(lambda: omni.execution_plan["stages"][0]["restart"]["restarts"] == 2
                                 and "backing off" in omni.health().get(0, ""), "two failed starts, then a backoff"))
        described = omni.execution_plan["stages"][0]
        ledger = omni.ledger_snapshot()
        children = os_processes.children()
    assert described["state"] == "recovering" and described["failure"] is None
    assert described["restart"]["replacing"] == [0]
    assert ledger["reservations"] == [] and ledger["constraints"]["machine:ram"]["free"] == 100
    assert children == set()


def test_shutdown_during_a_replacement_start_leaves_nothing(make_plan, os_processes, engine):
    async def main():
        omni = AsyncOmni(deploy_config=make_plan("affine", capacity=100, demand=10))
        old = engine.replicas(omni)[0]["pid"]
        os.kill(old, signal.SIGKILL)
        with pytest.raises(StageUnavailable):
            await engine.first(omni, X, "finds-it-dead")
        # the replacement's worker process exists: it is starting, loading or warming up
        await engine.until(lambda: os_processes.children() - {old}, "the replacement worker exists")
        assert omni.execution_plan["stages"][0]["restart"]["replacing"] == [0]
        await asyncio.to_thread(omni.shutdown)
        return omni.ledger_snapshot()

    ledger = asyncio.run(main())
    assert ledger["reservations"] == [] and ledger["constraints"]["machine:ram"]["free"] == 100
    assert os_processes.children() == set()


def test_the_restart_budget_is_a_sliding_window():
    budget = RestartBudget(max_restarts=2, window_s=10)
    assert budget.spend(now=0) and budget.spend(now=5)
    assert not budget.spend(now=9.9)  # two starts within the last 10 s already
    assert budget.spend(now=10)        # the first one left the window
    assert budget.spent == 3 and not RestartBudget(0, 1).spend(now=0)
    assert [budget.backoff() for _ in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]  # refused in a row: doubling, capped
    assert budget.spend(now=100) and budget.backoff() == 1  # a start resets the ladder
    with pytest.raises(ValueError):
        RestartBudget(-1, 10)


def test_workers_killed_while_idle_leave_no_replica_thread_behind(make_plan, os_processes, engine):
    """Each worker that dies between calls is replaced, and the thread that fed it stops with it
    (it waited for work: a stale one would take work, or a shutdown marker, from the live one)."""
    def replica_threads() -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("omnigraph-stage0-replica"))

    with Omni(deploy_config=make_plan("affine")) as omni:
        for generation in (2, 3, 4):
            (replica,) = engine.replicas(omni)
            os.kill(replica["pid"], signal.SIGKILL)
            asyncio.run(engine.until_serving(omni, generation))
            asyncio.run(engine.until(lambda: len(replica_threads()) == 1, "the dead replica's thread stops"))
        assert omni.generate(SMALL)[0].custom_output["y"].shape == (4, 4)
    assert replica_threads() == []
    assert os_processes.children() == set()
