"""The orchestrator through AsyncOmni/Omni: admission, handoff checks, cancellation, replicas, deadlines."""

import asyncio
import os
import signal
import threading

import numpy as np
import pytest

from omnigraph import AsyncOmni, Omni
from omnigraph.pipelines.deploy import resolve_pipeline
from omnigraph.pipelines.processor import PreparedRequest, RequestInvalid, RequestTooLarge
from omnigraph.stages.errors import (
    DeadlineExceeded,
    PipelineClosed,
    RequestCancelled,
    ResourceUnavailable,
    StageUnavailable,
)
from omnigraph.stages.orchestrator import Orchestrator
from omnigraph.stages.request_state import Phase
from omnigraph.stages.runtime import StageRuntime


BIG = {"tensors": {"x": np.zeros((1024, 1024), np.float32)}}   # a call that runs for many seconds
MEDIUM = {"tensors": {"x": np.zeros((384, 384), np.float32)}}  # a call of about half a second
SMALL = {"tensors": {"x": np.ones((4, 4), np.float32)}}
NO_RESTART = {"max_restarts": 0}  # a retired replica stays retired: later requests fail fast


def test_twenty_concurrent_requests_through_two_stages(make_plan, engine):
    async def main():
        async with AsyncOmni(deploy_config=make_plan("affine", "rename", replicas=2)) as omni:
            inputs = [np.full((i % 3 + 1, 4), i, np.float32) for i in range(20)]
            outputs = await asyncio.gather(*(engine.first(omni, {"tensors": {"x": x}}, f"r{i}") for i, x in enumerate(inputs)))
            return inputs, outputs

    inputs, outputs = asyncio.run(main())
    for i, (x, output) in enumerate(zip(inputs, outputs)):
        assert output.request_id == f"r{i}" and np.array_equal(output.custom_output["z"], 2 * x)


def test_invalid_prompts_are_refused_before_admission(make_plan):
    with Omni(deploy_config=make_plan("affine", max_io_bytes=65536)) as omni:
        with pytest.raises(RequestInvalid, match="'x' is int64, the bundle declares float32"):
            omni.generate([SMALL, {"tensors": {"x": np.ones((1, 4), np.int64)}}])
        with pytest.raises(RequestInvalid, match="shape \\[2, 5\\]"):
            omni.generate({"tensors": {"x": np.ones((2, 5), np.float32)}})
        with pytest.raises(RequestInvalid) as error:
            omni.generate({"x": np.ones((2, 4), np.float32)})
        assert error.value.field == "tensors"
        with pytest.raises(RequestTooLarge, match="the stage's route takes at most 65536"):
            omni.generate({"tensors": {"x": np.ones((4097, 4), np.float32)}})
        assert omni.queue_depth() == 0


def test_handoff_is_checked_against_the_next_bundle(make_plan):
    # the slow stage's output "h200" is not the "y" input the rename bundle declares
    with Omni(deploy_config=make_plan("slow", "rename")) as omni:
        (output,) = omni.generate({"tensors": {"x": np.ones((2, 2), np.float32)}})
    assert output.custom_output is None
    assert output.error.startswith("HandoffInvalid: stage 1 input: inputs do not match the bundle: missing ['y'], unexpected ['h200']")


def test_queue_full_is_refused_at_once(make_plan, engine):
    async def main():
        async with AsyncOmni(deploy_config=make_plan("slow", max_queued_requests=2)) as omni:
            running = [asyncio.create_task(engine.first(omni, BIG, "big")), asyncio.create_task(engine.first(omni, SMALL, "queued"))]
            await engine.until_in_flight(omni, "big")
            assert omni.queue_depth() == 2
            with pytest.raises(ResourceUnavailable, match="queue full: 2 requests admitted"):
                await engine.first(omni, SMALL, "refused")
            await omni.abort(["queued", "big"])
            for task in running:
                with pytest.raises(RequestCancelled):
                    await task
            assert omni.queue_depth() == 0

    asyncio.run(main())


