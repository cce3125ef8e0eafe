"""The orchestrator: admission, stage-to-stage handoff, cancellation and deadlines.

A request is prepared by the pipeline's processor (nothing reaches a stage before the whole
request is valid), admitted against a bounded queue (full: `ResourceUnavailable` at once), and
its work items enter the first stage. Each stage's replicas run the calls (one call may carry
compatible work items of several requests where the stage declares batching); when a call
returns, the replica hands each item's outputs here (`_advance`): to the next stage (through the
stage's `custom_process_input_func`, checked against the inputs the next bundle declares) or, after
the final stage, into the request, whose last output delivers it to its output step
(output_step.py), where `finish` runs the processor's decoding and the caller's future is set.

One lifecycle (request_state.py): one way to end a request with an error (`RequestState.fail`),
one place that checks deadlines (`DeadlineWatch`, which calls `_expire`), one that cancels
(`_end`: fail, then interrupt every stage), one that finishes (`finish`, on the output step).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np

from omnigraph.bundles.defaults import DEFAULT_MAX_QUEUED_REQUESTS
from omnigraph.pipelines.processor import PreparedRequest, Processor
from omnigraph.stages.deadlines import DeadlineWatch
from omnigraph.stages.errors import (
    DeadlineExceeded,
    HandoffInvalid,
    PipelineClosed,
    RequestCancelled,
    ResourceUnavailable,
    StageUnavailable,
)
from omnigraph.stages.output_step import InlineOutputStep, LoopOutputStep
from omnigraph.stages.protocols import Stage
from omnigraph.stages.request_state import Phase, RequestState
from omnigraph.stages.runtime import StageRuntime
from omnigraph.stages.tensors import check_tensors


class _WorkItem:
    """One forward call of a request at one position of the chain (see protocols.WorkItem)."""

    __slots__ = ("request", "index", "position", "stage_id", "tensors", "request_id", "_orchestrator")

    def __init__(self, orchestrator: Orchestrator, request: RequestState, index: int, position: int,
                 tensors: Mapping[str, np.ndarray]) -> None:
        self._orchestrator = orchestrator
        self.request = request
        self.index = index
        self.position = position
        self.stage_id = orchestrator._chain[position].stage_id
        self.tensors = tensors
        self.request_id = request.request_id

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        done = self.request.done
        return done.get_loop() if isinstance(done, asyncio.Future) else None

    def is_live(self) -> bool:
        return self.request.live

    def dispatched(self) -> None:
        self.request.running_at(self.stage_id)

    def complete(self, outputs: dict[str, np.ndarray], seconds: float) -> None:
        self._orchestrator._advance(self, outputs, seconds)

    def fail(self, error: BaseException) -> None:
        self.request.fail(error)

    def keep_admission(self) -> Callable[[], None]:
        return self._orchestrator._keep_slot()


class AdmissionHold:
    """Queue slots set aside for a group of requests admitted as a unit (a batch route): requests
    admitted with it take its slots instead of facing the bound; `release` gives back the rest.
    Get one from `Orchestrator.hold`."""

    def __init__(self, orchestrator: Orchestrator, slots: int) -> None:
        self._orchestrator = orchestrator
        self.slots = slots

    def take(self) -> None:
        """One slot leaves the hold for a request now admitted (which then counts on its own)."""
        with self._orchestrator._lock:
            if self.slots < 1:
                raise ValueError("the admission hold has no slot left")
            self.slots -= 1
            self._orchestrator._held -= 1

    def release(self) -> None:
        """Give back the slots no request took (idempotent)."""
        with self._orchestrator._lock:
            self._orchestrator._held -= self.slots
            self.slots = 0

    def __enter__(self) -> AdmissionHold:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class Orchestrator:
    """Moves requests of one pipeline through its stages."""

    def __init__(self, runtime: StageRuntime, processor: Processor, *,
                 max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS) -> None:
        if max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        self.runtime = runtime
        self.processor = processor
        self.max_queued_requests = max_queued_requests
        self._chain: Sequence[Stage] = runtime.ordered_stages
        self._active: dict[str, RequestState] = {}
        # slots counted beside the admitted requests: set aside by AdmissionHolds and not yet taken,
        # or kept by fenced calls still running for requests already gone
        self._held = 0
        self._in_flight = 0  # admitted requests whose outputs are not all in: they may still bring work
        for stage in self._chain:
            stage.count_requests(self._active.__len__, lambda: self._in_flight)
        self._lock = threading.Lock()
        # ids of requests admitted without one: unique without a random draw (a system call) each
        self._id_prefix = uuid.uuid4().hex[:16]
        self._id_counter = itertools.count()
        self._closed = False
        self._inline_step = InlineOutputStep(self.finish)
        self._loop_step: LoopOutputStep | None = None  # of the event loop that last admitted a request
        self._deadlines = DeadlineWatch(self._expire)

    @property
    def queue_depth(self) -> int:
        """Admitted requests not yet acknowledged (queued, running or holding a result), plus the
        slots held for requests about to be admitted as a unit and by fenced calls still running."""
        return len(self._active) + self._held

    def requests_by_phase(self) -> dict[Phase, int]:
        """Admitted requests not yet acknowledged, by lifecycle phase (every phase, zeros
        included): a snapshot for metrics, read under the lock; a request may move on meanwhile."""
        with self._lock:
            requests = list(self._active.values())
        counts = dict.fromkeys(Phase, 0)
        for request in requests:
            counts[request.phase] += 1
        return counts

    def _keep_slot(self) -> Callable[[], None]:
        """One queue slot for a fenced call still running (WorkItem.keep_admission); the returned
        function gives it back, once."""
        with self._lock:
            self._held += 1
        kept = [True]

        def release() -> None:
            with self._lock:
                if kept:
                    kept.clear()
                    self._held -= 1

        return release

    def hold(self, slots: int) -> AdmissionHold:
        """Set `slots` queue slots aside at once, for requests to be admitted as a unit (each with
        `hold=`); ResourceUnavailable when the queue cannot take them all now, ValueError when it
        never could."""
        if slots > self.max_queued_requests:
            raise ValueError(f"{slots} requests cannot be admitted as a unit: at most "
                             f"max_queued_requests={self.max_queued_requests} are queued at once")
        with self._lock:
            if self._closed:
                raise PipelineClosed("the pipeline is shut down")
            free = self.max_queued_requests - len(self._active) - self._held
            if slots > free:
                raise ResourceUnavailable(f"queue full: {slots} requests to admit as a unit, {free} slots free "
                                          f"(max_queued_requests={self.max_queued_requests})")
            self._held += slots
        return AdmissionHold(self, slots)

    def submit(self, prompt: Mapping[str, Any], *, request_id: str | None = None,
               deadline_s: float | None = None, hold: AdmissionHold | None = None,
               loop: asyncio.AbstractEventLoop | None = None) -> RequestState:
        """Prepare and admit a request (its deadline counts from now, preparation included);
        raises `RequestInvalid`, `ResourceUnavailable`, `StageUnavailable`, `PipelineClosed`."""
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        return self._admit(self.processor.prepare(prompt), request_id, deadline, hold, loop)

    def admit(self, prepared: PreparedRequest, *, request_id: str | None = None,
              deadline_s: float | None = None, hold: AdmissionHold | None = None,
              loop: asyncio.AbstractEventLoop | None = None) -> RequestState:
        """Admit an already prepared request and queue its work in the first stage.

        With `loop`, the request is finished on that event loop and `request.done` is an asyncio
        future of it; without, on the thread that completes its outputs, and `request.wait()`
        blocks for it. With `hold`, it takes one of the hold's slots instead of facing the queue
        bound."""
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        return self._admit(prepared, request_id, deadline, hold, loop)

    def _admit(self, prepared: PreparedRequest, request_id: str | None, deadline: float | None,
               hold: AdmissionHold | None, loop: asyncio.AbstractEventLoop | None) -> RequestState:
        self._check_open()
        request_id = request_id if request_id is not None else f"{self._id_prefix}-{next(self._id_counter)}"
        step = self._output_step(loop)
        with self._lock:
            if self._closed:
                raise PipelineClosed("the pipeline is shut down")
            if request_id in self._active:
                raise ValueError(f"request id {request_id!r} is already in flight")
            if hold is None and len(self._active) + self._held >= self.max_queued_requests:
                raise ResourceUnavailable(
                    f"queue full: {len(self._active) + self._held} requests admitted or held "
                    f"(max_queued_requests={self.max_queued_requests})"
                )
            request = RequestState(request_id, prepared, deadline, partial(self._deliver, step.post),
                                   step.new_future())
            self._active[request_id] = request
            self._in_flight += 1
        if hold is not None:
            hold.take()
        if deadline is not None:
            request.deadline_entry = self._deadlines.watch(request)
        if not prepared.calls:
            request.outputs_complete()
            return request
        try:
            for index, tensors in enumerate(prepared.calls):
                self._queue(_WorkItem(self, request, index, 0, tensors))
        except StageUnavailable as exc:
            request.fail(exc)
        return request

    def _deliver(self, post: Callable[[RequestState], None], request: RequestState) -> None:
        """A request reached its end (outputs all in, or failed): it brings no more work; to its
        output step."""
        with self._lock:
            self._in_flight -= 1
        post(request)

    def _output_step(self, loop: asyncio.AbstractEventLoop | None) -> InlineOutputStep | LoopOutputStep:
        if loop is None:
            return self._inline_step
        step = self._loop_step
        if step is None or step.loop is not loop:
            step = self._loop_step = LoopOutputStep(loop, self.finish)
        return step

    def _queue(self, item: _WorkItem) -> None:
        item.request.queued_at(item.stage_id)
        self._chain[item.position].submit(item)

    def _check_open(self) -> None:
        if self._closed:
            raise PipelineClosed("the pipeline is shut down")
        for stage in self._chain:
            stage.check_available()

    def acknowledge(self, request: RequestState) -> None:
        """The caller has the result: the request leaves the admission count."""
        with self._lock:
            if self._active.get(request.request_id) is request:
                del self._active[request.request_id]
        if request.deadline_entry is not None:
            self._deadlines.unwatch(request.deadline_entry)

    def abort(self, request_id: str) -> bool:
        """Cancel a request: it fails at once; queued work leaves undispatched; a graph call in
        flight is fenced once none of its requests waits (its worker serves on), a native one aborted."""
        request = self._active.get(request_id)
        return request is not None and self._end(request, RequestCancelled(f"request {request_id} was aborted"))

    def _expire(self, request: RequestState) -> None:
        """The deadline watch: the request's deadline passed before it ended."""
        phase, stage_id = request.phase, request.stage_id
        if phase is Phase.QUEUED:
            where = f"while queued for stage {stage_id}"
        elif phase is Phase.RUNNING:
            where = f"inside stage {stage_id}; its call was left to finish"
        else:
            where = "before it finished"
        self._end(request, DeadlineExceeded(f"request {request.request_id}: deadline passed {where}"))

    def _end(self, request: RequestState, error: BaseException) -> bool:
        """Fail the request unless it ended already, then interrupt its work at every stage; True
        if this call ended it. The one way an abort, a deadline and shutdown end a request."""
        if not request.fail(error):
            return False
        for stage in self._chain:
            stage.interrupt(request.request_id, str(error))
        return True

    def close(self) -> None:
        """Refuse new requests and fail every unfinished one; calls in flight for them retire their
        workers, which are no longer replaced."""
        self.runtime.stop_replacing()
        with self._lock:
            self._closed = True
            pending = list(self._active.values())
        for request in pending:
            self._end(request, PipelineClosed(f"request {request.request_id}: the pipeline shut down"))
        self._deadlines.close()

    def _advance(self, item: _WorkItem, outputs: dict[str, np.ndarray], seconds: float) -> None:
        """From a replica: one work item's outputs go to the next stage, or into the request."""
        request = item.request
        stage = self._chain[item.position]
        request.add_duration(stage.stage_id, seconds)
        position = item.position + 1
        if position == len(self._chain):
            request.add_outputs(item.index, outputs)
            return
        following = self._chain[position]
        try:
            produced = following.handoff({stage.stage_id: outputs}, request.prepared.calls[item.index])
            if not isinstance(produced, Mapping) or set(produced) != {"tensors"}:
                raise HandoffInvalid(f"stage {following.stage_id}: custom_process_input_func must return "
                                     "{'tensors': {...}}")
            tensors = check_tensors(f"stage {following.stage_id} input", produced["tensors"], following.input_specs)
            self._queue(_WorkItem(self, request, item.index, position, tensors))
        except Exception as exc:  # a handoff fault fails this request, never the replica thread
            request.fail(exc)

    def finish(self, request: RequestState) -> None:
        """The output step's work: a request with every output in becomes its result (the
        processor's `finish`), or fails; a request that already failed is left as it is."""
        if request.phase is not Phase.FINISHING:
            return
        try:
            result = self.processor.finish(request.prepared, request.take_outputs())
        except Exception as exc:
            request.fail(exc)
            return
        request.succeed(result)
