"""StageRuntime: turns a pipeline declaration and a deploy plan into serving graph stages.

Order of start, each step refusing before the next begins: verify every bundle and build every
route; reserve the WHOLE plan in the ledger (all replicas of all stages, atomically); then start,
load and warm up each replica's worker (the worker refuses a placement that breaks the route).
Any failure unwinds everything started so far and releases every reservation, so a refused plan
leaves no process and no charge behind.
"""

from __future__ import annotations

import itertools
import queue
import threading
from typing import Any, Callable, Mapping

import numpy as np

from omnigraph.bundles import VerifiedBundle, verify_bundle
from omnigraph.pipelines.config import PipelineConfig, StageExecutionType, StagePipelineConfig
from omnigraph.pipelines.deploy import DeployConfig, StageDeployConfig
from omnigraph.pipelines.registry import resolve_dotted
from omnigraph.stages.errors import StageStartupError, StageUnavailable
from omnigraph.stages.graph_client import STOP, GraphStageClient
from omnigraph.stages.handoff import outputs_as_inputs
from omnigraph.stages.ledger import Reservation, ResourceLedger
from omnigraph.stages.tensors import InputSpec, input_specs
from omnigraph.workers.client import WorkerClient
from omnigraph.workers.route import WorkerRoute

DEFAULT_STARTUP_TIMEOUT_S = 120.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
HandoffFunc = Callable[[Mapping[int, Mapping[str, np.ndarray]], Mapping[str, np.ndarray]], Mapping[str, Any]]


def worker_route(stage: StageDeployConfig) -> WorkerRoute:
    """The route a graph stage's workers run on; on GPU routes the stage's VRAM demand on its
    device (`machine:vram:<device_id>`) becomes ORT's arena limit (`gpu_mem_limit`)."""
    backend = stage.backend
    route = backend.route
    vram = stage.resource_budget.demands.get(f"machine:vram:{route.device_id}") if route.ep != "cpu" else None
    extra = {"max_io_bytes": backend.max_io_bytes} if backend.max_io_bytes is not None else {}
    return WorkerRoute(
        name=route.name,
        interpreter=route.interpreter,
        ep=route.ep,
        device_id=route.device_id,
        provider_options=route.provider_options,
        allowed_providers=tuple(backend.allowed_providers or ()),
        min_fraction_on_target=backend.min_fraction_on_target,
        os_domain=route.os_domain,
        enable_cuda_graph=route.enable_cuda_graph,
        gpu_mem_limit=vram or None,
        intra_op_num_threads=route.intra_op_num_threads,
        env=stage.env,
        **extra,
    )


class GraphStage:
    """A graph stage's serving state: its replicas and the queue they share."""

    def __init__(self, config: StagePipelineConfig, deploy: StageDeployConfig, bundle: VerifiedBundle,
                 route: WorkerRoute) -> None:
        self.config = config
        self.deploy = deploy
        self.bundle = bundle
        self.route = route
        self.stage_id = config.stage_id
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.replicas: list[GraphStageClient] = []
        self.input_specs: dict[str, InputSpec] = {}
        self.handoff: HandoffFunc = (
            resolve_dotted(config.custom_process_input_func) if config.custom_process_input_func else outputs_as_inputs
        )
        self.failure: str | None = None
        self._lock = threading.Lock()

    def submit(self, item: Any) -> None:
        """Queue a work item for the next free replica; fails fast once no replica is left."""
        with self._lock:
            if self.failure is not None:
                raise StageUnavailable(f"stage {self.stage_id} has no live replica ({self.failure}); recreate the pipeline")
            self.queue.put(item)

    def replica_retired(self, replica: GraphStageClient) -> None:
        """Called by a retiring replica; the last one out fails everything still queued here."""
        with self._lock:
            if any(r.serving for r in self.replicas) or self.failure is not None:
                return
            self.failure = f"replica {replica.replica} retired: {replica.retired_reason}"
            error = StageUnavailable(f"stage {self.stage_id} has no live replica ({self.failure}); recreate the pipeline")
            while True:
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
                if item is not STOP:
                    item.fail(error)

    def stop(self, timeout: float) -> None:
        """Stop every replica thread (a retiring one first verifies its worker's exit), then close the workers."""
        for replica in self.replicas:
            if replica.serving:
                self.queue.put(STOP)
        for replica in self.replicas:
            replica.join(timeout)
        for replica in self.replicas:
            replica.close(timeout)

    def describe(self) -> dict[str, Any]:
        return {
            "stage_id": self.stage_id,
            "model_stage": self.config.model_stage,
            "execution_type": self.config.execution_type.value,
            "input_sources": list(self.config.input_sources),
            "final_output": self.config.final_output,
            "manifest": {
                "path": str(self.bundle.manifest_path),
                "sha256": self.bundle.manifest_sha256,
                "component": self.bundle.manifest.component,
            },
            "num_replicas": self.deploy.num_replicas,
            "live_replicas": sum(r.serving for r in self.replicas),
            "failure": self.failure,
            "replicas": [r.describe() for r in self.replicas],
        }