def test_cancelling_an_in_flight_call_fences_it_and_the_worker_serves_on(make_plan, os_processes, engine):
    async def main():
        async with AsyncOmni(deploy_config=make_plan("slow", capacity=1000, demand=300, restart=NO_RESTART)) as omni:
            task = asyncio.create_task(engine.first(omni, MEDIUM, "doomed"))
            await engine.until_in_flight(omni, "doomed")
            (before,) = engine.replicas(omni)
            await omni.abort("doomed")
            with pytest.raises(RequestCancelled, match="doomed was aborted"):
                await task
            answer = await engine.first(omni, SMALL, "later")  # served by the same worker, after the fenced call
            (after,) = engine.replicas(omni)
            return before, after, answer, omni.health(), omni.ledger_snapshot()

    before, after, answer, health, ledger = asyncio.run(main())
    assert answer.custom_output["h200"].shape == (4, 4)
    assert after["pid"] == before["pid"] and after["state"] == "serving" and health == {}
    assert after["fenced_calls"] == 1 and after["epoch"] == 1
    assert [r["state"] for r in ledger["reservations"]] == ["held"]  # nothing quarantined: the worker stayed
    assert os_processes.children() == set()


def test_a_cancelled_call_leaves_the_other_replica_serving(make_plan, engine):
    async def main():
        async with AsyncOmni(deploy_config=make_plan("slow", replicas=2, restart=NO_RESTART)) as omni:
            task = asyncio.create_task(engine.first(omni, MEDIUM, "doomed"))
            await engine.until_in_flight(omni, "doomed")
            await omni.abort("doomed")
            with pytest.raises(RequestCancelled):
                await task
            outputs = [await engine.first(omni, SMALL, f"after-{i}") for i in range(3)]
            states = sorted(r["state"] for r in engine.replicas(omni))
            return outputs, states, omni.health()

    outputs, states, health = asyncio.run(main())
    assert states == ["serving", "serving"] and health == {}
    assert all(o.custom_output["h200"].shape == (4, 4) for o in outputs)


def test_a_queued_request_leaves_without_dispatch(make_plan, engine):
    async def main():
        async with AsyncOmni(deploy_config=make_plan("slow")) as omni:
            running = asyncio.create_task(engine.first(omni, MEDIUM, "running"))
            await engine.until_in_flight(omni, "running")
            queued = asyncio.create_task(engine.first(omni, SMALL, "queued"))
            await asyncio.sleep(0)  # let it be admitted
            await omni.abort("queued")
            with pytest.raises(RequestCancelled):
                await queued
            assert (await running).custom_output["h200"].shape == MEDIUM["tensors"]["x"].shape
            (replica,) = engine.replicas(omni)
            return replica

    replica = asyncio.run(main())
    assert replica["state"] == "serving" and replica["calls"] == 1  # "queued" never reached the worker


def test_deadline_passing_in_the_queue_fails_without_dispatch(make_plan, engine):
    async def main():
        async with AsyncOmni(deploy_config=make_plan("slow")) as omni:
            running = asyncio.create_task(engine.first(omni, MEDIUM, "running"))
            await engine.until_in_flight(omni, "running")
            with pytest.raises(DeadlineExceeded, match="deadline passed while queued for stage 0"):
                await engine.first(omni, SMALL, "late", deadline_s=0.001)
            await running
            return engine.replicas(omni)[0]

    replica = asyncio.run(main())
    assert replica["state"] == "serving" and replica["calls"] == 1


def test_cancelling_the_consumer_aborts_the_request(make_plan, engine):
    async def main():
        async with AsyncOmni(deploy_config=make_plan("slow", replicas=2, restart=NO_RESTART)) as omni:
            task = asyncio.create_task(engine.first(omni, MEDIUM, "gone"))
            await engine.until_in_flight(omni, "gone")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await engine.until(lambda: any(r["fenced_calls"] for r in engine.replicas(omni)), "the call fenced")
            await engine.until(lambda: omni.queue_depth() == 0, "the fenced call ends and gives its slot back")
            return [r["state"] for r in engine.replicas(omni)]

    assert asyncio.run(main()) == ["serving", "serving"]


