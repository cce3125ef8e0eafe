"""Omni and AsyncOmni: the Python API over one pipeline (vllm-omni's names and shapes).

`AsyncOmni(...).generate(prompt, request_id=...)` is an async generator yielding one finished
`OmniRequestOutput`; `Omni(...).generate(prompts)` takes a list and returns a list. Both build the
same engine: a `StageRuntime` (verified bundles, reserved plan, warmed-up workers), the pipeline's
processor, and an `Orchestrator`. The front only routes: input processing (the processor), the
stages (worker replicas) and output processing (the processor's finish) stay separate.

Which plan runs:
- `deploy_config=` (a YAML path or a `DeployConfig`): that plan; `model=` must match its pipeline.
- `model=` with `bundle=`: the pipeline's graph stage on that bundle on a default CPU route; a
  native (`llm_pooling`) stage runs the backbone the bundle carries (`metadata.layout.backbone_dir`,
  hashed in the bundle's manifest) in an in-process vLLM engine with `DEFAULT_NATIVE_ENGINE_ARGS`.
- `model=` alone (default "laya"): the pipeline's `default_bundle`, if it declares one.

`served_engine=` (the `vllm serve` endpoint plugin passes it) makes a native stage use that
server's engine instead of starting its own.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from omnigraph.bundles import MANIFEST_NAME, load_manifest
from omnigraph.pipelines.config import PipelineConfig, StageExecutionType
from omnigraph.pipelines.deploy import (
    GRAPH_BACKEND,
    NATIVE_BACKEND,
    DeployConfig,
    load_deploy_config,
    resolve_pipeline,
    validate_deploy_config,
)
from omnigraph.pipelines.processor import Processor
from omnigraph.pipelines.registry import get_pipeline, resolve_dotted
from omnigraph.stages.errors import ResourceUnavailable
from omnigraph.stages.metrics import EngineMetrics
from omnigraph.stages.native_stage import ServedEngine
from omnigraph.stages.orchestrator import AdmissionHold, Orchestrator
from omnigraph.stages.outputs import OmniRequestOutput
from omnigraph.stages.request_state import Phase, RequestState
from omnigraph.stages.runtime import DEFAULT_STARTUP_TIMEOUT_S, StageRuntime
from omnigraph.stages.startup import StartCancel
from omnigraph.stages.tensor_processor import TensorProcessor

__all__ = ["AsyncOmni", "Omni", "OmniRequestOutput", "build_plan"]

logger = logging.getLogger("omnigraph.plugin")

DEFAULT_MODEL = "laya"
DEFAULT_ROUTE = "local-cpu"
# A bundle's backbone in the default plan: eager (torch.compile of vLLM's CPU backend costs minutes
# at startup) with a fixed KV cache (vLLM's CPU backend otherwise claims most of the machine's RAM;
# a pooling stage only holds the prompts being prefilled). Deploy YAMLs set their own.
DEFAULT_NATIVE_ENGINE_ARGS = {"enforce_eager": True, "kv_cache_memory_bytes": 256 * 1024 * 1024}


def build_plan(model: str | None = None, deploy_config: str | Path | DeployConfig | None = None,
               bundle: str | Path | None = None) -> tuple[PipelineConfig, DeployConfig]:
    """The pipeline and the deploy plan that `Omni`/`AsyncOmni` would run for these arguments."""
    if deploy_config is not None:
        if bundle is not None:
            raise ValueError("pass either bundle= or deploy_config=, not both (the deploy YAML names its bundles)")
        deploy = deploy_config if isinstance(deploy_config, DeployConfig) else load_deploy_config(deploy_config)
        if model is not None and model != deploy.pipeline:
            raise ValueError(f"model={model!r} but the deploy config runs pipeline {deploy.pipeline!r}")
        return resolve_pipeline(deploy), deploy
    pipeline = get_pipeline(model or DEFAULT_MODEL)
    if bundle is None:
        if pipeline.default_bundle is None:
            raise ValueError(f"pipeline {pipeline.model_type!r} has no default bundle: pass bundle= or deploy_config=")
        bundle = resolve_dotted(pipeline.default_bundle)()
    graph_stages = [s for s in pipeline.stages if s.execution_type is StageExecutionType.GRAPH]
    if len(graph_stages) != 1:
        raise ValueError(
            f"pipeline {pipeline.model_type!r} has {len(graph_stages)} graph stages; bundle= builds plans of one "
            "graph stage (plus the native stages its bundle carries), use deploy_config= for more"
        )
    stages = []
    for stage in pipeline.stages:
        if stage.execution_type is StageExecutionType.GRAPH:
            backend = {"name": GRAPH_BACKEND, "manifest": str(bundle),
                       "route": {"name": DEFAULT_ROUTE, "interpreter": sys.executable, "ep": "cpu"}}
        else:
            backend = _bundle_backbone(Path(bundle))
        stages.append({"stage_id": stage.stage_id, "backend": backend})
    deploy = validate_deploy_config({"pipeline": pipeline.model_type, "stages": stages})
    return pipeline, deploy


def _bundle_backbone(bundle: Path) -> dict[str, Any]:
    """A native stage's backend on the backbone folder a head bundle carries.

    Only the manifest is read here; the runtime verifies the bundle (backbone files included)
    before the engine loads them.
    """
    layout = load_manifest(bundle).metadata.layout
    backbone_dir = layout.get("backbone_dir") if isinstance(layout, Mapping) else None
    if not isinstance(backbone_dir, str) or not backbone_dir:
        raise ValueError(f"{bundle / MANIFEST_NAME}: metadata.layout.backbone_dir is missing, so the bundle carries "
                         "no backbone for the pipeline's native stage; use deploy_config= to name one")
    root = bundle.parent if bundle.name == MANIFEST_NAME else bundle
    backend: dict[str, Any] = {"name": NATIVE_BACKEND, "model": str(root / backbone_dir),
                               "engine_args": dict(DEFAULT_NATIVE_ENGINE_ARGS)}
    if layout.get("max_model_len") is not None:
        backend["max_model_len"] = layout["max_model_len"]
    return backend


class OmniBase:
    """Startup, introspection and shutdown shared by `Omni` and `AsyncOmni`."""

    def __init__(self, model: str | None = None, deploy_config: str | Path | DeployConfig | None = None,
                 bundle: str | Path | None = None, *, max_queued_requests: int | None = None,
                 startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S, warmup: bool = True,
                 served_engine: ServedEngine | None = None, cancel: StartCancel | None = None) -> None:
        self.pipeline, self.deploy = build_plan(model, deploy_config, bundle)
        self._final_stage_id = self.pipeline.final_stage.stage_id
        self._final_output_type = self.pipeline.final_output_type
        self.runtime = StageRuntime(self.pipeline, self.deploy, startup_timeout=startup_timeout,
                                    served_engine=served_engine, cancel=cancel)
        self.runtime.start()
        try:
            if self.pipeline.processor is not None:
                self.processor: Processor = resolve_dotted(self.pipeline.processor)(self.runtime.bundles)
            else:
                entry = self.runtime.ordered_stages[0]
                self.processor = TensorProcessor(entry.input_specs, max_io_bytes=entry.max_io_bytes)
            self.orchestrator = Orchestrator(
                self.runtime, self.processor,
                max_queued_requests=max_queued_requests or self.deploy.max_queued_requests,
            )
            warmup_request = self.processor.warmup_request() if warmup else None
            if warmup_request is not None:
                started = time.monotonic()
                request = self.orchestrator.submit(warmup_request, request_id=f"warmup-{uuid.uuid4().hex}",
                                                   deadline_s=startup_timeout)
                try:
                    request.wait()
                finally:
                    self.orchestrator.acknowledge(request)
                logger.info("pipeline %s: warm-up request answered in %.2f s", self.model, time.monotonic() - started)
        except BaseException:
            self.runtime.shutdown()
            raise

    @property
    def model(self) -> str:
        return self.pipeline.model_type

    @property
    def execution_plan(self) -> dict[str, Any]:
        """Per stage and replica: manifest identity, worker generation, route, reservation, placement."""
        return self.runtime.execution_plan()

    def audit(self) -> dict:
        """What produces the answers (the processor's audit; empty for raw graph pipelines)."""
        return self.processor.audit()

    def warmup_request(self) -> dict:
        """A real request that exercises the whole pipeline (processor pipelines only)."""
        request = self.processor.warmup_request()
        if request is None:
            raise TypeError(f"pipeline {self.model!r} has no processor, so no warmup request")
        return request

    def health(self) -> dict[int, str]:
        """Stages that cannot serve now -> why ("recovering: ...", "unavailable: ...", "failed:
        ..."); empty while every stage has a live replica."""
        return self.runtime.health()

    def failure(self) -> str | None:
        """One line saying why the pipeline is down for good, or None (it serves, or recovers by itself)."""
        failed = {stage_id: reason for stage_id, (state, reason) in self.runtime.stage_states().items()
                  if state == "failed"}
        return "; ".join(f"stage {stage_id}: {reason}" for stage_id, reason in failed.items()) or None

    def recovering(self) -> str | None:
        """One line saying which stages cannot serve now but recover by themselves, or None."""
        down = {stage_id: reason for stage_id, reason in self.runtime.health().items()
                if not reason.startswith("failed")}
        return "; ".join(f"stage {stage_id}: {reason}" for stage_id, reason in down.items()) or None

    def queue_depth(self) -> int:
        """Admitted requests not yet acknowledged (the admission bound applies to this)."""
        return self.orchestrator.queue_depth

    def requests_by_phase(self) -> dict[Phase, int]:
        """Admitted requests by lifecycle phase (queued, running, finishing), for metrics."""
        return self.orchestrator.requests_by_phase()

    def hold(self, slots: int) -> AdmissionHold:
        """Set queue slots aside for requests admitted as a unit (pass it to `generate(hold=)`);
        ResourceUnavailable when the queue cannot take them all now. Release it when done."""
        return self.orchestrator.hold(slots)

    def ledger_snapshot(self) -> dict[str, Any]:
        """Capacities, charges and live reservations of the resource ledger."""
        return self.runtime.ledger.snapshot()

    def metrics(self) -> EngineMetrics:
        """Every stage's and the ledger's counters as typed records (what `/metrics` exports)."""
        return self.runtime.metrics()

    def shutdown(self) -> None:
        """Fail unfinished requests, stop every worker, release every reservation. Idempotent."""
        self.orchestrator.close()
        self.runtime.shutdown()

    def _abort_each(self, request_id: str | Iterable[str]) -> None:
        for one in [request_id] if isinstance(request_id, str) else request_id:
            self.orchestrator.abort(one)

    def _output(self, request: RequestState, result: Any, error: str | None = None) -> OmniRequestOutput:
        return OmniRequestOutput(
            request_id=request.request_id,
            stage_id=self._final_stage_id,
            finished=True,
            final_output_type=self._final_output_type,
            custom_output=result,
            stage_durations=dict(request.stage_durations),
            error=error,
            _release=lambda: self.orchestrator.acknowledge(request),
        )


class AsyncOmni(OmniBase):
    """The asyncio front: `generate` per request, `abort`, `shutdown`; also an async context manager.

    It only routes: a request is admitted with the calling event loop, the engine finishes it there
    (its output step) and sets the future `generate` awaits."""

    async def generate(self, prompt: Mapping[str, Any], request_id: str | None = None, *,
                       deadline_s: float | None = None,
                       hold: AdmissionHold | None = None) -> AsyncGenerator[OmniRequestOutput, None]:
        """Yield the request's finished output.

        Raises `RequestInvalid` (the prompt), `ResourceUnavailable` (queue full), `StageUnavailable`
        (no live replica), `DeadlineExceeded`, `RequestCancelled` (aborted). Cancelling the
        consuming task aborts the request. The result is acknowledged when the generator advances
        or closes.
        """
        request = self.orchestrator.submit(prompt, request_id=request_id, deadline_s=deadline_s, hold=hold,
                                           loop=asyncio.get_running_loop())
        try:
            try:
                result = await request.done
            except asyncio.CancelledError:
                self.orchestrator.abort(request.request_id)
                raise
            yield self._output(request, result)
        finally:
            self.orchestrator.acknowledge(request)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Cancel requests: queued ones leave undispatched; a call in flight is fenced (its worker stays)."""
        self._abort_each(request_id)

    async def __aenter__(self) -> AsyncOmni:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.shutdown)

    def __enter__(self) -> AsyncOmni:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


class Omni(OmniBase):
    """The blocking front: `generate(prompts)` returns one output per prompt, in order."""

    def generate(self, prompts: Mapping[str, Any] | Sequence[Mapping[str, Any]], *,
                 deadline_s: float | None = None) -> list[OmniRequestOutput]:
        """Run every prompt; a prompt that fails after admission gets an output with `error` set.

        Every prompt is validated before any is admitted (`RequestInvalid` propagates). At most
        the admission bound runs at once; the rest wait for earlier ones to finish.
        """
        batch = [prompts] if isinstance(prompts, Mapping) else list(prompts)
        prepared = [self.processor.prepare(prompt) for prompt in batch]
        outputs: list[OmniRequestOutput | None] = [None] * len(batch)
        running: deque[tuple[int, RequestState]] = deque()
        for index, work in enumerate(prepared):
            while True:
                try:
                    running.append((index, self.orchestrator.admit(work, deadline_s=deadline_s)))
                    break
                except ResourceUnavailable:
                    if not running:
                        raise
                    self._collect(*running.popleft(), outputs)
        while running:
            self._collect(*running.popleft(), outputs)
        return outputs  # type: ignore[return-value]  # no None left: every work item was collected

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Cancel requests: queued ones leave undispatched; a call in flight is fenced (its worker stays)."""
        self._abort_each(request_id)

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def _collect(self, index: int, request: RequestState, outputs: list[OmniRequestOutput | None]) -> None:
        try:
            output = self._output(request, request.wait())
        except Exception as exc:
            output = self._output(request, None, error=f"{type(exc).__name__}: {exc}")
        self.orchestrator.acknowledge(request)
        outputs[index] = output