class StageRuntime:
    """All stages of one pipeline, started under one ledger."""

    def __init__(self, pipeline: PipelineConfig, deploy: DeployConfig, *, ledger: ResourceLedger | None = None,
                 startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S) -> None:
        self.pipeline = pipeline
        self.deploy = deploy
        self.ledger = ledger if ledger is not None else ResourceLedger()
        self.startup_timeout = startup_timeout
        self.stages: dict[int, GraphStage] = {}
        self._generations = itertools.count(1)
        self._closed = False

    @property
    def ordered_stages(self) -> list[GraphStage]:
        """The started stages in chain order (none before a successful `start`)."""
        return [self.stages[stage_id] for stage_id in self.pipeline.stage_order if stage_id in self.stages]

    @property
    def bundles(self) -> dict[int, VerifiedBundle]:
        return {stage_id: stage.bundle for stage_id, stage in self.stages.items()}

    def start(self) -> None:
        """Verify, reserve the whole plan, then start, load and warm up every replica."""
        stages = [self._plan_stage(stage_id) for stage_id in self.pipeline.stage_order]
        for stage in stages:
            self.ledger.declare_capacities(stage.deploy.resource_budget.capacities, declared_by=f"stage {stage.stage_id}")
        owners = [(stage, replica) for stage in stages for replica in range(stage.deploy.num_replicas)]
        reservations = self.ledger.reserve_all([
            (f"stage{stage.stage_id}/replica{replica}", stage.deploy.resource_budget.demands) for stage, replica in owners
        ])
        launched: list[tuple[WorkerClient, Reservation]] = []
        try:
            for (stage, replica), reservation in zip(owners, reservations):
                stage.replicas.append(self._start_replica(stage, replica, reservation, launched))
            for stage in stages:
                stage.input_specs = input_specs(stage.replicas[0].load_report)
        except BaseException:
            self._unwind(launched, reservations)
            raise
        self.stages = {stage.stage_id: stage for stage in stages}
        for stage in stages:
            for replica in stage.replicas:
                replica.start_serving()

    def _unwind(self, launched: list[tuple[WorkerClient, Reservation]], reservations: list[Reservation]) -> None:
        """Kill every worker started so far; release each reservation (quarantine if an exit is unverified)."""
        for client, _ in launched:
            client.kill()
        settled = set()
        for client, reservation in launched:
            settled.add(reservation.reservation_id)
            if client.wait_exit(DEFAULT_SHUTDOWN_TIMEOUT_S):
                client.close()
                self.ledger.release(reservation)
            else:
                self.ledger.quarantine(reservation)
        for reservation in reservations:
            if reservation.reservation_id not in settled:
                self.ledger.release(reservation)

    def _plan_stage(self, stage_id: int) -> GraphStage:
        config = self.pipeline.stage(stage_id)
        deploy = self.deploy.stage(stage_id)
        if config.execution_type is not StageExecutionType.GRAPH:
            raise StageStartupError(stage_id, 0, f"execution_type {config.execution_type.value!r} has no stage client in this engine")
        bundle = verify_bundle(deploy.backend.manifest)
        return GraphStage(config, deploy, bundle, worker_route(deploy))

    def _start_replica(self, stage: GraphStage, replica: int, reservation: Reservation,
                       launched: list[tuple[WorkerClient, Reservation]]) -> GraphStageClient:
        try:
            client = WorkerClient.start(stage.route, generation=next(self._generations), startup_timeout=self.startup_timeout)
        except Exception as exc:
            raise StageStartupError(stage.stage_id, replica, f"worker did not start: {exc}") from exc
        launched.append((client, reservation))
        try:
            report = client.load(stage.bundle.manifest_path, timeout=self.startup_timeout)
        except Exception as exc:
            raise StageStartupError(stage.stage_id, replica, f"load and warmup refused: {exc}") from exc
        if report.manifest_sha256 != stage.bundle.manifest_sha256:
            raise StageStartupError(stage.stage_id, replica, "the worker loaded another manifest than the one verified here")
        return GraphStageClient(stage, replica, client, stage.route, reservation, self.ledger, report)

    def execution_plan(self) -> dict[str, Any]:
        """Per stage: manifest identity, and per replica: worker generation, route, reservation, placement."""
        return {
            "pipeline": self.pipeline.model_type,
            "final_output_type": self.pipeline.final_output_type,
            "stages": [stage.describe() for stage in self.ordered_stages],
            "ledger": self.ledger.snapshot(),
        }

    def health(self) -> dict[int, str]:
        """Failed stages -> why (empty when every stage has a live replica)."""
        return {stage.stage_id: stage.failure for stage in self.ordered_stages if stage.failure is not None}

    def shutdown(self, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Stop every replica and release every reservation whose worker is verified gone."""
        if self._closed:
            return
        self._closed = True
        for stage in self.ordered_stages:
            stage.stop(timeout)