def test_omni_batches_beyond_the_admission_bound(make_plan):
    with Omni(deploy_config=make_plan("affine", max_queued_requests=2)) as omni:
        inputs = [np.full((1, 4), i, np.float32) for i in range(7)]
        outputs = omni.generate([{"tensors": {"x": x}} for x in inputs])
    assert [o.error for o in outputs] == [None] * 7
    assert all(np.array_equal(o.custom_output["y"], 2 * x + 1) for o, x in zip(outputs, inputs))


def test_a_deadline_inside_a_call_fails_the_request_and_keeps_the_worker(make_plan, engine):
    async def main():
        async with AsyncOmni(deploy_config=make_plan("slow", capacity=100, demand=10, restart=NO_RESTART)) as omni:
            (before,) = engine.replicas(omni)
            # The worker is stopped, so the call cannot end before its deadline however fast the
            # machine; 2 s leave the dispatch all the time a loaded one needs.
            os.kill(before["pid"], signal.SIGSTOP)
            try:
                with pytest.raises(DeadlineExceeded, match="deadline passed inside stage 0; its call was left to finish"):
                    await engine.first(omni, SMALL, "late", deadline_s=2.0)
                await engine.until(lambda: engine.replicas(omni)[0]["fenced_calls"] == 1, "the call fenced")
            finally:
                os.kill(before["pid"], signal.SIGCONT)
            after = await engine.first(omni, SMALL, "after")
            return before, engine.replicas(omni)[0], after, omni.ledger_snapshot()

    before, replica, after, ledger = asyncio.run(main())
    assert after.custom_output["h200"].shape == (4, 4)
    assert replica["pid"] == before["pid"] and replica["state"] == "serving" and replica["fenced_calls"] == 1
    assert ledger["constraints"]["machine:ram"] == {"capacity": 100, "held": 10, "quarantined": 0, "free": 90}


def test_shutdown_with_a_call_in_flight(make_plan, os_processes, engine):
    async def main():
        omni = AsyncOmni(deploy_config=make_plan("slow", capacity=100, demand=10))
        task = asyncio.create_task(engine.first(omni, BIG, "in-flight"))
        await engine.until_in_flight(omni, "in-flight")
        await asyncio.to_thread(omni.shutdown)
        with pytest.raises(PipelineClosed):
            await task
        with pytest.raises(PipelineClosed):
            await engine.first(omni, SMALL, "too-late")
        return omni.ledger_snapshot(), engine.replicas(omni)[0]

    ledger, replica = asyncio.run(main())
    assert ledger["reservations"] == [] and ledger["constraints"]["machine:ram"]["free"] == 100
    assert os_processes.children() == set()
    # the call was not waited for: its worker was killed at shutdown, its exit verified
    assert replica["state"] == "retired" and replica["exit_verified"]


def test_a_worker_killed_while_idle_is_noticed_at_once(make_plan, os_processes, engine):
    """No request has to meet the dead worker: the stage retires it as soon as its process exits
    (with `max_restarts: 0`, the operator's choice, the stage is then down for good)."""
    with Omni(deploy_config=make_plan("affine", restart=NO_RESTART)) as omni:
        (replica,) = engine.replicas(omni)
        os.kill(replica["pid"], signal.SIGKILL)
        asyncio.run(engine.until(lambda: omni.health() != {}, "the stage reports the dead worker"))
        assert "exited while idle with status -9" in omni.health()[0] and omni.health()[0].startswith("failed")
        with pytest.raises(StageUnavailable, match="recreate the pipeline"):
            omni.generate(SMALL)
    assert omni.ledger_snapshot()["reservations"] == []  # released once the exit was verified
    assert os_processes.children() == set()


class RowsProcessor:
    """A processor with several forward calls per request: one per row, answered in order."""

    def prepare(self, request):
        rows = request["rows"]
        return PreparedRequest(calls=tuple({"x": np.full((1, 4), r, np.float32)} for r in rows), context=len(rows))

    def finish(self, prepared, outputs):
        assert len(outputs) == prepared.context
        return [float(o["z"][0, 0]) for o in outputs]


