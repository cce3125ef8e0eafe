"""The batch-1 path: a lone request of an async caller is called from its event loop, with no
thread hand-off, while requests under load still go through the replicas' threads, which batch."""

import asyncio
import threading

import numpy as np

from omnigraph import AsyncOmni, Omni

SMALL = {"tensors": {"x": np.ones((4, 4), np.float32)}}
MEDIUM = {"tensors": {"x": np.zeros((384, 384), np.float32)}}  # a call of about half a second


def record_calls(omni) -> list[tuple[bool, bool]]:
    """(sent from the event loop's thread, sent through the socket) for every call of stage 0."""
    calls: list[tuple[bool, bool]] = []
    for replica in omni.runtime.stages[0].replicas:
        submit = replica.client.submit

        def recorded(*args, _submit=submit, **kwargs):
            calls.append((threading.get_ident() == threading.main_thread().ident, kwargs.get("via_socket", False)))
            return _submit(*args, **kwargs)

        replica.client.submit = recorded
    return calls


def test_a_lone_request_is_called_from_its_loop_and_requests_under_load_by_the_replica_threads(make_plan, engine):
    async def serve():
        # spin_wait_us 0: no call returns within the spin window, so a lone one is always the loop's
        plan = make_plan("affine", batching={"max_batch_rows": 8}, spin_wait_us=0)
        async with AsyncOmni(deploy_config=plan) as omni:
            calls = record_calls(omni)
            alone = [await engine.first(omni, SMALL, f"alone-{i}") for i in range(3)]
            lone_calls = list(calls)
            calls.clear()
            together = await asyncio.gather(*(engine.first(omni, SMALL, f"load-{i}") for i in range(8)))
            return alone, lone_calls, together, calls

    alone, lone_calls, together, load_calls = asyncio.run(serve())
    expected = np.ones((4, 4), np.float32) * 2 + 1
    for output in alone + together:
        np.testing.assert_allclose(output.custom_output["y"], expected)
    assert lone_calls == [(True, True)] * 3  # on the loop's thread, the reply on the socket the loop watches
    # eight requests admitted in one turn of the loop: the first, alone when it came, is called from
    # the loop; the seven admitted meanwhile wait for the replica, whose thread merges them
    first, *rest = load_calls
    assert first == (True, True) and rest and len(rest) < 7 and all(on_loop is False for on_loop, _ in rest)


async def answer(omni, prompt, request_id):
    """One request's output, its generator read to the end (which acknowledges the result, as a
    caller that reads it out does): the next request then finds no other admitted."""
    async for output in omni.generate(prompt, request_id=request_id):
        final = output
    return final


def test_a_lone_call_that_returns_within_the_spin_window_is_polled_for_by_its_loop(make_plan, engine):
    async def serve():
        async with AsyncOmni(deploy_config=make_plan("affine", spin_wait_us=100_000)) as omni:
            calls = record_calls(omni)
            outputs = [await answer(omni, SMALL, f"alone-{i}") for i in range(3)]
            return calls, outputs, engine.replicas(omni)

    calls, outputs, (replica,) = asyncio.run(serve())
    # the first call's reply wakes the loop (nothing is known yet); it returned within 100 ms, so the
    # loop sends the next ones through the mailbox and polls for their replies itself
    assert calls == [(True, True), (True, False), (True, False)]
    for output in outputs:
        np.testing.assert_allclose(output.custom_output["y"], np.ones((4, 4), np.float32) * 2 + 1)
    assert replica["calls"] == 3 and replica["fenced_calls"] == 0


def test_a_polled_call_that_outlasts_the_spin_window_is_finished_by_the_replica_thread(make_plan, engine):
    async def serve():
        async with AsyncOmni(deploy_config=make_plan("slow", spin_wait_us=100_000)) as omni:
            calls = record_calls(omni)
            quick = await answer(omni, SMALL, "quick")  # teaches the replica its calls are short
            slow = await answer(omni, MEDIUM, "slow")  # polled for 100 ms, then the thread's
            after = await answer(omni, SMALL, "after")
            return calls, (quick, slow, after), engine.replicas(omni)

    calls, outputs, (replica,) = asyncio.run(serve())
    # (the third call is the loop's, or the thread's if it still held the replica when the loop came)
    assert calls[:2] == [(True, True), (True, False)] and len(calls) == 3
    assert [output.custom_output["h200"].shape for output in outputs] == [(4, 4), (384, 384), (4, 4)]
    assert replica["calls"] == 3 and replica["state"] == "serving" and replica["fenced_calls"] == 0


def test_short_calls_under_load_go_to_the_replica_thread(make_plan, engine):
    async def serve():
        async with AsyncOmni(deploy_config=make_plan("affine", spin_wait_us=100_000)) as omni:
            await answer(omni, SMALL, "teach")  # its calls return within the spin window
            calls = record_calls(omni)
            outputs = await asyncio.gather(*(answer(omni, SMALL, f"load-{i}") for i in range(8)))
            return calls, outputs

    calls, outputs = asyncio.run(serve())
    for output in outputs:
        np.testing.assert_allclose(output.custom_output["y"], np.ones((4, 4), np.float32) * 2 + 1)
    # the first, alone when it came, is polled for by the loop; the seven admitted before its caller
    # took its result are not (a loop that polls serves nothing else): the replica's thread calls them
    first, *rest = calls
    assert first == (True, False) and rest and all(on_loop is False for on_loop, _ in rest)


def test_a_loop_that_ends_with_its_call_in_flight_hands_the_call_to_the_replica_thread(make_plan, engine):
    async def abandon(omni):
        omni.orchestrator.submit(MEDIUM, request_id="abandoned", loop=asyncio.get_running_loop())
        await engine.until_in_flight(omni, "abandoned")
        # returning ends asyncio.run: the loop stops with the call in flight, its reader never runs again

    with Omni(deploy_config=make_plan("slow")) as omni:
        asyncio.run(abandon(omni))
        # the replica's thread, given this request, finds the driver held by a stopped loop: it takes
        # the call over, waits for its reply, then serves this one
        assert omni.generate(SMALL)[0].custom_output["h200"].shape == (4, 4)
        (replica,) = engine.replicas(omni)
        assert replica["calls"] == 2 and replica["state"] == "serving"
