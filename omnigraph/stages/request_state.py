"""One admitted request's lifecycle: a small state machine with exactly one end.

    QUEUED(s) -> RUNNING(s) -> QUEUED(s+1) -> ... -> FINISHING -> SUCCEEDED
    any phase before SUCCEEDED -> FAILED

Stages move a request between QUEUED and RUNNING through its work items; the last stored output
moves it to FINISHING; only the engine's output step (output_step.py) moves it on to SUCCEEDED.
`fail` ends it from any thread, at most once, whoever gets there first (the deadline watch, an
abort, a replica, a handoff, shutdown). The request reaches its output step exactly once: when its
outputs are complete, or when it failed first.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import numpy as np

from omnigraph.pipelines.processor import PreparedRequest


class Phase(enum.Enum):
    QUEUED = "queued"  # a work item waits for a replica of `stage_id`
    RUNNING = "running"  # a call that carries it runs at `stage_id`
    FINISHING = "finishing"  # every output is in; the output step turns them into the result
    SUCCEEDED = "succeeded"
    FAILED = "failed"


# What a request's end is delivered to: its output step's `post`.
Deliver = Callable[["RequestState"], None]


class RequestState:
    """One admitted request: its prepared calls, its outputs so far, its phase, and its outcome.

    `done` is the future its caller awaits: an asyncio future of the caller's loop (the async
    front) or a `concurrent.futures.Future` (the blocking front, `wait`); only the output step
    sets it.
    """

    __slots__ = ("request_id", "prepared", "deadline", "stage_durations", "phase", "stage_id", "result", "error",
                 "done", "deadline_entry", "_outputs", "_remaining", "_lock", "_deliver", "_delivered")

    def __init__(self, request_id: str, prepared: PreparedRequest, deadline: float | None, deliver: Deliver,
                 done: Any) -> None:
        self.request_id = request_id
        self.prepared = prepared
        self.deadline = deadline  # time.monotonic() by which it must have ended, or None
        self.stage_durations: dict[int, float] = {}
        self.phase = Phase.QUEUED
        self.stage_id: int | None = None  # where it is while QUEUED or RUNNING
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = done
        self.deadline_entry: list | None = None  # the deadline watch's, while it watches
        self._outputs: list[Mapping[str, np.ndarray] | None] = [None] * len(prepared.calls)
        self._remaining = len(prepared.calls)
        self._lock = threading.Lock()
        self._deliver = deliver
        self._delivered = False

    @property
    def finished(self) -> bool:
        """Whether it has ended (succeeded or failed): nothing more is done for it."""
        return self.phase is Phase.SUCCEEDED or self.phase is Phase.FAILED

    @property
    def live(self) -> bool:
        """Whether its work is still wanted (not ended, not past its outputs)."""
        return self.phase is Phase.QUEUED or self.phase is Phase.RUNNING

    def queued_at(self, stage_id: int) -> None:
        self._move(Phase.QUEUED, stage_id)

    def running_at(self, stage_id: int) -> None:
        self._move(Phase.RUNNING, stage_id)

    def _move(self, phase: Phase, stage_id: int) -> None:
        with self._lock:
            if self.live:
                self.phase, self.stage_id = phase, stage_id

    def add_duration(self, stage_id: int, seconds: float) -> None:
        """Add a finished call's duration to its stage's total."""
        with self._lock:
            self.stage_durations[stage_id] = self.stage_durations.get(stage_id, 0.0) + seconds

    def add_outputs(self, index: int, outputs: Mapping[str, np.ndarray]) -> None:
        """Keep the final stage's outputs of one work item; the last one moves the request to
        FINISHING and delivers it to its output step."""
        with self._lock:
            if not self.live:
                return
            self._outputs[index] = outputs
            self._remaining -= 1
            if self._remaining:
                return
            self.phase, self.stage_id = Phase.FINISHING, None
        self._deliver_once()

    def outputs_complete(self) -> None:
        """A request with no work at all: straight to FINISHING."""
        with self._lock:
            self.phase = Phase.FINISHING
        self._deliver_once()

    def take_outputs(self) -> list[Mapping[str, np.ndarray]]:
        outputs, self._outputs = self._outputs, []
        return outputs  # type: ignore[return-value]  # FINISHING: every work item stored its outputs

    def fail(self, error: BaseException) -> bool:
        """End the request with `error` unless it ended already; True if this call ended it."""
        with self._lock:
            if self.finished:
                return False
            self.phase, self.error = Phase.FAILED, error
            self._outputs = []
        self._deliver_once()
        return True

    def succeed(self, result: Any) -> bool:
        """The output step's end: FINISHING -> SUCCEEDED; False when it failed meanwhile."""
        with self._lock:
            if self.phase is not Phase.FINISHING:
                return False
            self.phase, self.result = Phase.SUCCEEDED, result
        return True

    def _deliver_once(self) -> None:
        with self._lock:
            if self._delivered:
                return
            self._delivered = True
        self._deliver(self)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until it ended (the blocking front only): the result, or its error raised."""
        if not isinstance(self.done, Future):
            raise TypeError(f"request {self.request_id} finishes on an event loop: await request.done")
        return self.done.result(timeout)
