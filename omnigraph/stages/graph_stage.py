"""A graph stage: its replicas (GraphReplica: a worker process and the thread that feeds it), the
queue they share, and the replacement of retired ones (GraphStage).

Each replica owns a dedicated thread taking work from its stage's shared queue, so a replica has
exactly one call in flight (the worker's rule) and idle replicas pick up work as soon as it is
queued. One call serves a batch of work items (see batching.py; one item unless the stage
batches), packed and unpacked by the stage's batch adapter.

The fault model (DESIGN.md "Wire"): a call cannot be pre-empted, so a request cancelled or past
its deadline while its call runs does not kill the worker. The request fails at once, elsewhere
(an abort, or the orchestrator's deadline watch; batch-mates complete); once no request of the call
is live any more, the call is *fenced*: the replica's epoch rises, the worker is told, and the late
reply is discarded when it comes. The worker is retired only when it dies, breaks the wire, or
does not answer within `hang_grace_s` of its call being fenced (truly hung): then its reservation
stays quarantined until the OS confirms the process is gone, every request of the call fails with
a retryable StageUnavailable, and the stage starts a replacement in the background (never on a
request's path), backing off while its restart budget is spent and while its bundle on disk is
not the verified one.

Errors stay per request: a merged call refused for a request-level fault (bad input, an ORT
error, tensors the wire cannot carry: more bytes than the route's max_io_bytes, in or out) is run
again item by item, so only the faulty request fails and the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from omnigraph.bundles import VerifiedBundle
from omnigraph.bundles.watch import BundleWatch
from omnigraph.pipelines.config import StagePipelineConfig
from omnigraph.pipelines.deploy import StageDeployConfig
from omnigraph.pipelines.registry import resolve_dotted
from omnigraph.stages.batching import (
    STOP,
    AxisZeroAdapter,
    BatchAdapter,
    BatchLimits,
    BatchStats,
    Queued,
    StageQueue,
    batch_axis_problem,
    combined,
)
from omnigraph.stages.errors import StageStartupError, StageUnavailable
from omnigraph.stages.handoff import outputs_as_inputs
from omnigraph.stages.ledger import Reservation, ResourceLedger
from omnigraph.stages.metrics import BatchMetrics, ReplicaMetrics, StageMetrics
from omnigraph.stages.monitor import StageMonitor
from omnigraph.stages.output_step import one_wake_up
from omnigraph.stages.protocols import HandoffFunc, Stage, WorkItem
from omnigraph.stages.restarts import RestartBudget
from omnigraph.stages.tensors import InputSpec, input_specs
from omnigraph.workers.client import WorkerClient
from omnigraph.workers.errors import CallRefused, RemoteError, WorkerTimeout
from omnigraph.workers.reports import LoadReport
from omnigraph.workers.route import WorkerRoute
from omnigraph.workers.wire import StaleEpoch

logger = logging.getLogger("omnigraph.stages")
Launched = list[tuple[WorkerClient, Reservation]]


class WorkerLauncher(Protocol):
    """Starts a graph stage's workers (StageRuntime: it owns the generations, the startup timeout,
    the start's cancellation and the unwinding of what a failed start left)."""

    def start_replica(self, stage: GraphStage, replica: int, reservation: Reservation, launched: Launched, *,
                      restarts: int = 0) -> GraphReplica:
        """Start, load and warm up one worker charged to `reservation`."""
        ...

    def start_replacement(self, stage: GraphStage, slot: int, restarts: int, launched: Launched) -> GraphReplica:
        """A new generation for a retired slot, with its own reservation; all given back on failure."""
        ...

EXIT_VERIFY_TIMEOUT_S = 10.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0  # a replica's worker gets this long to exit before it is killed
# Why: a replacement worker starts and warms up within seconds; clients retry after about this long.
REPLACEMENT_RETRY_AFTER_S = 1.0
# Why: while a call runs, its replica looks this often for requests that ended (cancelled, failed,
# past their deadline): an ended request's call is fenced within this, with no wake-up from the
# thread that ended it.
CALL_POLL_S = 0.02
# A worker refusing one request (bad input, an ORT error, outputs the wire cannot carry) stays
# usable; these codes say so.
_REQUEST_LEVEL_CODES = frozenset({
    "input_name_mismatch", "input_dtype_mismatch", "input_rank_mismatch", "input_shape_mismatch", "run_failed",
    "outputs_not_sent",
})


def _request_level(error: BaseException) -> bool:
    """A fault of the request alone: the client refused the call before sending it, or the worker
    refused it and stays in step, so it keeps serving. Anything else (wire faults included: the
    stream may be out of step) retires the worker. A merged call refused so runs item by item."""
    return isinstance(error, CallRefused) or (isinstance(error, RemoteError) and error.code in _REQUEST_LEVEL_CODES)


class LoopDrive(enum.Enum):
    """How an event loop drives a batch-1 call (`GraphReplica.call_from_loop`)."""

    AWAIT = "await"  # through the socket; the loop's reader on it takes the reply (calls that outlast the spin window)
    SPIN = "spin"  # through the route's own transport; the loop polls for the reply within the spin window


