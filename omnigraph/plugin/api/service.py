"""The seam between the HTTP routes and the engine: one decision with a deadline, abort and errors.

The routes never touch the engine directly. `DecisionService` starts it (off the event loop),
runs the processor's real warmup request before declaring readiness, runs each request under a
deadline that includes queueing (the engine keeps it), aborts what is cancelled so its slot is
freed, and turns engine exceptions into `ApiError`s with the statuses the HTTP contract names.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from omnigraph.pipelines.processor import RequestInvalid
from omnigraph.plugin.api.errors import ApiError
from omnigraph.stages.errors import (
    DeadlineExceeded,
    PipelineClosed,
    RequestCancelled,
    ResourceUnavailable,
    StageUnavailable,
)
from omnigraph.stages.metrics import BatchMetrics, EngineMetrics, LedgerMetrics
from omnigraph.stages.startup import StartCancel

logger = logging.getLogger("omnigraph.plugin.api")

DEFAULT_DEADLINE_S = 30.0
WARMUP_DEADLINE_S = 300.0
NOT_READY_RETRY_AFTER_S = 1


class DecisionEngine(Protocol):
    """What the HTTP layer needs of `omnigraph.plugin.omni.AsyncOmni`."""

    def generate(self, prompt: Mapping[str, Any], request_id: str, *,
                 deadline_s: float | None = None, hold: Any = None) -> AsyncIterator[Any]: ...

    def hold(self, slots: int) -> Any: ...

    def audit(self) -> dict: ...

    @property
    def execution_plan(self) -> dict[str, Any]: ...

    def warmup_request(self) -> dict: ...

    def failure(self) -> str | None: ...

    def recovering(self) -> str | None: ...

    def queue_depth(self) -> int: ...

    def ledger_snapshot(self) -> dict[str, Any]: ...

    def metrics(self) -> EngineMetrics: ...

    def shutdown(self) -> None: ...


def backend_description(execution_plan: Mapping[str, Any]) -> str:
    """What computes the answers, stage by stage, e.g. `vllm 0.32.0 float32 (in-process AsyncLLM)
    -> onnxruntime 1.32.0 CPUExecutionProvider`."""
    stages = []
    for stage in execution_plan["stages"]:
        replica = stage["replicas"][0]
        if stage["execution_type"] == "llm_pooling":
            stages.append(f"vllm {stage['vllm_version']} {replica['dtype']} ({replica['engine']})")
        else:
            stages.append(f"onnxruntime {replica['onnxruntime_version']} {replica['session_providers'][0]}")
    return " -> ".join(stages)


def _retry_after(seconds: float) -> dict[str, str]:
    """The Retry-After header for a retry hint: whole seconds, at least one."""
    return {"Retry-After": str(max(1, round(seconds)))}


@dataclass(frozen=True)
class Decision:
    """A finished request: the processor's response plus the time each stage took."""

    response: dict
    stage_durations: Mapping[int, float]


