"""The deadline watch: the one place a request's deadline is checked."""

import gc
import threading
import time
import weakref

from omnigraph.pipelines.processor import PreparedRequest
from omnigraph.stages import deadlines
from omnigraph.stages.deadlines import DeadlineWatch
from omnigraph.stages.output_step import InlineOutputStep
from omnigraph.stages.request_state import RequestState


class _Context:
    """What a prepared request carries for its finish (weakly referable, to see it freed)."""


def _request(name: str, seconds: float) -> RequestState:
    step = InlineOutputStep(lambda request: None)
    return RequestState(name, PreparedRequest(calls=(), context=_Context()), time.monotonic() + seconds, step.post,
                        step.new_future())


def _expiries():
    expired: list[str] = []
    seen = threading.Semaphore(0)

    def expire(request: RequestState) -> None:
        expired.append(request.request_id)
        seen.release()

    return expired, seen, expire


def test_requests_expire_in_deadline_order_and_an_earlier_one_wakes_the_watch():
    expired, seen, expire = _expiries()
    watch = DeadlineWatch(expire)
    try:
        watch.watch(_request("late", 60))
        watch.watch(_request("soon", 0.05))  # earlier than the one the watch sleeps for
        watch.watch(_request("sooner", 0.01))
        assert seen.acquire(timeout=10) and seen.acquire(timeout=10)
        assert expired == ["sooner", "soon"]
    finally:
        watch.close()


def test_a_request_that_ended_or_was_unwatched_does_not_expire():
    expired, seen, expire = _expiries()
    watch = DeadlineWatch(expire)
    try:
        ended = _request("ended", 0.01)
        ended.fail(RuntimeError("failed first"))
        watch.watch(ended)
        watch.unwatch(watch.watch(_request("answered", 0.01)))
        watch.watch(_request("marker", 0.05))
        assert seen.acquire(timeout=10)
        assert expired == ["marker"]
    finally:
        watch.close()


def test_unwatching_drops_the_request_at_once(monkeypatch):
    monkeypatch.setattr(deadlines, "COMPACT_ABOVE", 8)
    watch = DeadlineWatch(lambda request: None)
    try:
        request = _request("answered", 60)
        gone = weakref.ref(request.prepared.context)
        entry = watch.watch(request)
        watch.unwatch(entry)
        del request
        gc.collect()
        assert gone() is None  # nothing it holds outlives it for its deadline's 60 s

        # empty entries are dropped from the heap once they are the majority
        entries = [watch.watch(_request(f"r{i}", 60)) for i in range(20)]
        for entry in entries[:15]:
            watch.unwatch(entry)
        assert len(watch._heap) < 21 - 10  # 21 watched, 16 unwatched
    finally:
        watch.close()
