"""The seam between the HTTP routes and the engine: one decision with a deadline, abort and errors.

The routes never touch the engine directly. `DecisionService` starts it (off the event loop),
runs the processor's real warmup request before declaring readiness, runs each request under a
deadline that includes queueing (the engine keeps it), aborts what is cancelled so its slot is
freed, and turns engine exceptions into `ApiError`s with the statuses the HTTP contract names.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
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
from omnigraph.stages.metrics import EngineMetrics
from omnigraph.stages.request_state import Phase
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

    def requests_by_phase(self) -> dict[Phase, int]: ...

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


#: The System One audit's server-wide fields, and the hashes its list fields repeat per question.
SERVER_AUDIT_KEYS = ("model_hash", "adapter_hash", "calibration_version", "backend", "precision")
QUESTION_HASH_KEYS = ("prompt_template_sha256", "allowed_token_set_hash")


def _question_list(value: Any, count: int) -> list:
    """A per-question audit value as a list in question order: a list as it is, a mapping keyed
    by question as its values, one value repeated `count` times, nothing as []."""
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    if isinstance(value, Mapping):
        return list(value.values())
    return [value] * count


def _request_limits(engine: DecisionEngine) -> dict[str, int]:
    """The processor's request limits (`RequestLimits`) as a dict; {} where it declares none."""
    limits = getattr(getattr(engine, "processor", None), "limits", None)
    if limits is None or not dataclasses.is_dataclass(limits) or isinstance(limits, type):
        return {}
    return {key: value for key, value in dataclasses.asdict(limits).items() if isinstance(value, int)}


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
                 deadline_s: float = DEFAULT_DEADLINE_S, served_model_names: Sequence[str] = ()) -> None:
        """`model_name` is the served pipeline; `served_model_names` (vLLM's `--served-model-name`)
        are the names clients may use for it, the first being the name it answers as (default: the
        pipeline's own name)."""
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be positive, got {deadline_s!r}")
        names = tuple(served_model_names)
        if any(not isinstance(name, str) or not name.strip() for name in names):
            raise ValueError(f"served model names must be non-empty strings, got {list(names)!r}")
        self._start_engine = start_engine
        self.pipeline_name = model_name
        self.served_model_names: tuple[str, ...] = tuple(dict.fromkeys(names)) or (model_name,)
        self.model_name = self.served_model_names[0]
        self.deadline_s = deadline_s
        self.engine: DecisionEngine | None = None
        self.ready = False
        self.failure: str | None = None
        self._audit: dict = {}
        self._limits: dict[str, int] = {}
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
            self._limits = _request_limits(self.engine)
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

    def serves(self, name: str) -> bool:
        """Whether `name` names the served model: one of its served names, or its pipeline's name."""
        return name in self.served_model_names or name == self.pipeline_name

    def audit(self) -> dict:
        """What serves every answer: the System One audit's server-wide fields (`model_hash`,
        `adapter_hash`, `calibration_version`, `backend`, `precision`; None until the engine
        started, or where the model has none) and the hashes each question's audit repeats
        (`prompt_template_sha256`, `allowed_token_set_hash`) as single strings."""
        return {key: self._audit.get(key) for key in SERVER_AUDIT_KEYS + QUESTION_HASH_KEYS}

    def response_audit(self, response: Mapping[str, Any]) -> dict:
        """One response's audit in the System One schema: the server-wide fields, then the list
        fields in question order (`prompt_template_sha256`, `allowed_token_set_hash`,
        `input_tokens`), from what the processor recorded for this request; a hash it did not
        record per question is the server's, repeated."""
        recorded = response.get("audit") or {}
        count = len(response.get("answers") or {})
        audit: dict[str, Any] = {key: self._audit.get(key) for key in SERVER_AUDIT_KEYS}
        for key in QUESTION_HASH_KEYS:
            audit[key] = _question_list(recorded.get(key, self._audit.get(key)), count)
        audit["input_tokens"] = [int(tokens) for tokens in _question_list(recorded.get("input_tokens"), 0)]
        return audit

    def health_fields(self) -> dict[str, Any]:
        """What `/health` reports of the served model beside its status (None before the start)."""
        return {"model_hash": self._audit.get("model_hash"),
                "calibration_version": self._audit.get("calibration_version"),
                "prompt_template_sha256": self._audit.get("prompt_template_sha256"),
                "backend": self._audit.get("backend"), "precision": self._audit.get("precision")}

    def model_cards(self, server_limits: Mapping[str, int]) -> list[dict[str, Any]]:
        """`/v1/models`' entries, one per served name: `{name, description, release_date, avrik:
        {hashes, backend, limits}}`; what the bundle does not say is None. `hashes.checkpoint_revision`
        names the weights the bundle was built from, whatever its precision or exporter (a conformance
        run compares it with its answer fixtures')."""
        hashes = {key: self._audit.get(key) for key in ("model_hash", "checkpoint_revision", "adapter_hash",
                                                           "prompt_template_sha256", "allowed_token_set_hash",
                                                           "calibration_version")}
        avrik = {"hashes": hashes, "backend": self._audit.get("backend"),
                 "limits": {**self._limits, **server_limits, "request_deadline_s": self.deadline_s}}
        return [{"name": name, "description": self._description(), "release_date": self._audit.get("release_date"),
                 "avrik": avrik} for name in self.served_model_names]

    def _description(self) -> str | None:
        """The served pipeline and what its bundle says of itself, or None before the start."""
        if not self._audit:
            return None
        facts = [f"{key.replace('_', ' ')} {self._audit[key]}" for key in ("component", "checkpoint_revision",
                                                                           "precision") if self._audit.get(key)]
        return f"omnigraph pipeline {self.pipeline_name!r}" + (f" ({', '.join(facts)})" if facts else "")

    def queue_depth(self) -> int | None:
        return None if self.engine is None else self.engine.queue_depth()

    def requests_by_phase(self) -> dict[Phase, int] | None:
        """Admitted requests by lifecycle phase (None before start)."""
        return None if self.engine is None else self.engine.requests_by_phase()

    def stage_names(self) -> dict[int, str] | None:
        """Each stage's name (`model_stage`) by stage id (None before start)."""
        if self.engine is None:
            return None
        return {stage["stage_id"]: stage["model_stage"] for stage in self.engine.execution_plan["stages"]}

    def metrics(self) -> EngineMetrics | None:
        """The engine's counters as typed records (stages/metrics.py; None before start)."""
        return None if self.engine is None else self.engine.metrics()

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