def test_several_work_items_per_request_come_back_in_order(make_plan):
    plan = make_plan("affine", "rename", replicas=2)
    runtime = StageRuntime(resolve_pipeline(plan), plan)
    runtime.start()
    try:
        orchestrator = Orchestrator(runtime, RowsProcessor())
        requests = [orchestrator.submit({"rows": list(range(n, n + 5))}) for n in range(4)]
        answers = [request.wait(60) for request in requests]
        assert answers == [[2.0 * r for r in range(n, n + 5)] for n in range(4)]
        assert all(set(request.stage_durations) == {0, 1} for request in requests)
        assert orchestrator.queue_depth == 4  # admitted until acknowledged
        for request in requests:
            orchestrator.acknowledge(request)
        assert orchestrator.queue_depth == 0
        assert orchestrator.submit({"rows": []}).wait(1) == []  # no forward call at all
    finally:
        runtime.shutdown()


def test_a_result_holds_its_slot_until_acknowledged(make_plan, engine):
    async def main():
        async with AsyncOmni(deploy_config=make_plan("affine", max_queued_requests=1)) as omni:
            generator = omni.generate(SMALL, request_id="held")
            output = await generator.__anext__()
            with pytest.raises(ResourceUnavailable):
                await engine.first(omni, SMALL, "second")
            output.acknowledge()  # a direct user acknowledges; the generator would on advancing
            assert omni.queue_depth() == 0
            await generator.aclose()
            return await engine.first(omni, SMALL, "third")

    assert asyncio.run(main()).request_id == "third"


def test_a_request_admitted_with_a_loop_is_finished_on_that_loop(make_plan):
    plan = make_plan("affine", "rename")
    runtime = StageRuntime(resolve_pipeline(plan), plan)
    runtime.start()
    try:
        processor = RowsProcessor()
        finished_on = []
        original_finish = processor.finish
        processor.finish = lambda prepared, outputs: finished_on.append(threading.get_ident()) or original_finish(prepared, outputs)
        orchestrator = Orchestrator(runtime, processor)

        async def main():
            loop = asyncio.get_running_loop()
            request = orchestrator.submit({"rows": [1, 2, 3]}, loop=loop)
            assert await request.done == [2.0, 4.0, 6.0] and request.phase is Phase.SUCCEEDED

            # a failure reaches the caller's future the same way, and decoding never runs for it
            late = orchestrator.submit({"rows": [5]}, deadline_s=0.0, loop=loop)
            with pytest.raises(DeadlineExceeded, match="deadline passed"):
                await late.done
            assert late.phase is Phase.FAILED and late.result is None
            return threading.get_ident()

        loop_thread = asyncio.run(main())
        assert finished_on == [loop_thread]  # the processor's finish ran on the loop, once

        # without a loop, the thread that completes the outputs finishes it; wait() blocks for it
        blocking = orchestrator.submit({"rows": [4]})
        assert blocking.wait(60) == [8.0] and finished_on[-1] != threading.get_ident()
        orchestrator.close()
    finally:
        runtime.shutdown()


def test_a_fenced_call_keeps_its_admission_until_it_ends(make_plan, engine):
    """The seed contract (DESIGN.md "Wire"): a request gone while its call runs leaves at once, but
    its slot stays counted until the worker is done with the call, so admission never promises a
    busy worker to more requests than the bound."""
    async def main():
        async with AsyncOmni(deploy_config=make_plan("slow", capacity=100, demand=10, restart=NO_RESTART)) as omni:
            task = asyncio.create_task(engine.first(omni, MEDIUM, "gone"))
            await engine.until_in_flight(omni, "gone")
            (replica,) = engine.replicas(omni)
            os.kill(replica["pid"], signal.SIGSTOP)  # the call cannot end while we look
            try:
                await omni.abort("gone")
                with pytest.raises(RequestCancelled):
                    await task
                await engine.until(lambda: engine.replicas(omni)[0]["fenced_calls"] == 1, "the call is fenced")
                while_running = omni.queue_depth()
            finally:
                os.kill(replica["pid"], signal.SIGCONT)
            await engine.until(lambda: omni.queue_depth() == 0, "the fenced call ends and gives its slot back")
            after = await engine.first(omni, SMALL, "after")
            return while_running, after, engine.replicas(omni)[0]

    while_running, after, replica = asyncio.run(main())
    assert while_running == 1
    assert after.custom_output["h200"].shape == (4, 4) and replica["state"] == "serving"
