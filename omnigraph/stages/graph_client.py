"""GraphStageClient: one replica of a graph stage, a worker process and the thread that feeds it.

Each replica owns a dedicated thread taking work items from its stage's shared queue, so a
replica has exactly one call in flight (the worker's rule) and idle replicas pick up work as soon
as it is queued. A call cannot be pre-empted: cancelling one, a deadline passing inside one, or
any fault that leaves the worker in doubt *retires* the replica: its worker is killed, its
reservation stays quarantined until the OS confirms the process is gone, then it is released.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Mapping, Protocol

import numpy as np

from omnigraph.stages.errors import DeadlineExceeded, StageError, StageUnavailable
from omnigraph.stages.ledger import Reservation, ResourceLedger
from omnigraph.workers.errors import RemoteError, WorkerTimeout

if TYPE_CHECKING:
    from omnigraph.stages.runtime import GraphStage
    from omnigraph.workers.client import WorkerClient
    from omnigraph.workers.reports import LoadReport
    from omnigraph.workers.route import WorkerRoute

EXIT_VERIFY_TIMEOUT_S = 10.0
# A worker refusing one request (bad input, an ORT error) stays usable; these codes say so.
_REQUEST_LEVEL_CODES = frozenset({
    "input_name_mismatch", "input_dtype_mismatch", "input_rank_mismatch", "input_shape_mismatch", "run_failed",
})


class WorkItem(Protocol):
    """What a replica needs from the orchestrator's unit of work."""

    request_id: str
    epoch: int
    tensors: Mapping[str, np.ndarray]

    def is_live(self) -> bool: ...
    def remaining(self) -> float | None: ...
    def complete(self, outputs: dict[str, np.ndarray], seconds: float) -> None: ...
    def fail(self, error: BaseException) -> None: ...


def _request_level(error: BaseException) -> bool:
    """A fault of the request alone: the worker refused it and stays in step, so it keeps serving.
    Anything else (wire faults included: the stream may be out of step) retires the worker."""
    return isinstance(error, RemoteError) and error.code in _REQUEST_LEVEL_CODES


STOP = object()  # queued once per serving replica at shutdown


class GraphStageClient:
    """One started, loaded and warmed-up worker serving a stage's queue."""

    def __init__(self, stage: GraphStage, replica: int, client: WorkerClient, route: WorkerRoute,
                 reservation: Reservation | None, ledger: ResourceLedger, load_report: LoadReport) -> None:
        self.stage = stage
        self.replica = replica
        self.client = client
        self.route = route
        self.reservation = reservation
        self.load_report = load_report
        self._ledger = ledger
        self._lock = threading.Lock()
        self._current: WorkItem | None = None
        self._interrupt_reason: str | None = None
        self.retired_reason: str | None = None
        self.exit_verified: bool | None = None
        self.calls = 0
        self._thread = threading.Thread(
            target=self._serve, name=f"omnigraph-stage{stage.stage_id}-replica{replica}", daemon=True
        )

    @property
    def serving(self) -> bool:
        """False from the moment the replica is interrupted or retired: it takes no more work."""
        return self.retired_reason is None and self._interrupt_reason is None

    @property
    def state(self) -> str:
        if self.retired_reason is not None:
            return "retired"
        return "serving" if self._interrupt_reason is None else "retiring"

    def start_serving(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None) -> bool:
        """Wait for the serving thread to end; True when it has."""
        if self._thread.ident is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def interrupt(self, request_id: str, reason: str) -> bool:
        """Retire this replica if its call in flight belongs to `request_id` (calls cannot be pre-empted)."""
        with self._lock:
            current = self._current
            if current is None or current.request_id != request_id or self._interrupt_reason is not None:
                return False
            self._interrupt_reason = reason
        self.client.kill()
        return True

    def describe(self) -> dict[str, Any]:
        """This replica's part of the execution plan."""
        hello = self.client.hello
        return {
            "replica": self.replica,
            "generation": self.client.generation,
            "pid": self.client.pid,
            "state": self.state,
            "in_flight": current.request_id if (current := self._current) is not None else None,
            "retired_reason": self.retired_reason,
            "exit_verified": self.exit_verified,
            "calls": self.calls,
            "route": self.route.to_dict(),
            "reservation": dict(self.reservation.demands) if self.reservation else {},
            "placement": self.load_report.placement.to_dict(),
            "session_providers": list(self.load_report.session_providers),
            "onnxruntime_version": hello.onnxruntime_version,
            "warmup_ms": self.load_report.warmup_ms,
        }

    def retire(self, reason: str, failed: tuple[WorkItem, BaseException] | None = None) -> None:
        """Take the replica out of service and kill its worker; the reservation stays quarantined
        until the OS confirms the exit. `failed` (a work item and its error) is failed once the
        stage already reports the retirement, so whoever sees the error also sees the stage's health."""
        if self.retired_reason is not None:
            return
        self.retired_reason = reason
        self.stage.replica_retired(self)
        if failed is not None:
            failed[0].fail(failed[1])
        if self.reservation is not None:
            self._ledger.quarantine(self.reservation)
        self.client.kill()
        verified = self.client.wait_exit(EXIT_VERIFY_TIMEOUT_S)
        if verified:
            if self.reservation is not None:
                self._ledger.release_quarantined(self.reservation)
            self.client.close()
        self.exit_verified = verified

    def close(self, timeout: float) -> None:
        """Stop the worker after shutdown; falls back to kill, releases the reservation once gone."""
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
        if self.reservation is not None:
            if self.exit_verified:
                self._ledger.release(self.reservation)
            else:
                self._ledger.quarantine(self.reservation)

    def _serve(self) -> None:
        queue = self.stage.queue
        while True:
            item = queue.get()
            if item is STOP:
                return
            if not item.is_live():
                continue
            remaining = item.remaining()
            if remaining is not None and remaining <= 0:
                item.fail(DeadlineExceeded(f"request {item.request_id}: deadline passed while queued for stage {self.stage.stage_id}"))
                continue
            with self._lock:
                self._current = item
            started = time.perf_counter()
            try:
                outputs = self.client.run(item.tensors, request_id=item.request_id, stage_id=self.stage.stage_id,
                                          epoch=item.epoch, timeout=remaining)
            except BaseException as exc:  # every failure is routed: to the request, and maybe retirement
                with self._lock:
                    self._current = None
                    interrupted = self._interrupt_reason
                if interrupted is None and _request_level(exc):
                    item.fail(exc)
                    continue
                cause = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, WorkerTimeout):
                    error: StageError = DeadlineExceeded(
                        f"request {item.request_id}: deadline passed inside stage {self.stage.stage_id}")
                else:
                    error = StageUnavailable(
                        f"stage {self.stage.stage_id} replica {self.replica} failed during request {item.request_id}: {cause}")
                error.__cause__ = exc
                self.retire(interrupted or cause, failed=(item, error))
                return
            with self._lock:
                self._current = None
                interrupted = self._interrupt_reason
            self.calls += 1
            if interrupted is not None:  # killed just as the call returned: the worker is gone
                self.retire(interrupted)
                return
            item.complete(outputs, time.perf_counter() - started)
