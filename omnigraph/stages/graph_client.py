"""GraphStageClient: one replica of a graph stage, a worker process and the thread that feeds it.

Each replica owns a dedicated thread taking work from its stage's shared queue, so a replica has
exactly one call in flight (the worker's rule) and idle replicas pick up work as soon as it is
queued. One call serves a batch of work items (see batching.py; one item unless the stage
batches), packed and unpacked by the stage's batch adapter.

The fault model (DESIGN.md "Wire"): a call cannot be pre-empted, so a request cancelled or past
its deadline while its call runs does not kill the worker. The request fails at once (a deadline
fails only the requests whose deadline passed; batch-mates complete); once no request of the call
still waits, the call is *fenced*: the replica's epoch rises, the worker is told, and the late
reply is discarded when it comes. The worker is retired only when it dies, breaks the wire, or
does not answer within `hang_grace_s` of its call being fenced (truly hung): then its reservation
stays quarantined until the OS confirms the process is gone, every request of the call fails with
a retryable StageUnavailable, and the stage starts a replacement (runtime.py).

Errors stay per request: a merged call refused for a request-level fault (bad input, an ORT
error, tensors the wire cannot carry: more bytes than the route's max_io_bytes, in or out) is run
again item by item, so only the faulty request fails and the worker keeps serving.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

import numpy as np

from omnigraph.stages.batching import STOP, Queued, combined
from omnigraph.stages.errors import DeadlineExceeded, StageError, StageUnavailable
from omnigraph.stages.ledger import Reservation, ResourceLedger
from omnigraph.workers.errors import CallRefused, RemoteError, WorkerTimeout
from omnigraph.workers.wire import StaleEpoch

if TYPE_CHECKING:
    from omnigraph.stages.runtime import GraphStage
    from omnigraph.workers.client import WorkerClient
    from omnigraph.workers.reports import LoadReport

EXIT_VERIFY_TIMEOUT_S = 10.0
# Why: a replacement worker starts and warms up within seconds; clients retry after about this long.
REPLACEMENT_RETRY_AFTER_S = 1.0
# Why: while a call runs, its replica looks this often for requests that were cancelled or whose
# deadline passed (a cancellation is noticed within this, with no wake-up from the cancelling thread).
CALL_POLL_S = 0.02
# A worker refusing one request (bad input, an ORT error, outputs the wire cannot carry) stays
# usable; these codes say so.
_REQUEST_LEVEL_CODES = frozenset({
    "input_name_mismatch", "input_dtype_mismatch", "input_rank_mismatch", "input_shape_mismatch", "run_failed",
    "outputs_not_sent",
})


class WorkItem(Protocol):
    """What a replica needs from the orchestrator's unit of work."""

    request_id: str
    tensors: Mapping[str, np.ndarray]

    def is_live(self) -> bool: ...
    def remaining(self) -> float | None: ...
    def complete(self, outputs: dict[str, np.ndarray], seconds: float) -> None: ...
    def fail(self, error: BaseException) -> None: ...


def _request_level(error: BaseException) -> bool:
    """A fault of the request alone: the client refused the call before sending it, or the worker
    refused it and stays in step, so it keeps serving. Anything else (wire faults included: the
    stream may be out of step) retires the worker. A merged call refused so runs item by item."""
    return isinstance(error, CallRefused) or (isinstance(error, RemoteError) and error.code in _REQUEST_LEVEL_CODES)


