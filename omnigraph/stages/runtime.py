"""StageRuntime: turns a pipeline declaration and a deploy plan into serving stages.

Graph stages (GraphStage, graph_stage.py) run verified ONNX bundles in worker processes; `llm_pooling`
stages (NativeStage, native_stage.py) run a vLLM pooling engine: in-process, or the `vllm serve`
engine omnigraph runs inside (`served_engine`). Both are reserved, started and unwound alike.

Order of start, each step refusing before the next begins: verify every bundle and build every
route; reserve the WHOLE plan in the ledger (all replicas of all stages, atomically); then start,
load and warm up each replica's worker (the worker refuses a placement that breaks the route).
Any failure unwinds everything started so far and releases every reservation, so a refused plan
leaves no process and no charge behind.

A retired replica (graph_stage.py: a worker that died, broke the wire or hung; never a client's
cancellation or deadline) is replaced in the background, never on a request's path: once the OS
has confirmed its worker's exit and its reservation is released, a new worker generation of the
same stage reserves the stage's demands again, starts, loads and warms up, then joins the stage's
queue. A worker that dies while idle is noticed at once (StageMonitor) and replaced eagerly; one
that dies during a call whose reply was already in is retired as that call ends. The
deploy key `restart` bounds the starts (RestartBudget); past it the stage backs off with growing
delays and recovers by itself, and a start that fails counts as a restart and gives back all it
took. Each bundle is re-verified every `reverify_interval_s` and before every replacement start: a
changed file turns the stage unavailable, naming it, until the verified bytes are back. While a
stage has no live replica its requests fail at once with a retryable StageUnavailable; only a
stage whose operator declared `max_restarts: 0` stays down for good.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from omnigraph.bundles import VerifiedBundle, verify_bundle
from omnigraph.bundles.defaults import DEFAULT_STARTUP_TIMEOUT_S
from omnigraph.pipelines.config import PipelineConfig, StageExecutionType
from omnigraph.pipelines.deploy import DeployConfig
from omnigraph.stages.errors import StageStartupError
from omnigraph.stages.graph_stage import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    GraphReplica,
    GraphStage,
    Launched,
    worker_route,
)
from omnigraph.stages.ledger import Reservation, ResourceLedger
from omnigraph.stages.metrics import EngineMetrics, LedgerMetrics
from omnigraph.stages.monitor import StageMonitor
from omnigraph.stages.native_stage import NativeStage, ServedEngine
from omnigraph.stages.protocols import ServingStage
from omnigraph.stages.ray_cluster import DEFAULT_PLACEMENT, RayCluster, StagePlacement, cluster_for
from omnigraph.stages.startup import StartCancel
from omnigraph.workers.client import WorkerClient
from omnigraph.workers.errors import WorkerStartFailed

logger = logging.getLogger("omnigraph.stages")


class StageRuntime:
    """All stages of one pipeline, started under one ledger."""

    def __init__(self, pipeline: PipelineConfig, deploy: DeployConfig, *, ledger: ResourceLedger | None = None,
                 startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S, served_engine: ServedEngine | None = None,
                 cancel: StartCancel | None = None) -> None:
        self.pipeline = pipeline
        self.deploy = deploy
        self.ledger = ledger if ledger is not None else ResourceLedger()
        self.startup_timeout = startup_timeout
        self.served_engine = served_engine
        self.stages: dict[int, ServingStage] = {}
        self._generations = itertools.count(1)
        self._closed = False
        self._monitor: StageMonitor | None = None
        self._starting: Launched = []
        self._cluster: RayCluster | None = None  # distributed_executor_backend: ray
        self.cancel = cancel if cancel is not None else StartCancel()
        self.cancel.bind(self._kill_starting)

    @property
    def ordered_stages(self) -> list[ServingStage]:
        """The started stages in chain order (none before a successful `start`)."""
        return [self.stages[stage_id] for stage_id in self.pipeline.stage_order if stage_id in self.stages]

    @property
    def bundles(self) -> dict[int, VerifiedBundle]:
        """The graph stages' verified bundles, by stage id (what a processor is built from)."""
        return {stage_id: stage.bundle for stage_id, stage in self.stages.items() if stage.bundle is not None}

    def start(self) -> None:
        """Verify, reserve the whole plan, then start, load and warm up every replica (the order
        `ServingStage` names); any failure unwinds everything started."""
        started = time.monotonic()
        stages = [self._plan_stage(stage_id) for stage_id in self.pipeline.stage_order]
        verified = [stage.bundle for stage in stages if stage.bundle is not None]
        logger.info("pipeline %s: %d bundle(s) verified in %.1f s", self.pipeline.model_type, len(verified),
                    time.monotonic() - started)
        for stage in stages:
            stage.bind(verified)
            self.ledger.declare_capacities(stage.deploy.resource_budget.capacities,
                                           declared_by=f"stage {stage.stage_id}")
        owners = [(stage, replica) for stage in stages for replica in range(stage.deploy.num_replicas)]
        self._place_on_cluster(stages)
        try:
            reservations = self.ledger.reserve_all(
                [(_owner(stage, replica), stage.deploy.resource_budget.demands) for stage, replica in owners],
                nodes=[self._node_of(stage, replica) for stage, replica in owners])
        except BaseException:
            self._close_cluster()
            raise
        logger.info("pipeline %s: reserved %d replica(s) of %d stage(s)", self.pipeline.model_type, len(owners),
                    len(stages))
        launched = self._starting
        try:
            for (stage, replica), reservation in zip(owners, reservations):
                self.cancel.check(f"after {len(launched)} of {len(owners)} replicas")
                stage.start_replica(replica, reservation, self.ledger, launched)
            for stage in stages:
                stage.loaded()
            for stage, following in zip(stages, stages[1:]):
                stage.check_consumer(following)
        except BaseException:
            for stage in stages:
                stage.abort_start(DEFAULT_SHUTDOWN_TIMEOUT_S)
            self._unwind(launched, reservations)
            self._close_cluster()
            raise
        self.stages = {stage.stage_id: stage for stage in stages}
        self._monitor = StageMonitor()
        for stage in stages:
            stage.start_serving(self._monitor)
        logger.info("pipeline %s: %d stage(s) serving, started in %.1f s", self.pipeline.model_type, len(stages),
                    time.monotonic() - started)

    def _place_on_cluster(self, stages: list[ServingStage]) -> None:
        """Under `distributed_executor_backend: ray`, the whole plan's placement groups, placed
        before any worker starts (ray_cluster.py); nothing for a local plan."""
        self._cluster = cluster_for(self.deploy)
        if self._cluster is not None:
            self._cluster.reserve([StagePlacement(stage.stage_id, stage.deploy.num_replicas,
                                                  stage.deploy.placement or DEFAULT_PLACEMENT,
                                                  stage.deploy.resource_budget.demands)
                                   for stage in stages if isinstance(stage, GraphStage)], timeout=self.startup_timeout)
            logger.info("pipeline %s: placement groups placed on the Ray cluster", self.pipeline.model_type)

    def _node_of(self, stage: ServingStage, replica: int) -> str | None:
        """The Ray node the ledger charges a replica to: a graph replica's bundle's, this process's
        for a native stage (it runs here); None for a local plan."""
        if self._cluster is None:
            return None
        if not isinstance(stage, GraphStage):
            return self._cluster.controller_node
        return self._cluster.bundle_node(stage.stage_id, replica, self.startup_timeout)

    def _close_cluster(self) -> None:
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None

    def _unwind(self, launched: Launched, reservations: list[Reservation]) -> None:
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

    def _plan_stage(self, stage_id: int) -> ServingStage:
        config = self.pipeline.stage(stage_id)
        deploy = self.deploy.stage(stage_id)
        if config.execution_type is StageExecutionType.LLM_POOLING:
            return NativeStage(config, deploy, served=self.served_engine)
        bundle = verify_bundle(deploy.graph_backend.manifest)
        return GraphStage(config, deploy, bundle, worker_route(deploy), self)

    def start_replica(self, stage: GraphStage, replica: int, reservation: Reservation, launched: Launched, *,
                       restarts: int = 0) -> GraphReplica:
        """Start, load and warm up one worker charged to `reservation`; `launched` gets it once it exists."""
        started = time.monotonic()
        try:
            if self._cluster is None:
                client = WorkerClient.start(stage.route, generation=next(self._generations),
                                            startup_timeout=self.startup_timeout)
            else:
                client = self._cluster.start_worker(stage.stage_id, replica, stage.route, str(reservation.node),
                                                    generation=next(self._generations),
                                                    startup_timeout=self.startup_timeout)
        except Exception as exc:
            raise StageStartupError(stage.stage_id, replica, f"worker did not start: {exc}") from exc
        stage.register_launch(launched, client, reservation)
        self.cancel.check(f"while stage {stage.stage_id} replica {replica} was starting")  # a cancel that missed it
        try:
            report = client.load(stage.bundle.manifest_path, timeout=self.startup_timeout)
        except Exception as exc:
            raise StageStartupError(stage.stage_id, replica, f"load and warmup refused: {exc}") from exc
        if report.manifest_sha256 != stage.bundle.manifest_sha256:
            raise StageStartupError(stage.stage_id, replica,
                                    "the worker loaded another manifest than the one verified here")
        node = client.process.node
        logger.info("stage %d: replica %d on worker %d (generation %d, route %s%s) loaded %s on %s, "
                    "warmed up in %.0f ms; ready in %.1f s", stage.stage_id, replica, client.pid, client.generation,
                    stage.route.name, "" if node == "local" else f", node {node}", stage.bundle.manifest.component,
                    ", ".join(report.session_providers), report.warmup_ms, time.monotonic() - started)
        return GraphReplica(stage, replica, client, reservation, self.ledger, report, restarts=restarts,
                                hang_grace_s=stage.deploy.hang_grace_s)

    def start_replacement(self, stage: GraphStage, slot: int, restarts: int, launched: Launched) -> GraphReplica:
        """A new generation for a retired slot: its own reservation, start, load, warmup; all of it
        given back if any step fails."""
        try:
            node = self._node_of(stage, slot)
        except WorkerStartFailed as exc:
            raise StageStartupError(stage.stage_id, slot, str(exc)) from exc
        reservation = self.ledger.reserve(_owner(stage, slot), stage.deploy.resource_budget.demands, node=node)
        try:
            return self.start_replica(stage, slot, reservation, launched, restarts=restarts)
        except BaseException:
            self._unwind(launched, [reservation])
            raise

    def execution_plan(self) -> dict[str, Any]:
        """Per stage: manifest identity, batching, restarts; per replica: worker generation,
        restarts, route, reservation, placement."""
        return {
            "pipeline": self.pipeline.model_type,
            "final_output_type": self.pipeline.final_output_type,
            "stages": [stage.describe() for stage in self.ordered_stages],
            "ledger": self.ledger.snapshot(),
        }

    def metrics(self) -> EngineMetrics:
        """The stages' and the ledger's counters as typed records (stages/metrics.py), read from
        their attributes: what `/metrics` exports, without building the execution plan."""
        return EngineMetrics(tuple(stage.metrics() for stage in self.ordered_stages),
                             LedgerMetrics.from_snapshot(self.ledger.snapshot()))

    def health(self) -> dict[int, str]:
        """Stages that cannot serve now -> why (empty while every stage has a live replica). A
        stage recovering or unavailable comes back by itself; one `failed` does not."""
        unhealthy = {}
        for stage in self.ordered_stages:
            state, reason = stage.status()
            if state not in ("ok", "degraded"):
                unhealthy[stage.stage_id] = f"{state}: {reason}"
        return unhealthy

    def stage_states(self) -> dict[int, tuple[str, str | None]]:
        """Every stage's (state, why): see GraphStage.status."""
        return {stage.stage_id: stage.status() for stage in self.ordered_stages}

    def _kill_starting(self) -> None:
        """The start was cancelled: kill the workers being started, so `start` unwinds at once."""
        for client, _ in list(self._starting):
            client.kill()

    def stop_replacing(self) -> None:
        """No retired replica is replaced from now on (the first step of a shutdown)."""
        for stage in self.ordered_stages:
            stage.stop_replacing()

    def shutdown(self, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Stop every replica and release every reservation whose worker is verified gone."""
        if self._closed:
            return
        self._closed = True
        if self._monitor is not None:
            self._monitor.stop()
        for stage in self.ordered_stages:
            stage.stop(timeout)
        self._close_cluster()


def _owner(stage: ServingStage, replica: int) -> str:
    return f"stage{stage.stage_id}/replica{replica}"
