"""The engine's output step: where a request that reached its end is finished and its caller woken.

Every request reaches its output step exactly once (request_state.py): with its outputs complete,
or failed. The step runs the orchestrator's `finish` (the processor's decoding: FINISHING ->
SUCCEEDED, or FAILED) and sets the request's `done` future. Two places it can run:

- `LoopOutputStep`: on the event loop of an async caller. Replica threads post to it; the first
  request of a burst schedules one drain and the rest join it, so the requests of one batched call
  cost a single `call_soon_threadsafe` (one wake-up of the loop) and the replica thread is free
  for its next call at once. The thread completes a merged call's requests inside `one_wake_up()`,
  so their loop is woken once, after the last: a wake-up written after the first would let the
  loop (on another core, or given the GIL by the write) drain it alone and need another. A post
  from the loop itself (a loop-driven call's reply, a failure at admission, an abort) joins the
  same drain, scheduled without a wake-up.
- `InlineOutputStep`: on whichever thread got there (a replica thread, for the blocking front and
  the startup warm-up), which then sets a `concurrent.futures.Future`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

from omnigraph.stages.request_state import Phase, RequestState

# The orchestrator's finish: FINISHING -> SUCCEEDED or FAILED; nothing for a request already failed.
Finish = Callable[[RequestState], None]


def _settle(request: RequestState) -> None:
    """Set `done` from the request's outcome (an awaiting task cancelled meanwhile leaves it cancelled)."""
    done = request.done
    if done.done():
        return
    if request.phase is Phase.SUCCEEDED:
        done.set_result(request.result)
    else:
        done.set_exception(request.error)


def _running_on(loop: asyncio.AbstractEventLoop) -> bool:
    # asyncio's own lookup without the exception `get_running_loop` raises on a thread with no
    # loop (a replica thread posts here for every request it completes)
    return asyncio._get_running_loop() is loop


class InlineOutputStep:
    """Finish on the posting thread; `done` is a `concurrent.futures.Future` (`RequestState.wait`)."""

    def __init__(self, finish: Finish) -> None:
        self._finish = finish

    def new_future(self) -> Future[Any]:
        return Future()

    def post(self, request: RequestState) -> None:
        self._finish(request)
        _settle(request)


_deferred = threading.local()  # `steps`: the output steps whose drain this thread's `one_wake_up` owes


@contextmanager
def one_wake_up() -> Iterator[None]:
    """Posts from this thread inside the block wake each event loop once, at its end."""
    if getattr(_deferred, "steps", None) is not None:  # nested: the outer block wakes
        yield
        return
    steps: list[LoopOutputStep] = []
    _deferred.steps = steps
    try:
        yield
    finally:
        _deferred.steps = None
        for step in steps:
            step.schedule_drain()


class LoopOutputStep:
    """Finish on one event loop; `done` is an asyncio future of that loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, finish: Finish) -> None:
        self.loop = loop
        self._finish = finish
        self._lock = threading.Lock()
        self._pending: list[RequestState] = []

    def new_future(self) -> asyncio.Future[Any]:
        return self.loop.create_future()

    def post(self, request: RequestState) -> None:
        """From any thread: `request` ended or has its outputs; finish it on the loop."""
        with self._lock:
            self._pending.append(request)
            if len(self._pending) > 1:  # a drain is already scheduled (or owed by a `one_wake_up`)
                return
        owed = getattr(_deferred, "steps", None)
        if owed is not None:
            owed.append(self)
            return
        self.schedule_drain()

    def schedule_drain(self) -> None:
        """Run the drain on the loop: a wake-up from another thread, a callback from the loop's own."""
        try:
            if _running_on(self.loop):  # a loop-driven call's reply, an abort: no wake-up to write
                self.loop.call_soon(self._drain)
            else:
                self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop was closed under its callers: no one waits for the answer
            pass

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for request in pending:
            self._finish(request)
            _settle(request)
