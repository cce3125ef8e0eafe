"""The orchestrator: admission, stage-to-stage handoff, cancellation and deadlines.

A request is prepared by the pipeline's processor (nothing reaches a stage before the whole
request is valid), admitted against a bounded queue (full: `ResourceUnavailable` at once), and
its work items enter the first stage. Each stage's replica threads run the calls (one call may
carry compatible work items of several requests where the stage declares batching); when a call
returns, the same thread hands the outputs to the next stage (through the stage's
`custom_process_input_func`, checked against the inputs the next bundle declares) or, after the
final stage, hands the request back to its caller, who finishes it with the processor
(`Orchestrator.finish`). The caller only waits for a callback, so the whole path costs two thread
hand-offs (into the replica thread, back to the caller).

Finishing (the processor's `finish`: decoding, the response) runs on the caller's thread when the
request was admitted with `on_ready` (the async front: its event loop), so a replica thread goes
straight from one call's outputs to its next call; without `on_ready` the replica thread finishes
the request itself and `RequestState.wait` returns the result.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from omnigraph.bundles.defaults import DEFAULT_MAX_QUEUED_REQUESTS
from omnigraph.pipelines.processor import PreparedRequest, Processor
from omnigraph.stages.errors import (
    DeadlineExceeded,
    HandoffInvalid,
    PipelineClosed,
    RequestCancelled,
    ResourceUnavailable,
    StageUnavailable,
)
from omnigraph.stages.protocols import Stage
from omnigraph.stages.runtime import StageRuntime
from omnigraph.stages.tensors import check_tensors

OnReady = Callable[["RequestState"], None]


class RequestState:
    """One admitted request: its prepared work, its outputs so far, and its outcome once finished.

    Completion is a plain callback (`on_ready`, given at admission) rather than a concurrent
    Future: it is called once, from whichever thread gets there first, when the request's outputs
    are complete (its receiver then calls `Orchestrator.finish`) or when the request failed. The
    blocking front admits without it and waits with `wait`.
    """

    __slots__ = ("request_id", "prepared", "deadline", "stage_durations", "finished", "result", "error",
                 "_outputs", "_remaining", "_lock", "_on_ready", "_handed_over", "_event")

    def __init__(self, request_id: str, prepared: PreparedRequest, deadline: float | None,
                 on_ready: OnReady | None = None) -> None:
        self.request_id = request_id
        self.prepared = prepared
        self.deadline = deadline
        self.stage_durations: dict[int, float] = {}
        self.finished = False
        self.result: Any = None
        self.error: BaseException | None = None
        self._outputs: list[Mapping[str, np.ndarray] | None] = [None] * len(prepared.work)
        self._remaining = len(prepared.work)
        self._lock = threading.Lock()
        self._on_ready = on_ready
        self._handed_over = False
        self._event: threading.Event | None = None

    def remaining_time(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def record(self, stage_id: int, seconds: float) -> None:
        """Add a finished call's duration to its stage's total."""
        with self._lock:
            self._record_locked(stage_id, seconds)

    def store(self, stage_id: int, seconds: float, index: int, outputs: Mapping[str, np.ndarray]) -> bool:
        """Record the final stage's call and keep its outputs; True when no work item is outstanding."""
        with self._lock:
            self._record_locked(stage_id, seconds)
            self._outputs[index] = outputs
            self._remaining -= 1
            return self._remaining == 0

    def _record_locked(self, stage_id: int, seconds: float) -> None:
        self.stage_durations[stage_id] = self.stage_durations.get(stage_id, 0.0) + seconds

    def take_outputs(self) -> list[Mapping[str, np.ndarray]]:
        outputs, self._outputs = self._outputs, []
        return outputs  # type: ignore[return-value]  # no None left: every work item stored its outputs

    def hand_over(self) -> bool:
        """Call `on_ready` unless it was called already; False when the request has none (then
        whoever completed its outputs finishes it)."""
        if self._on_ready is None:
            return False
        with self._lock:
            if self._handed_over:
                return True
            self._handed_over = True
        self._on_ready(self)
        return True

    def wait(self, timeout: float | None = None) -> Any:
        """Block until finished; the result, or the request's error raised."""
        with self._lock:
            if not self.finished and self._event is None:
                self._event = threading.Event()
            event = self._event
        if event is not None and not event.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.result

    def resolve(self, result: Any) -> None:
        self._settle(result, None)

    def reject(self, error: BaseException) -> bool:
        """Fail the request unless it already finished; True if this call failed it."""
        return self._settle(None, error)

    def _settle(self, result: Any, error: BaseException | None) -> bool:
        with self._lock:
            if self.finished:
                return False
            self.finished = True
            self.result, self.error = result, error
            self._outputs = []
            event = self._event
        if event is not None:
            event.set()
        self.hand_over()  # a failure reaches the receiver the same way (its finish then does nothing)
        return True