class DecisionService:
    """Owns the engine for one server: startup, readiness, failure and per-request execution."""

    def __init__(self, start_engine: Callable[[StartCancel], DecisionEngine], *, model_name: str,
                 deadline_s: float = DEFAULT_DEADLINE_S) -> None:
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be positive, got {deadline_s!r}")
        self._start_engine = start_engine
        self.model_name = model_name
        self.deadline_s = deadline_s
        self.engine: DecisionEngine | None = None
        self.ready = False
        self.failure: str | None = None
        self._audit: dict = {}
        self._cancel = StartCancel()
        self._starting: asyncio.Future[DecisionEngine] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine in a thread, then pass the warmup request through it; record any failure.
        Cancelling this task leaves the thread to `stop`, which cancels the start itself."""
        started = time.monotonic()
        self._starting = asyncio.ensure_future(asyncio.to_thread(self._start_engine, self._cancel))
        try:
            self.engine = await asyncio.shield(self._starting)
            self._audit = {**self.engine.audit(), "backend": backend_description(self.engine.execution_plan)}
            warmup = self.engine.warmup_request()
            await self.decide(warmup, request_id=f"warmup-{uuid.uuid4().hex}", deadline_s=WARMUP_DEADLINE_S)
        except Exception as exc:  # startup failure: reported by /health and /ready, never a hang
            self.failure = f"startup failed: {type(exc).__name__}: {exc}"
            logger.error("%s", self.failure)
            return
        self.ready = True
        logger.info("model %r is ready (started in %.1f s)", self.model_name, time.monotonic() - started)

    def shutdown(self) -> None:
        """Stop the engine's workers and release its reservations (idempotent)."""
        if self.engine is not None:
            self.engine.shutdown()

    async def stop(self) -> None:
        """Cancel a start still under way (no further worker starts; those starting are killed and
        the start unwinds), then shut the engine down."""
        self._cancel.cancel()
        if self._starting is not None:
            try:
                engine = await self._starting
            except Exception:  # the start's own failure (or its cancellation): it left nothing running
                pass
            else:
                self.engine = engine  # a start that finished as it was cancelled: shut down below
        await asyncio.to_thread(self.shutdown)

    def health_failure(self) -> str | None:
        """Why the server cannot answer (a failed start or a failed stage), or None when healthy."""
        if self.failure is not None:
            return self.failure
        if self.engine is not None:
            reason = self.engine.failure()
            if reason is not None:
                return f"stage failed: {reason}"
        return None

    def health_recovering(self) -> str | None:
        """Why the server cannot answer now while it recovers by itself (a replacement starting, a
        backoff, a changed bundle), or None."""
        return None if self.engine is None else self.engine.recovering()

    def audit(self) -> dict:
        """What serves every answer (bundle hash, calibration, template, precision, backend)."""
        return dict(self._audit)

    def response_audit(self, response: Mapping[str, Any]) -> dict:
        """The server's audit with what the processor recorded for this one request on top."""
        return {**self._audit, **response.get("audit", {})}

    def queue_depth(self) -> int | None:
        return None if self.engine is None else self.engine.queue_depth()

    def metrics(self) -> EngineMetrics | None:
        """The engine's counters as typed records (stages/metrics.py; None before start)."""
        return None if self.engine is None else self.engine.metrics()

    def ledger_snapshot(self) -> LedgerMetrics | None:
        """The ledger's constraints and live reservations (None before start), without the stages'."""
        return None if self.engine is None else LedgerMetrics.from_snapshot(self.engine.ledger_snapshot())

    def batch_stats(self) -> dict[int, BatchMetrics] | None:
        """Each batching stage's statistics by stage id (None before start)."""
        return None if self.engine is None else self.engine.metrics().batching()

    # -- requests ------------------------------------------------------------------------------

    def check_available(self) -> None:
        """503 with Retry-After unless the engine is ready and healthy."""
        failure = self.health_failure()
        if failure is not None:
            raise ApiError(503, failure, code="pipeline_failed")
        recovering = self.health_recovering()
        if recovering is not None:
            raise ApiError(503, recovering, code="stage_recovering", headers=_retry_after(NOT_READY_RETRY_AFTER_S))
        if not self.ready:
            raise ApiError(503, "the pipeline is still starting", code="not_ready",
                           headers={"Retry-After": str(NOT_READY_RETRY_AFTER_S)})

    @property
    def _started_engine(self) -> DecisionEngine:
        """The engine, which requests reach only once it started (`check_available`)."""
        assert self.engine is not None, "the engine is used before it started"
        return self.engine

    def hold(self, slots: int) -> Any:
        """Queue slots for `slots` requests admitted as a unit (a batch), released by the caller:
        503 with Retry-After when the queue cannot take them all now, 422 when it never could."""
        try:
            return self._started_engine.hold(slots)
        except ValueError as exc:
            raise ApiError(422, str(exc), code="invalid_request", field="states") from None
        except ResourceUnavailable as exc:
            raise ApiError(503, str(exc), code="queue_full", headers=_retry_after(exc.retry_after)) from None

    async def decide(self, prompt: Mapping[str, Any], *, request_id: str,
                     deadline_s: float | None = None, hold: Any = None) -> Decision:
        """Run one request to its final output within the deadline (queueing included).

        The engine keeps the deadline (its deadline watch fails the request with DeadlineExceeded,
        a 504); a client disconnect cancels this coroutine, which aborts the request inside
        `generate`, so its queue slot and reservations are freed at once. `deadline_s` None means
        the server's deadline.
        """
        final = None
        try:
            # Read to the end: the one finished output, then advancing past it acknowledges it.
            async for output in self._started_engine.generate(
                    prompt, request_id=request_id, deadline_s=self.deadline_s if deadline_s is None else deadline_s,
                    hold=hold):
                final = output
        except Exception as exc:
            raise self._api_error(exc, request_id) from None
        assert final is not None, "generate yields the finished output or raises"
        return Decision(final.custom_output, final.stage_durations)

    def _api_error(self, exc: Exception, request_id: str) -> ApiError:
        """The answer to a request the engine failed: what the client can act on, 500 only for a
        failure the engine did not classify while the pipeline is healthy."""
        if isinstance(exc, DeadlineExceeded):
            return ApiError(504, str(exc), code="deadline_exceeded")
        if isinstance(exc, RequestInvalid):
            return ApiError(422, exc.message, code="invalid_request", field=exc.field)
        if isinstance(exc, ResourceUnavailable):
            return ApiError(503, str(exc), code="queue_full", headers=_retry_after(exc.retry_after))
        if isinstance(exc, StageUnavailable) and exc.retry_after is not None:
            return ApiError(503, str(exc), code="stage_recovering", headers=_retry_after(exc.retry_after))
        if isinstance(exc, StageUnavailable | PipelineClosed):
            return ApiError(503, f"stage failed: {exc}", code="pipeline_failed")
        if isinstance(exc, RequestCancelled):
            return ApiError(503, str(exc), code="cancelled")
        failure = self.health_failure()
        if failure is not None:
            return ApiError(503, failure, code="pipeline_failed")
        logger.error("request %s failed", request_id, exc_info=exc)
        return ApiError(500, f"request failed: {type(exc).__name__}: {exc}", code="internal_error")
