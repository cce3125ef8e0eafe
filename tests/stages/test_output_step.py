"""The output step wakes an event loop once for the requests one call completes together."""

import asyncio
from types import SimpleNamespace

from omnigraph.stages.output_step import LoopOutputStep, one_wake_up
from omnigraph.stages.request_state import Phase


def finished_requests(loop: asyncio.AbstractEventLoop, count: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(phase=Phase.SUCCEEDED, result=index, error=None, done=loop.create_future())
            for index in range(count)]


def count_wake_ups(loop: asyncio.AbstractEventLoop, step: LoopOutputStep) -> list[int]:
    """A one-item list counting the wake-ups of `loop` written for `step`'s drain."""
    wakes = [0]
    call_soon_threadsafe = loop.call_soon_threadsafe

    def counted(callback, *args, **kwargs):
        if getattr(callback, "__self__", None) is step:
            wakes[0] += 1
        return call_soon_threadsafe(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    return wakes


def test_requests_posted_inside_one_wake_up_wake_their_running_loop_once_after_the_last():
    async def serve() -> tuple[list, list[int], int]:
        loop = asyncio.get_running_loop()
        finished: list[int] = []
        step = LoopOutputStep(loop, lambda request: finished.append(request.result))
        wakes = count_wake_ups(loop, step)
        requests = finished_requests(loop, 6)

        def complete_a_call() -> list[int]:  # a replica thread, while the loop runs freely
            seen = []
            with one_wake_up():
                for request in requests:
                    step.post(request)
                    seen.append(wakes[0])
            return seen

        seen = await asyncio.to_thread(complete_a_call)
        results = await asyncio.gather(*(request.done for request in requests))
        return results, seen, wakes[0]

    results, seen_while_posting, wakes = asyncio.run(serve())
    assert results == list(range(6))
    assert seen_while_posting == [0] * 6  # no wake-up written before the last post
    assert wakes == 1


def test_a_nested_one_wake_up_wakes_at_the_outer_end_and_a_post_outside_wakes_at_once():
    async def serve() -> tuple[list[int], list[int]]:
        loop = asyncio.get_running_loop()
        step = LoopOutputStep(loop, lambda request: None)
        wakes = count_wake_ups(loop, step)
        first, second = finished_requests(loop, 2)

        def post() -> list[int]:
            seen = []
            with one_wake_up():
                with one_wake_up():
                    step.post(first)
                seen.append(wakes[0])  # the inner block's end owes nothing: the outer one wakes
            seen.append(wakes[0])
            return seen

        seen = await asyncio.to_thread(post)
        await first.done
        await asyncio.to_thread(step.post, second)
        return list(await asyncio.gather(first.done, second.done)), seen + [wakes[0]]

    results, seen = asyncio.run(serve())
    assert results == [0, 1]
    assert seen == [0, 1, 2]
