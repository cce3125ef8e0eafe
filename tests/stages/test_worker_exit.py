"""A worker that answers its call and then exits: the call's requests get their answers, and the
replica retires as soon as the call ends and is replaced. The stage monitor sees the exit while the
call is still in flight, so it cannot retire the replica then; the call's driver does, when the
call ends. (Before, that notice was dropped: the replica went on "serving" with a dead worker
until a later request met it, which is how a node lost under load left a Ray replica on the lost
node after the load had ended.)"""

import asyncio
import os
import select
import signal
import threading
import time

import numpy as np
import pytest

from omnigraph import AsyncOmni
from omnigraph.stages.errors import StageUnavailable

SMALL = {"tensors": {"x": np.ones((4, 4), np.float32)}}
EXPECTED = np.ones((4, 4), np.float32) * 2 + 1  # the affine bundle: 2x + 1


def exit_after_answering(omni, *, on_loop: bool) -> list[int]:
    """Make stage 0's worker exit (SIGKILL) right after it answers the first call sent from the
    event loop's thread (`on_loop`) or from the replica's own, and hold that call until the stage
    monitor has seen the exit. Returns the killed worker's pid once that happened."""
    (replica,) = omni.runtime.stages[0].replicas
    client, submit, killed = replica.client, replica.client.submit, []

    def submit_then_exit(*args, **kwargs):
        submit(*args, **kwargs)
        if killed or (threading.get_ident() == threading.main_thread().ident) != on_loop:
            return
        ready, _, _ = select.select([client.reply_fd], [], [], 30.0)  # no mailbox: the reply comes on the socket
        assert ready, "the worker never answered"
        os.kill(client.pid, signal.SIGKILL)
        killed.append(client.pid)
        deadline = time.monotonic() + 30.0
        while replica._exited is None:  # the monitor's notice, during this call
            assert time.monotonic() < deadline, "the stage monitor never saw the worker exit"
            time.sleep(0.005)

    client.submit = submit_then_exit
    return killed


async def answer(omni, request_id: str):
    """One request's output, retried as a client retries a 503: a request queued behind the call
    finds no live replica until the replacement serves."""
    while True:
        try:
            async for output in omni.generate(SMALL, request_id=request_id):
                return output
        except StageUnavailable as exc:
            await asyncio.sleep(exc.retry_after or 0.1)


@pytest.mark.parametrize("on_loop", [True, False], ids=["loop-driven call", "thread-driven call"])
def test_a_worker_that_exits_after_answering_is_retired_when_its_call_ends_and_replaced(make_plan, engine, on_loop):
    async def serve():
        async with AsyncOmni(deploy_config=make_plan("affine", mailbox_bytes=0, spin_wait_us=0,
                                                     batching={"max_batch_rows": 8})) as omni:
            killed = exit_after_answering(omni, on_loop=on_loop)
            # a lone request is called from its loop; requests admitted meanwhile by the replica's thread
            answers = await asyncio.gather(*(answer(omni, f"load-{i}") for i in range(1 if on_loop else 8)))
            await engine.until_serving(omni, generation=2)
            (replica,) = engine.replicas(omni)
            after = await engine.first(omni, SMALL, "after")
            return killed, answers, replica, after, omni.runtime.stages[0].last_retirement

    killed, answers, replica, after, retirement = asyncio.run(serve())
    assert len(killed) == 1
    for output in [*answers, after]:
        np.testing.assert_array_equal(output.custom_output["y"], EXPECTED)
    assert replica["generation"] == 2 and replica["pid"] != killed[0]
    assert retirement == f"replica 0 retired: worker {killed[0]} exited with status -9 during a call"