class GraphReplica:
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
        # Held by whichever drives a call: the replica's thread, or an event loop (`call_from_loop`).
        self._driver = threading.Lock()
        self._stopping = False  # set at shutdown: a thread waiting for the driver gives up
        self._loop_reply: _LoopReply | None = None  # the loop-driven call in flight
        self._handed: _Call | None = None  # a spun call that outlasted the spin window: the thread's to finish
        self._current: Sequence[WorkItem] = ()
        self._epoch = 0  # the epoch of this replica's calls: raised by every fence
        self.fenced_calls = 0
        self.hang_grace_s = hang_grace_s
        self.retired_reason: str | None = None
        # Set by the monitor when the worker exited during a call; the call's driver retires the
        # replica once the call ends (its reply may have been in before the exit).
        self._exited: str | None = None
        self.exit_verified: bool | None = None
        self.calls = 0
        self.items = 0
        self.last_call_s: float | None = None  # how long its latest call took, reply included
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
            "node": self.client.process.node,
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
        self.stage.queue.wake_all()  # its thread, idle while an event loop drove the call, stops
        self._settle_retirement(failed, error)

    def kill_if_busy(self) -> None:
        """At shutdown: a call in flight is not waited for; its worker is killed (its driver then
        retires it, and a closing stage replaces nothing)."""
        with self._lock:
            self._stopping = True
            if self._current:
                self.client.kill()

    def worker_exited(self) -> None:
        """From the monitor: the worker process is gone. An idle replica retires (and is replaced)
        now; a busy one as soon as its call ends, since the call may still get its reply (a worker
        can answer, then exit) and a call that fails retires the replica itself."""
        returncode = self.client.returncode
        status = "" if returncode is None else f" with status {returncode}"
        with self._lock:
            if self.retired_reason is not None:
                return
            if self._current:
                self._exited = f"worker {self.client.pid} exited{status} during a call"
                return
            self.retired_reason = f"worker {self.client.pid} exited while idle{status}"
        self.stage.queue.wake_all()  # this replica's thread waits for work: it stops instead
        self._settle_retirement((), None)

    def _retired(self) -> bool:
        return self.retired_reason is not None

    def _settle_retirement(self, failed: Sequence[WorkItem], error: BaseException | None) -> None:
        if self.stage.replica_retired(self) and isinstance(error, StageUnavailable):
            error.retry_after = REPLACEMENT_RETRY_AFTER_S  # another replica serves, or a replacement comes
        for item in failed:
            item.fail(error)  # type: ignore[arg-type]  # error is None only when nothing failed
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
            batch = self.stage.queue.take(stop_when=self._retired, wake_when=self._has_handed)
            work = [] if batch is STOP else batch
            if not self._take_driver(work):
                return
            try:
                if not self._finish_handed():
                    self.stage.requeue(work)
                    return
                if batch is STOP:
                    return
                if work:
                    self.stage.batch_stats.record_waits([entry.waited_s for entry in work])
                    entries = self._admit(work)
                    if entries and not self._call(entries):
                        return
            finally:
                self._driver.release()

    def _has_handed(self) -> bool:
        return self._handed is not None

    def _finish_handed(self) -> bool:
        """With the driver: wait for the call an event loop handed over, if any, and route its
        reply; False once the replica retired."""
        handed, self._handed = self._handed, None
        return handed is None or self._finish_call(handed)

    def _take_driver(self, batch: list[Queued]) -> bool:
        """Wait while an event loop drives a call on this worker; False (the batch requeued) once
        the replica retired or the stage stops meanwhile. A loop that stopped running with its call
        in flight (its program's `asyncio.run` ended) never takes the reply: this thread takes the
        call over, waits for it as its own, and so holds the driver."""
        while not self._driver.acquire(timeout=CALL_POLL_S):
            if self._retired() or self._stopping:
                self.stage.requeue(batch)
                return False
            waiting = self._loop_reply
            if waiting is not None and not waiting.loop.is_running() and waiting.take_over():
                if not self._finish_call(waiting.call):
                    self.stage.requeue(batch)
                    return False
                return True
        return True

    @staticmethod
    def _admit(batch: list[Queued]) -> list[Queued]:
        """The batch's entries still worth a call (a request may end while the batch forms)."""
        return [entry for entry in batch if entry.item.is_live()]

    # -- one call, shared by both drivers ----------------------------------------------------------

    def _open_call(self, entries: list[Queued]) -> _Call | None:
        """Pack `entries` and mark the call in flight; None when there is nothing to send: the
        items did not fit their adapter (they failed), or the replica retired (they went back to
        the stage's queue; `serving` says which)."""
        items: list[WorkItem] = [entry.item for entry in entries]
        tensors = [item.tensors for item in items]
        adapter = self.stage.queue.adapter
        try:
            inputs = adapter.pack(tensors)
        except Exception as exc:  # the items do not fit their adapter: they fail, the worker never saw them
            for item in items:
                item.fail(exc)
            return None
        with self._lock:
            if self.retired_reason is not None:  # the worker died while idle: the work goes back
                self.stage.requeue(entries)
                return None
            self._current = items
        for item in items:
            item.dispatched()
        self.stage.batch_stats.record_call(adapter.padded(combined(entries)), len({item.request_id for item in items}))
        first = items[0]
        call_id = first.request_id if len(items) == 1 else f"{first.request_id}+{len(items) - 1}"
        return _Call(entries, items, tensors, inputs, call_id[:256])

    def _close_call(self, call: _Call, outputs: dict[str, np.ndarray] | None) -> str | None:
        """The reply is in (None: fenced, discarded): nothing is in flight; the live items complete.
        Returns why the replica must retire now (its worker exited during the call), else None."""
        seconds = time.perf_counter() - call.started
        exited = self._end_call()
        self.calls += 1
        self.items += len(call.items)
        self.last_call_s = seconds
        if outputs is None:  # fenced: every request of the call was gone
            return exited
        try:
            shares = self.stage.queue.adapter.unpack(outputs, call.tensors)
        except Exception as exc:  # the graph's outputs do not fit its adapter: every item fails, the worker is fine
            for item in call.items:
                item.fail(exc)
            return exited
        with one_wake_up():  # the call's requests are finished together, whichever loop awaits them
            for item, share in zip(call.items, shares):
                if item.is_live():
                    item.complete(share, seconds)
        return exited

    def _call_failed(self, call: _Call, exc: BaseException) -> bool:
        """Route a failed call's error: to its requests, and maybe retirement. False once the
        replica retired. A merged call refused for a request-level fault runs item by item (on a
        worker that exited meanwhile, those calls fail and retire it)."""
        if _request_level(exc):
            if len(call.entries) > 1:
                self._end_call()
                return self._call_each(call.entries)
            return self._serves_on(self._request_failed(call, exc))
        self._end_call()
        error = StageUnavailable(f"stage {self.stage.stage_id} replica {self.replica} failed during request "
                                 f"{call.call_id}: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        self.retire(f"{type(exc).__name__}: {exc}", failed=call.items, error=error)
        return False

    def _request_failed(self, call: _Call, exc: BaseException) -> str | None:
        """A one-item call failed for its request alone: the request fails, the worker serves on
        unless it exited during the call (returned: why the replica must retire)."""
        exited = self._end_call()
        call.items[0].fail(exc)
        return exited

    def _fence(self, items: Sequence[WorkItem]) -> list[Callable[[], None]]:
        """No request of the call is live: raise the epoch (the late reply will be discarded) and
        keep the call's admission slots until it ends; returns what gives them back."""
        self._epoch += 1
        self.client.fence(self._epoch)
        self.fenced_calls += 1
        return [item.keep_admission() for item in {item.request_id: item for item in items}.values()]

    def _hung(self, call_id: str) -> WorkerTimeout:
        return WorkerTimeout(f"worker {self.client.pid}: call {call_id} not answered within {self.hang_grace_s:g} s "
                             "after it was fenced; the worker is hung")

    # -- the replica's thread drives a call --------------------------------------------------------

    def _call(self, entries: list[Queued]) -> bool:
        """One worker call for `entries`, waited for on this thread; False once the replica retired."""
        call = self._open_call(entries)
        if call is None:
            return self.serving
        try:
            self.client.submit(call.inputs, request_id=call.call_id, stage_id=self.stage.stage_id, epoch=self._epoch,
                               timeout=self.hang_grace_s)
        except BaseException as exc:  # every failure is routed: to the requests, and maybe retirement
            return self._call_failed(call, exc)
        return self._finish_call(call)

    def _finish_call(self, call: _Call) -> bool:
        """Wait for a sent call's reply on this thread and route it; False once the replica retired."""
        try:
            outputs = self._await_reply(call)
        except BaseException as exc:
            return self._call_failed(call, exc)
        return self._serves_on(self._close_call(call, outputs))

    def _serves_on(self, exited: str | None) -> bool:
        """After a call on the replica's thread: True, or, once its worker exited during the call,
        retire the replica and False."""
        if exited is None:
            return True
        self.retire(exited)
        return False

    def _await_reply(self, call: _Call) -> dict[str, np.ndarray] | None:
        """The call's outputs, or None once the call was fenced and its late reply discarded.

        While waiting: once no request of the call is live (cancelled, failed, past its deadline),
        the call is fenced; a worker silent for `hang_grace_s` after that raises WorkerTimeout (it
        is hung: the caller retires it)."""
        client = self.client
        hang_at: float | None = None
        kept: list[Callable[[], None]] = []  # the fenced call's admission, until it ends
        try:
            while True:
                try:
                    outputs = client.result(time.monotonic() + CALL_POLL_S)
                except StaleEpoch:
                    return None
                if outputs is not None:
                    return outputs if hang_at is None else None
                now = time.monotonic()
                if hang_at is None and not any(item.is_live() for item in call.items):
                    kept = self._fence(call.items)
                    hang_at = now + self.hang_grace_s
                elif hang_at is not None and now >= hang_at:
                    raise self._hung(call.call_id)
        finally:
            for release in kept:
                release()

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

    def _end_call(self) -> str | None:
        """The call is over: nothing is in flight. Returns why the worker is gone if the monitor
        saw it exit during the call."""
        with self._lock:
            self._current = ()
            return self._exited

    # -- an event loop drives a call (the batch-1 path: no thread hand-off) ------------------------

    def claim(self, *, alone: bool) -> LoopDrive | None:
        """Take this replica for one call driven from an event loop, and say how: None while a
        call is in flight (or its thread is about to make one), once it retired, or for a call the
        replica's thread should batch. A replica whose calls return within the route's spin window
        (`spin_wait_us`) is polled by the loop itself (SPIN), but only for a request `alone` in the
        engine, since the loop serves nothing else meanwhile; a longer call, a GPU's, is sent
        through the socket and its reply wakes the loop (AWAIT). Either way the request crosses no
        thread: on the 2-core machine the two hand-offs of the thread's way cost about 65 us."""
        spins = self.last_call_s is not None and self.last_call_s * 1e6 <= self.client.route.spin_wait_us
        if spins and not alone:
            return None
        if not self._driver.acquire(blocking=False):
            return None
        if self.retired_reason is not None or self._stopping or self._handed is not None:
            self._driver.release()
            return None
        return LoopDrive.SPIN if spins else LoopDrive.AWAIT

    def call_from_loop(self, entry: Queued, loop: asyncio.AbstractEventLoop, drive: LoopDrive) -> None:
        """With the replica claimed: one call for `entry` sent from `loop` (running on this
        thread) and completed there, so the request crosses no thread. AWAIT: the reply wakes the
        loop itself (the worker's socket in `loop.add_reader`); SPIN: the loop polls for it (a
        reply later than the spin window is handed to the replica's thread). The reply handling is
        the thread's (`_close_call`, `_call_failed`), and so are the fence and the hang deadline
        (`_LoopReply`)."""
        call = self._open_call([entry])
        if call is None:
            self._driver.release()
            return
        try:
            self.client.submit(call.inputs, request_id=call.call_id, stage_id=self.stage.stage_id, epoch=self._epoch,
                               timeout=self.hang_grace_s, via_socket=drive is LoopDrive.AWAIT)
        except BaseException as exc:
            self.loop_call_failed(call, exc)
            return
        if drive is LoopDrive.AWAIT:
            self._loop_reply = _LoopReply(self, call, loop)
        else:
            self._spin_for_reply(call)

    def _spin_for_reply(self, call: _Call) -> None:
        """Poll for the reply of a call just sent, within the route's spin window (never sleeping);
        one not back by then goes to the replica's thread, which waits for it as for its own."""
        try:
            outputs = self.client.result(time.monotonic())
        except StaleEpoch:
            self.loop_call_ended(call, None)
            return
        except BaseException as exc:
            self.loop_call_failed(call, exc)
            return
        if outputs is not None:
            self.loop_call_ended(call, outputs)
            return
        self._handed = call  # before the driver is free: no loop claims the replica meanwhile
        self._driver.release()
        self.stage.queue.wake_all()

    def loop_call_ended(self, call: _Call, outputs: dict[str, np.ndarray] | None) -> None:
        """A loop-driven call's reply is in: its requests complete here; a worker that exited
        during the call is retired on a thread of its own (retirement waits for the process)."""
        self._loop_reply = None
        self._settle_on_loop(lambda: self._close_call(call, outputs))

    def loop_call_failed(self, call: _Call, exc: BaseException) -> None:
        """A loop-driven call failed: a request-level fault fails its request here; anything else
        retires the worker on a thread of its own (retirement waits for the process to exit)."""
        self._loop_reply = None
        if not _request_level(exc):
            self._off_the_loop(lambda: self._call_failed(call, exc))
            return
        self._settle_on_loop(lambda: self._request_failed(call, exc))

    def _settle_on_loop(self, settle: Callable[[], str | None]) -> None:
        """Settle a loop-driven call on the loop (`settle` returns why the worker is gone, if it
        exited during the call); then free the replica, or retire it off the loop."""
        try:
            exited = settle()
        except BaseException:
            self._driver.release()
            raise
        if exited is None:
            self._driver.release()
        else:
            self._off_the_loop(lambda: self.retire(exited))

    def _off_the_loop(self, retire: Callable[[], object]) -> None:
        """Run `retire` on a thread of its own, holding the driver until it is done."""
        def run() -> None:
            try:
                retire()
            finally:
                self._driver.release()

        threading.Thread(target=run, name=f"omnigraph-stage{self.stage.stage_id}-retire{self.replica}",
                         daemon=True).start()


class _Call:
    """One worker call in flight: its queue entries and their items, the items' tensors, the
    packed inputs, its id and when it started."""

    __slots__ = ("entries", "items", "tensors", "inputs", "call_id", "started")

    def __init__(self, entries: list[Queued], items: list[WorkItem], tensors: list[Mapping[str, np.ndarray]],
                 inputs: dict[str, np.ndarray], call_id: str) -> None:
        self.entries = entries
        self.items = items
        self.tensors = tensors
        self.inputs = inputs
        self.call_id = call_id
        self.started = time.perf_counter()


class _LoopReply:
    """Waits, on an event loop, for the reply of a call that loop sent: the loop's reader on the
    worker's socket takes it; a timer every CALL_POLL_S does what `_await_reply` does between its
    polls (fence the call once none of its requests is live; a worker silent `hang_grace_s` after
    that is hung)."""

    def __init__(self, replica: GraphReplica, call: _Call, loop: asyncio.AbstractEventLoop) -> None:
        self._replica = replica
        self.call = call
        self.loop = loop
        self._fd = replica.client.reply_fd
        self._hang_at: float | None = None
        self._kept: list[Callable[[], None]] = []
        self._ended = False  # by the loop, or taken over by the replica's thread
        self._end_lock = threading.Lock()
        loop.add_reader(self._fd, self._readable)
        self._timer = loop.call_later(CALL_POLL_S, self._check)

    def take_over(self) -> bool:
        """From the replica's thread once the loop stopped running: the call is the thread's from
        now on (False if the loop ended it after all)."""
        if not self._end_once():
            return False
        self._replica._loop_reply = None
        return True

    def _end_once(self) -> bool:
        """Stop waiting on the loop; True for the first caller only."""
        with self._end_lock:
            if self._ended:
                return False
            self._ended = True
        try:
            self.loop.remove_reader(self._fd)
            self._timer.cancel()
        except Exception:  # a loop closed meanwhile has nothing left to remove
            pass
        for release in self._kept:
            release()
        return True

    def _readable(self) -> None:
        try:
            outputs = self._replica.client.ready_result()
        except StaleEpoch:
            if self._end_once():
                self._replica.loop_call_ended(self.call, None)
            return
        except BaseException as exc:
            if self._end_once():
                self._replica.loop_call_failed(self.call, exc)
            return
        if outputs is not None and self._end_once():
            self._replica.loop_call_ended(self.call, outputs if self._hang_at is None else None)

    def _check(self) -> None:
        now = time.monotonic()
        try:
            if self._hang_at is None and not any(item.is_live() for item in self.call.items):
                self._kept = self._replica._fence(self.call.items)
                self._hang_at = now + self._replica.hang_grace_s
            elif self._hang_at is not None and now >= self._hang_at:
                raise self._replica._hung(self.call.call_id)
        except BaseException as exc:  # a hung worker, or one that died under the fence
            if self._end_once():
                self._replica.loop_call_failed(self.call, exc)
            return
        self._timer = self.loop.call_later(CALL_POLL_S, self._check)


def _running_loop_of(item: WorkItem) -> asyncio.AbstractEventLoop | None:
    """The item's event loop when this thread is running it, else None (asyncio's own lookup,
    without the exception `get_running_loop` raises on a thread with no loop)."""
    running = asyncio._get_running_loop()
    return running if running is not None and item.loop is running else None


def worker_route(stage: StageDeployConfig) -> WorkerRoute:
    """The route a graph stage's workers run on: the stage's route fields by name
    (`StageDeployConfig.worker_route_fields`); on GPU routes the stage's VRAM demand on its device
    (`machine:vram:<device_id>`) becomes ORT's arena limit (`gpu_mem_limit`)."""
    route = stage.graph_backend.route
    vram = stage.resource_budget.demands.get(f"machine:vram:{route.device_id}") if route.ep != "cpu" else None
    return WorkerRoute.from_dict({**stage.worker_route_fields(), "gpu_mem_limit": vram or None})


def _batch_adapter(config: StagePipelineConfig, bundle: VerifiedBundle, route: WorkerRoute) -> BatchAdapter:
    """The stage's declared batch adapter built for its bundle and route (AxisZeroAdapter when none is named)."""
    if config.batch_adapter is None:
        return AxisZeroAdapter()
    try:
        return resolve_dotted(config.batch_adapter)(bundle, route)
    except Exception as exc:
        raise StageStartupError(config.stage_id, 0, f"batch adapter {config.batch_adapter} refused "
                                f"{bundle.manifest_path}: {exc}") from exc


class GraphStage:
    """A graph stage's serving state: its replica slots, the queue they share, its restarts."""

    def __init__(self, config: StagePipelineConfig, deploy: StageDeployConfig, bundle: VerifiedBundle,
                 route: WorkerRoute, launcher: WorkerLauncher) -> None:
        self.config = config
        self.deploy = deploy
        self.bundle = bundle
        self.route = route
        self.stage_id = config.stage_id
        self.queue = StageQueue(BatchLimits.for_stage(config, deploy.batching), _batch_adapter(config, bundle, route))
        self.batch_stats = BatchStats()
        self.replicas: list[GraphReplica] = []
        self.input_specs: dict[str, InputSpec] = {}
        self.handoff: HandoffFunc = (
            resolve_dotted(config.custom_process_input_func) if config.custom_process_input_func else outputs_as_inputs
        )
        self.failure: str | None = None            # down for good: only with `max_restarts: 0`
        self.bundle_problem: str | None = None     # the bundle on disk is no longer the verified one
        self.backoff_until: float | None = None    # a replacement waits for the restart budget until then
        self.last_retirement: str | None = None    # why the latest replica retired
        self.retirements = 0                       # replicas retired since the start (deaths, hangs)
        self.restart_budget = RestartBudget(deploy.restart.max_restarts, deploy.restart.window_s)
        self.watch = BundleWatch(bundle)
        self._replacing: set[int] = set()         # slots whose replacement is due or starting
        self._launches: list[Launched] = []        # workers being started by replacements
        self._threads: list[threading.Thread] = []
        self._launcher = launcher
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self.monitor: StageMonitor | None = None  # set by the runtime once the stage serves
        self._requests_in_flight: Callable[[], int] | None = None  # set by the orchestrator

    @property
    def max_io_bytes(self) -> int:
        return self.route.max_io_bytes

    def count_requests(self, admitted: Callable[[], int], in_flight: Callable[[], int]) -> None:
        """A free replica waits for batch-mates only while other requests are admitted; a lone
        request (no other in flight) may be called from its event loop."""
        self.queue.admitted_requests = admitted
        self._requests_in_flight = in_flight

    # -- the runtime's lifecycle (protocols.ServingStage) -------------------------------------------

    def bind(self, verified: Sequence[VerifiedBundle]) -> None:
        """Nothing: a graph stage runs its own verified bundle."""

    def start_replica(self, replica: int, reservation: Reservation, ledger: ResourceLedger,
                      launched: Launched) -> None:
        self.replicas.append(self._launcher.start_replica(self, replica, reservation, launched))

    def loaded(self) -> None:
        """Every replica started: the inputs the bundle declares, and a declared `max_batch_rows`
        the loaded bundle's I/O cannot honour refused."""
        self.input_specs = input_specs(self.replicas[0].load_report)
        max_rows = self.queue.limits.max_rows
        if max_rows > 1 and (problem := batch_axis_problem(self.replicas[0].load_report)):
            raise StageStartupError(self.stage_id, 0, f"max_batch_rows={max_rows} is declared but "
                                    f"calls of {self.bundle.manifest.component} cannot be merged: {problem}")

    def check_consumer(self, following: Stage) -> None:
        """Nothing: a graph stage's outputs are checked against the next stage's inputs per request."""

    def abort_start(self, timeout: float) -> None:
        """Nothing: the runtime unwinds the workers a failed start launched."""

    def start_serving(self, monitor: StageMonitor) -> None:
        """Every replica's thread starts; the monitor watches the workers and re-verifies the bundle."""
        self.monitor = monitor
        for replica in self.replicas:
            self.serve(replica)
        if self.deploy.reverify_interval_s is not None:
            monitor.every(self.deploy.reverify_interval_s, self.check_bundle)

    def metrics(self) -> StageMetrics:
        state, reason = self.status()
        replicas = list(self.replicas)
        return StageMetrics(
            self.stage_id, self.config.execution_type.value, state, reason, self.deploy.num_replicas,
            sum(r.serving for r in replicas), self.restart_budget.spent,
            tuple(ReplicaMetrics(r.replica, r.client.generation, r.state, r.restarts, r.calls, r.items,
                                 r.fenced_calls) for r in replicas),
            BatchMetrics.from_stats(self.batch_stats.snapshot()), retirements=self.retirements)

    def serve(self, replica: GraphReplica) -> None:
        """Start a replica's thread, its worker's exit watched by the monitor."""
        replica.start_serving()
        if self.monitor is not None:
            self.monitor.watch_exit(replica.client.process, replica.worker_exited)

    def submit(self, item: WorkItem) -> None:
        """Queue a work item for the next free replica; fails fast while no replica is live.

        The batch-1 path: an item submitted on the event loop its request finishes on, with
        nothing queued and no batch-mate to wait for, is called from that loop on an idle replica
        (`GraphReplica.call_from_loop`), so neither its call nor its reply crosses a thread."""
        loop = _running_loop_of(item) if self.queue.is_empty() else None
        with self._lock:
            self._check_live_locked()
            claimed = self._claim_for_loop_locked() if loop is not None else None
            if claimed is None:
                self.queue.put(item)
                return
        replica, drive = claimed
        replica.call_from_loop(self.queue.entry(item), loop, drive)  # type: ignore[arg-type]  # not None if claimed

    def _claim_for_loop_locked(self) -> tuple[GraphReplica, LoopDrive] | None:
        """An idle replica claimed for a loop-driven call, and how the loop drives it, when one may
        be made now: nothing is queued, and the stage merges no calls or no other request is in
        flight (under load the replicas' threads batch)."""
        queue = self.queue
        if not queue.is_empty():
            return None
        lone = self._requests_in_flight is not None and self._requests_in_flight() <= 1
        if queue.limits.max_rows > 1 and not lone:
            return None
        # Polling blocks the loop: only for the one request admitted (none whose caller has yet to
        # take its result, who would send the next one meanwhile: those go to the thread, which batches).
        alone = lone and queue.admitted_requests is not None and queue.admitted_requests() <= 1
        for replica in self.replicas:
            drive = replica.claim(alone=alone)
            if drive is not None:
                return replica, drive
        return None

    def requeue(self, entries: Sequence[Queued]) -> None:
        """Entries a retired replica took but never called: to the next live replica, or failed."""
        with self._lock:
            try:
                self._check_live_locked()
            except StageUnavailable as exc:
                for entry in entries:
                    entry.item.fail(exc)
                return
            self.queue.requeue(entries)

    def check_available(self) -> None:
        """Raise StageUnavailable unless a replica is live."""
        with self._lock:
            self._check_live_locked()

    def interrupt(self, request_id: str, reason: str) -> None:
        """Nothing to do: a replica notices within CALL_POLL_S that its call's requests are gone
        and fences the call (graph_stage.py)."""

    def _check_live_locked(self) -> None:
        if self.failure is not None:
            raise self._failed_error()
        if self.bundle_problem is not None:
            raise StageUnavailable(f"stage {self.stage_id} is unavailable: {self.bundle_problem}",
                                   retry_after=REPLACEMENT_RETRY_AFTER_S)
        if not any(r.serving for r in self.replicas):
            raise StageUnavailable(f"stage {self.stage_id} has no live replica: {self._recovery_locked()}",
                                   retry_after=self._retry_after_locked())

    def _recovery_locked(self) -> str:
        cause = f" ({self.last_retirement})" if self.last_retirement else ""
        if self.backoff_until is not None:
            return (f"backing off for {max(0.0, self.backoff_until - time.monotonic()):.1f} s "
                    f"(restart budget of {self.restart_budget.describe()} spent){cause}")
        return f"a replacement is starting{cause}"

    def _retry_after_locked(self) -> float:
        if self.backoff_until is not None:
            return max(REPLACEMENT_RETRY_AFTER_S, self.backoff_until - time.monotonic())
        return REPLACEMENT_RETRY_AFTER_S

    def _failed_error(self) -> StageUnavailable:
        """What every request to a stage down for good gets (no retry: recreate the pipeline)."""
        return StageUnavailable(f"stage {self.stage_id} has no live replica ({self.failure}); recreate the pipeline")

    def status(self) -> tuple[str, str | None]:
        """("ok" | "degraded" | "recovering" | "unavailable" | "failed", why): degraded while some
        replica slots are being replaced, recovering while none serves but one is on its way."""
        with self._lock:
            live = sum(r.serving for r in self.replicas)
            if self.failure is not None:
                return "failed", self.failure
            if self.bundle_problem is not None:
                return "unavailable", self.bundle_problem
            if live == 0:
                return "recovering", f"no live replica: {self._recovery_locked()}"
            if live < len(self.replicas) or self._replacing:
                return "degraded", f"{live} of {self.deploy.num_replicas} replicas serve; {self._recovery_locked()}"
            return "ok", None

    def replica_retired(self, replica: GraphReplica) -> bool:
        """Called by a retiring replica: its slot is to be replaced (unless the stage closes or its
        operator declared `max_restarts: 0`); while no replica is live, everything queued here
        fails at once. True while the stage can still serve, so a retry is worth it."""
        logger.warning("stage %d: replica %d (worker %d, generation %d) retired: %s", self.stage_id, replica.replica,
                       replica.client.pid, replica.client.generation, replica.retired_reason)
        with self._lock:
            self.retirements += 1
            self.last_retirement = f"replica {replica.replica} retired: {replica.retired_reason}"
            if not self._closing.is_set() and self.failure is None:
                if self.restart_budget.max_restarts > 0:
                    self._replacing.add(replica.replica)
                else:
                    self._fail_if_dead_locked(f"replica {replica.replica} retired: {replica.retired_reason} "
                                              "(max_restarts is 0: never replaced)")
            self._drain_if_dead_locked()
            return self.failure is None

    def replica_exited(self, replica: GraphReplica) -> None:
        """Called once the retired replica's worker is gone (or its exit could not be verified)."""
        with self._lock:
            if replica.replica not in self._replacing:
                return
            if self._closing.is_set() or not replica.exit_verified:
                self._replacing.discard(replica.replica)
                if not self._closing.is_set():
                    self._fail_if_dead_locked(f"replica {replica.replica} retired: {replica.retired_reason}; its "
                                              "worker's exit was not verified, so it is not replaced")
                return
            thread = threading.Thread(target=self._replace, args=(replica.replica, replica.restarts + 1),
                                      name=f"omnigraph-stage{self.stage_id}-replace{replica.replica}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def check_bundle(self) -> None:
        """From the monitor: re-verify the bundle; a change turns the stage unavailable (naming the
        file) and the verified bytes coming back turn it available again."""
        problem = self.watch.check()
        with self._lock:
            if problem != self.bundle_problem:
                logger.warning("stage %d: %s", self.stage_id, problem or "the bundle verifies again")
            self.bundle_problem = problem
            if problem is not None:
                for item in self.queue.drain():
                    item.fail(StageUnavailable(f"stage {self.stage_id} is unavailable: {problem}",
                                               retry_after=REPLACEMENT_RETRY_AFTER_S))

    def _fail_if_dead_locked(self, reason: str) -> None:
        if not any(r.serving for r in self.replicas) and not self._replacing and self.failure is None:
            self.failure = reason

    def _drain_if_dead_locked(self) -> None:
        """With no live replica, queued work fails at once rather than wait for a replacement."""
        if any(r.serving for r in self.replicas):
            return
        error = self._failed_error() if self.failure is not None else StageUnavailable(
            f"stage {self.stage_id} has no live replica: {self._recovery_locked()}",
            retry_after=self._retry_after_locked())
        for item in self.queue.drain():
            item.fail(error)

    def _replace(self, slot: int, restarts: int) -> None:
        """In a background thread: start a new generation for `slot` once the restart budget and
        the bundle allow, backing off with growing delays meanwhile; never gives up while open."""
        while not self._closing.is_set():
            problem = self.watch.check()  # outside the lock: a full check hashes the whole bundle
            with self._lock:
                self.bundle_problem = problem
                if problem is not None or not self.restart_budget.spend():
                    delay: float | None = self.restart_budget.backoff()
                else:
                    delay = None
                self.backoff_until = None if delay is None else time.monotonic() + delay
            if delay is not None:
                logger.warning("stage %d: replica %d waits %.0f s before its replacement starts",
                               self.stage_id, slot, delay)
                self._closing.wait(delay)
                continue
            launched: Launched = []
            with self._lock:
                if self._closing.is_set():
                    break
                self._launches.append(launched)
            try:
                replica = self._launcher.start_replacement(self, slot, restarts, launched)
            except Exception as exc:  # refused reservation, start, load or warmup: counts as a restart
                logger.warning("stage %d: replacement of replica %d failed: %s", self.stage_id, slot, exc)
                with self._lock:
                    self._launches.remove(launched)
                restarts += 1
                continue
            with self._lock:
                self._launches.remove(launched)
                self._replacing.discard(slot)
                installed = not self._closing.is_set()
                if installed:
                    self.replicas[slot] = replica
                    self.serve(replica)
            if installed:
                logger.warning("stage %d: replica %d replaced by worker %d (generation %d, restart %d)",
                               self.stage_id, slot, replica.client.pid, replica.client.generation, restarts)
            if not installed:
                replica.close(DEFAULT_SHUTDOWN_TIMEOUT_S)
            return
        with self._lock:
            self._replacing.discard(slot)

    def register_launch(self, launched: Launched, client: WorkerClient, reservation: Reservation) -> None:
        """Track a worker as soon as it exists, so a shutdown meanwhile can kill it."""
        with self._lock:
            launched.append((client, reservation))
            if self._closing.is_set():
                client.kill()

    def stop_replacing(self) -> None:
        """No replacement starts from now on; workers being started are killed (their starts unwind)."""
        with self._lock:
            self._closing.set()
            for launched in self._launches:
                for client, _ in launched:
                    client.kill()

    def stop(self, timeout: float) -> None:
        """Stop replacements, then every replica thread (a retiring one first verifies its worker's
        exit), then close the workers."""
        self.stop_replacing()
        for thread in list(self._threads):
            thread.join()  # bounded: a start is killed above or ends within the startup timeout
        for replica in self.replicas:
            replica.kill_if_busy()
            if replica.serving:
                self.queue.stop_one()
        for replica in self.replicas:
            replica.join(timeout)
        for replica in self.replicas:
            replica.close(timeout)

    def describe(self) -> dict[str, Any]:
        with self._lock:
            replicas, replacing = list(self.replicas), sorted(self._replacing)
        state, reason = self.status()
        return {
            **self.config.describe(),
            "manifest": {
                "path": str(self.bundle.manifest_path),
                "sha256": self.bundle.manifest_sha256,
                "component": self.bundle.manifest.component,
            },
            "num_replicas": self.deploy.num_replicas,
            "live_replicas": sum(r.serving for r in replicas),
            "state": state,
            "state_reason": reason,
            "failure": self.failure,
            "batching": {**self.queue.limits.to_dict(), "adapter": self.config.batch_adapter,
                         "stats": self.batch_stats.snapshot()},
            "restart": {"max_restarts": self.restart_budget.max_restarts, "window_s": self.restart_budget.window_s,
                        "restarts": self.restart_budget.spent, "replacing": replacing},
            "replicas": [r.describe() for r in replicas],
        }