class _WorkItem:
    """One forward call of a request at one position of the chain (see protocols.WorkItem)."""

    __slots__ = ("request", "index", "position", "tensors", "request_id", "_orchestrator")

    def __init__(self, orchestrator: Orchestrator, request: RequestState, index: int, position: int,
                 tensors: Mapping[str, np.ndarray]) -> None:
        self._orchestrator = orchestrator
        self.request = request
        self.index = index
        self.position = position
        self.tensors = tensors
        self.request_id = request.request_id

    def is_live(self) -> bool:
        return not self.request.finished

    def remaining(self) -> float | None:
        return self.request.remaining_time()

    def complete(self, outputs: dict[str, np.ndarray], seconds: float) -> None:
        self._orchestrator._advance(self, outputs, seconds)

    def fail(self, error: BaseException) -> None:
        self.request.reject(error)

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
        for stage in self._chain:
            stage.count_admissions(self._active.__len__)
        self._lock = threading.Lock()
        # ids of requests admitted without one: unique without a random draw (a system call) each
        self._id_prefix = uuid.uuid4().hex[:16]
        self._id_counter = itertools.count()
        self._closed = False

    @property
    def queue_depth(self) -> int:
        """Admitted requests not yet acknowledged (queued, running or holding a result), plus the
        slots held for requests about to be admitted as a unit and by fenced calls still running."""
        return len(self._active) + self._held

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
               deadline_s: float | None = None, on_ready: OnReady | None = None,
               hold: AdmissionHold | None = None) -> RequestState:
        """Prepare and admit a request; raises `RequestInvalid`, `ResourceUnavailable`, `StageUnavailable`."""
        return self.admit(self.processor.prepare(prompt), request_id=request_id, deadline_s=deadline_s,
                          on_ready=on_ready, hold=hold)

    def admit(self, prepared: PreparedRequest, *, request_id: str | None = None,
              deadline_s: float | None = None, on_ready: OnReady | None = None,
              hold: AdmissionHold | None = None) -> RequestState:
        """Admit an already prepared request and queue its work in the first stage. With
        `on_ready`, the request is handed to it once its outputs are complete (or it failed) and
        its receiver finishes it (`finish`); without, the replica thread finishes it. With `hold`,
        it takes one of the hold's slots instead of facing the queue bound."""
        self._check_open()
        request_id = request_id if request_id is not None else f"{self._id_prefix}-{next(self._id_counter)}"
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
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
            request = RequestState(request_id, prepared, deadline, on_ready)
            self._active[request_id] = request
        if hold is not None:
            hold.take()
        if not prepared.work:
            self._outputs_ready(request)
            return request
        entry = self._chain[0]
        try:
            for index, tensors in enumerate(prepared.work):
                entry.submit(_WorkItem(self, request, index, 0, tensors))
        except StageUnavailable as exc:
            request.reject(exc)
        return request

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

    def abort(self, request_id: str) -> bool:
        """Cancel a request: it fails at once; queued work leaves undispatched; a graph call in
        flight is fenced once none of its requests waits (its worker serves on), a native one aborted."""
        request = self._active.get(request_id)
        if request is None or not request.reject(RequestCancelled(f"request {request_id} was aborted")):
            return False
        self._interrupt(request_id, f"request {request_id} cancelled during its call")
        return True

    def _interrupt(self, request_id: str, reason: str) -> None:
        for stage in self._chain:
            stage.interrupt(request_id, reason)

    def close(self) -> None:
        """Refuse new requests and fail every unfinished one; calls in flight for them retire their
        workers, which are no longer replaced."""
        self.runtime.stop_replacing()
        with self._lock:
            self._closed = True
            pending = list(self._active.values())
        for request in pending:
            if request.reject(PipelineClosed(f"request {request.request_id}: the pipeline shut down")):
                self._interrupt(request.request_id, f"request {request.request_id} in flight at shutdown")

    def _advance(self, item: _WorkItem, outputs: dict[str, np.ndarray], seconds: float) -> None:
        """In the replica thread: hand the outputs to the next stage, or finish the request."""
        request = item.request
        stage = self._chain[item.position]
        position = item.position + 1
        if position == len(self._chain):
            if request.store(stage.stage_id, seconds, item.index, outputs):
                self._outputs_ready(request)
            return
        request.record(stage.stage_id, seconds)
        following = self._chain[position]
        try:
            produced = following.handoff({stage.stage_id: outputs}, request.prepared.work[item.index])
            if not isinstance(produced, Mapping) or set(produced) != {"tensors"}:
                raise HandoffInvalid(f"stage {following.stage_id}: custom_process_input_func must return "
                                     "{'tensors': {...}}")
            tensors = check_tensors(f"stage {following.stage_id} input", produced["tensors"], following.input_specs)
            following.submit(_WorkItem(self, request, item.index, position, tensors))
        except Exception as exc:  # a handoff fault fails this request, never the replica thread
            request.reject(exc)

    def _outputs_ready(self, request: RequestState) -> None:
        if not request.hand_over():
            self.finish(request)

    def finish(self, request: RequestState) -> None:
        """Turn the request's complete outputs into its result (the processor's `finish`) on the
        calling thread; a deadline that passed meanwhile fails it. Does nothing once the request
        has finished (failed, cancelled). Called by whoever received the request's `on_ready`."""
        if request.finished:
            return
        remaining = request.remaining_time()
        if remaining is not None and remaining <= 0:
            request.reject(DeadlineExceeded(f"request {request.request_id}: deadline passed before it finished"))
            return
        try:
            result = self.processor.finish(request.prepared, request.take_outputs())
        except Exception as exc:
            request.reject(exc)
            return
        request.resolve(result)