class GraphStageClient:
    """One started, loaded and warmed-up worker serving a stage's queue."""

    def __init__(self, stage: GraphStage, replica: int, client: WorkerClient, reservation: Reservation,
                 ledger: ResourceLedger, load_report: LoadReport, *, restarts: int = 0,
                 hang_grace_s: float) -> None:
        self.stage = stage
        self.replica = replica
        self.client = client
        self.reservation = reservation
        self.load_report = load_report
        self.restarts = restarts
        self._ledger = ledger
        self._lock = threading.Lock()
        self._current: Sequence[WorkItem] = ()
        self._epoch = 0  # the epoch of this replica's calls: raised by every fence
        self.fenced_calls = 0
        self.hang_grace_s = hang_grace_s
        self.retired_reason: str | None = None
        self.exit_verified: bool | None = None
        self.calls = 0
        self.items = 0
        self._thread = threading.Thread(
            target=self._serve, name=f"omnigraph-stage{stage.stage_id}-replica{replica}", daemon=True
        )

    @property
    def serving(self) -> bool:
        """False from the moment the replica is retired: it takes no more work."""
        return self.retired_reason is None

    @property
    def state(self) -> str:
        return "serving" if self.retired_reason is None else "retired"

    def start_serving(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None) -> bool:
        """Wait for the serving thread to end; True when it has."""
        if self._thread.ident is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def describe(self) -> dict[str, Any]:
        """This replica's part of the execution plan."""
        hello = self.client.hello
        return {
            "replica": self.replica,
            "generation": self.client.generation,
            "restarts": self.restarts,
            "pid": self.client.pid,
            "state": self.state,
            "in_flight": [item.request_id for item in self._current],
            "retired_reason": self.retired_reason,
            "exit_verified": self.exit_verified,
            "calls": self.calls,
            "items": self.items,
            "fenced_calls": self.fenced_calls,
            "epoch": self._epoch,
            "route": self.stage.route.to_dict(),
            "reservation": dict(self.reservation.demands),
            "placement": self.load_report.placement.to_dict(),
            "session_providers": list(self.load_report.session_providers),
            "onnxruntime_version": hello.onnxruntime_version,
            "warmup_ms": self.load_report.warmup_ms,
        }

    def retire(self, reason: str, failed: Sequence[WorkItem] = (), error: BaseException | None = None) -> None:
        """Take the replica out of service and kill its worker; the reservation stays quarantined
        until the OS confirms the exit, then the stage hears that the replica is gone. The `failed`
        work items get `error` once the stage already reports the retirement, so whoever sees the
        error also sees the stage's state."""
        with self._lock:
            if self.retired_reason is not None:
                return
            self.retired_reason = reason
        self._settle_retirement(failed, error)

    def kill_if_busy(self) -> None:
        """At shutdown: a call in flight is not waited for; its worker is killed (the replica
        thread then retires it, and a closing stage replaces nothing)."""
        with self._lock:
            if self._current:
                self.client.kill()

    def retire_if_idle(self, reason: str) -> bool:
        """Retire the replica unless a call is in flight (whose thread then sees the fault itself):
        what the stage does when a worker dies between calls. True if it retired here."""
        with self._lock:
            if self.retired_reason is not None or self._current:
                return False
            self.retired_reason = reason
        self._settle_retirement((), None)
        return True

    def _settle_retirement(self, failed: Sequence[WorkItem], error: BaseException | None) -> None:
        if self.stage.replica_retired(self) and isinstance(error, StageUnavailable):
            error.retry_after = REPLACEMENT_RETRY_AFTER_S  # another replica serves, or a replacement comes
        for item in failed:
            item.fail(error)  # type: ignore[arg-type]
        self._ledger.quarantine(self.reservation)
        self.client.kill()
        verified = self.client.wait_exit(EXIT_VERIFY_TIMEOUT_S)
        if verified:
            self._ledger.release_quarantined(self.reservation)
            self.client.close()
        self.exit_verified = verified
        self.stage.replica_exited(self)

    def close(self, timeout: float) -> None:
        """Stop the worker after shutdown; falls back to kill, releases the reservation once gone."""
        with self._lock:
            if self.retired_reason is not None:
                return
            self.retired_reason = "shut down"
        try:
            self.client.close(timeout=timeout)
        except Exception:  # a worker that will not stop politely is killed below
            self.client.kill()
        self.exit_verified = self.client.wait_exit(timeout)
        if not self.exit_verified:
            self.client.kill()
            self.exit_verified = self.client.wait_exit(EXIT_VERIFY_TIMEOUT_S)
        if self.exit_verified:
            self._ledger.release(self.reservation)
        else:
            self._ledger.quarantine(self.reservation)

    def _serve(self) -> None:
        while True:
            batch = self.stage.queue.take()
            if batch is STOP:
                return
            self.stage.batch_stats.record_waits([entry.waited_s for entry in batch])  # type: ignore[union-attr]
            entries = self._admit(batch)  # type: ignore[arg-type]
            if entries and not self._call(entries):
                return

    def _admit(self, batch: list[Queued]) -> list[Queued]:
        """The batch's entries still worth a call: cancelled ones are dropped, late ones failed."""
        admitted = []
        for entry in batch:
            item: WorkItem = entry.item
            if not item.is_live():
                continue
            remaining = item.remaining()
            if remaining is not None and remaining <= 0:
                item.fail(DeadlineExceeded(f"request {item.request_id}: deadline passed while queued for stage {self.stage.stage_id}"))
                continue
            admitted.append(entry)
        return admitted

    def _call(self, entries: list[Queued]) -> bool:
        """One worker call for `entries`; False once the replica retired. A merged call the worker
        refuses for a request-level fault is run again item by item, so only the faulty request fails."""
        items: list[WorkItem] = [entry.item for entry in entries]
        adapter = self.stage.queue.adapter
        tensors = [item.tensors for item in items]
        first = items[0]
        call_id = first.request_id if len(items) == 1 else f"{first.request_id}+{len(items) - 1}"
        try:
            inputs = adapter.pack(tensors)
        except Exception as exc:  # the items do not fit their adapter: they fail, the worker never saw them
            for item in items:
                item.fail(exc)
            return True
        with self._lock:
            if self.retired_reason is not None:  # the worker died while idle: the work goes back
                self.stage.requeue(entries)
                return False
            self._current = items
        self.stage.batch_stats.record_call(adapter.padded(combined(entries)), len({item.request_id for item in items}))
        started = time.perf_counter()
        try:
            self.client.submit(inputs, request_id=call_id[:256], stage_id=self.stage.stage_id, epoch=self._epoch,
                               timeout=self.hang_grace_s)
            outputs = self._await_reply(items, call_id)
        except BaseException as exc:  # every failure is routed: to the requests, and maybe retirement
            self._end_call()
            if _request_level(exc):
                if len(entries) > 1:
                    return self._call_each(entries)
                first.fail(exc)
                return True
            error = StageUnavailable(f"stage {self.stage.stage_id} replica {self.replica} failed during request "
                                     f"{call_id}: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self.retire(f"{type(exc).__name__}: {exc}", failed=items, error=error)
            return False
        seconds = time.perf_counter() - started
        self._end_call()
        self.calls += 1
        self.items += len(items)
        if outputs is None:  # fenced: every request of the call was gone; the worker serves on
            return True
        try:
            shares = adapter.unpack(outputs, tensors)
        except Exception as exc:  # the graph's outputs do not fit its adapter: every item fails, the worker is fine
            for item in items:
                item.fail(exc)
            return True
        for item, share in zip(items, shares):
            if item.is_live():
                item.complete(share, seconds)
        return True

    def _await_reply(self, items: Sequence[WorkItem], call_id: str) -> dict[str, np.ndarray] | None:
        """The call's outputs, or None once the call was fenced and its late reply discarded.

        While waiting: a request whose deadline passes fails at once (DeadlineExceeded); once no
        request of the call still waits, the call is fenced; a worker silent for `hang_grace_s`
        after that raises WorkerTimeout (it is hung: the caller retires it)."""
        client = self.client
        now = time.monotonic()
        due = [None if (left := item.remaining()) is None else now + left for item in items]
        hang_at: float | None = None
        while True:
            try:
                outputs = client.result(time.monotonic() + CALL_POLL_S)
            except StaleEpoch:
                return None
            if outputs is not None:
                return outputs if hang_at is None else None
            now = time.monotonic()
            for deadline, item in zip(due, items):
                if deadline is not None and deadline <= now and item.is_live():
                    item.fail(DeadlineExceeded(f"request {item.request_id}: deadline passed inside stage "
                                               f"{self.stage.stage_id}; its call was left to finish"))
            if hang_at is None and not any(item.is_live() for item in items):
                self._epoch += 1
                client.fence(self._epoch)
                self.fenced_calls += 1
                hang_at = now + self.hang_grace_s
            elif hang_at is not None and now >= hang_at:
                raise WorkerTimeout(f"worker {client.pid}: call {call_id} not answered within {self.hang_grace_s:g} s "
                                    "after it was fenced; the worker is hung")

    def _call_each(self, entries: list[Queued]) -> bool:
        """One call per entry; if the replica retires meanwhile, the entries not yet run go back
        to the stage's queue (their requests did nothing wrong) or, with no live replica, fail."""
        for index, entry in enumerate(entries):
            if entry.item.is_live() and not self._call([entry]):
                for rest in entries[index + 1:]:
                    try:
                        self.stage.submit(rest.item)
                    except StageUnavailable as exc:
                        rest.item.fail(exc)
                return False
        return True

    def _end_call(self) -> None:
        """The call is over: nothing is in flight."""
        with self._lock:
            self._current = ()
