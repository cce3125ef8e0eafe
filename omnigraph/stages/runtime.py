"""StageRuntime: turns a pipeline declaration and a deploy plan into serving stages.

Graph stages (GraphStage, below) run verified ONNX bundles in worker processes; `llm_pooling`
stages (NativeStage, native_client.py) run a vLLM pooling engine: in-process, or the `vllm serve`
engine omnigraph runs inside (`served_engine`). Both are reserved, started and unwound alike.

Order of start, each step refusing before the next begins: verify every bundle and build every
route; reserve the WHOLE plan in the ledger (all replicas of all stages, atomically); then start,
load and warm up each replica's worker (the worker refuses a placement that breaks the route).
Any failure unwinds everything started so far and releases every reservation, so a refused plan
leaves no process and no charge behind.

A retired replica (graph_client.py: a worker that died, broke the wire or hung; never a client's
cancellation or deadline) is replaced in the background, never on a request's path: once the OS
has confirmed its worker's exit and its reservation is released, a new worker generation of the
same stage reserves the stage's demands again, starts, loads and warms up, then joins the stage's
queue. A worker that dies while idle is noticed at once (StageMonitor) and replaced eagerly. The
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
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from omnigraph.bundles import VerifiedBundle, verify_bundle
from omnigraph.bundles.watch import BundleWatch
from omnigraph.pipelines.config import PipelineConfig, StageExecutionType, StagePipelineConfig
from omnigraph.pipelines.deploy import DeployConfig, StageDeployConfig
from omnigraph.pipelines.registry import resolve_dotted
from omnigraph.stages.batching import (
    AxisZeroAdapter,
    BatchAdapter,
    BatchLimits,
    BatchStats,
    Queued,
    StageQueue,
    batch_axis_problem,
)
from omnigraph.stages.errors import StageStartupError, StageUnavailable
from omnigraph.stages.graph_client import REPLACEMENT_RETRY_AFTER_S, GraphStageClient
from omnigraph.stages.monitor import StageMonitor
from omnigraph.stages.handoff import outputs_as_inputs
from omnigraph.stages.native_client import NativeStage, ServedEngine
from omnigraph.stages.ledger import Reservation, ResourceLedger
from omnigraph.stages.restarts import RestartBudget
from omnigraph.stages.startup import StartCancel
from omnigraph.stages.tensors import InputSpec, input_specs
from omnigraph.workers.client import WorkerClient
from omnigraph.workers.route import WorkerRoute

DEFAULT_STARTUP_TIMEOUT_S = 120.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
logger = logging.getLogger("omnigraph.stages")
Launched = list[tuple[WorkerClient, Reservation]]
# (stage, slot, restarts, launched) -> a started replica for the slot (StageRuntime._start_replacement)
StartReplacement = Callable[["GraphStage", int, int, Launched], GraphStageClient]
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
        cuda_graph_max_rows=route.cuda_graph_max_rows,
        max_cuda_graphs=route.max_cuda_graphs,
        gpu_mem_limit=vram or None,
        intra_op_num_threads=route.intra_op_num_threads,
        spin_wait_us=route.spin_wait_us,
        mailbox_bytes=route.mailbox_bytes,
        env=stage.env,
        **extra,
    )


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
                 route: WorkerRoute, start_replacement: StartReplacement) -> None:
        self.config = config
        self.deploy = deploy
        self.bundle = bundle
        self.route = route
        self.stage_id = config.stage_id
        self.queue = StageQueue(BatchLimits.for_stage(config, deploy.batching), _batch_adapter(config, bundle, route))
        self.batch_stats = BatchStats()
        self.replicas: list[GraphStageClient] = []
        self.input_specs: dict[str, InputSpec] = {}
        self.handoff: HandoffFunc = (
            resolve_dotted(config.custom_process_input_func) if config.custom_process_input_func else outputs_as_inputs
        )
        self.failure: str | None = None            # down for good: only with `max_restarts: 0`
        self.bundle_problem: str | None = None     # the bundle on disk is no longer the verified one
        self.backoff_until: float | None = None    # a replacement waits for the restart budget until then
        self.last_retirement: str | None = None    # why the latest replica retired
        self.restart_budget = RestartBudget(deploy.restart.max_restarts, deploy.restart.window_s)
        self.watch = BundleWatch(bundle)
        self._replacing: set[int] = set()         # slots whose replacement is due or starting
        self._launches: list[Launched] = []        # workers being started by replacements
        self._threads: list[threading.Thread] = []
        self._start_replacement = start_replacement
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self.monitor: StageMonitor | None = None  # set by the runtime once the stage serves

    def serve(self, replica: GraphStageClient) -> None:
        """Start a replica's thread, its worker's exit watched by the monitor."""
        replica.start_serving()
        if self.monitor is not None:
            self.monitor.watch_exit(replica.client.pid, lambda: self.worker_exited(replica))

    def check_batching(self) -> None:
        """Refuse a declared `max_batch_rows` the loaded bundle's I/O cannot honour."""
        max_rows = self.queue.limits.max_rows
        if max_rows > 1 and (problem := batch_axis_problem(self.replicas[0].load_report)):
            raise StageStartupError(self.stage_id, 0, f"max_batch_rows={max_rows} is declared but "
                                    f"calls of {self.bundle.manifest.component} cannot be merged: {problem}")

    def submit(self, item: Any) -> None:
        """Queue a work item for the next free replica; fails fast while no replica is live."""
        with self._lock:
            self._check_live_locked()
            self.queue.put(item)

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
        and fences the call (graph_client.py)."""

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

    def replica_retired(self, replica: GraphStageClient) -> bool:
        """Called by a retiring replica: its slot is to be replaced (unless the stage closes or its
        operator declared `max_restarts: 0`); while no replica is live, everything queued here
        fails at once. True while the stage can still serve, so a retry is worth it."""
        with self._lock:
            self.last_retirement = f"replica {replica.replica} retired: {replica.retired_reason}"
            if not self._closing.is_set() and self.failure is None:
                if self.restart_budget.max_restarts > 0:
                    self._replacing.add(replica.replica)
                else:
                    self._fail_if_dead_locked(f"replica {replica.replica} retired: {replica.retired_reason} "
                                              "(max_restarts is 0: never replaced)")
            self._drain_if_dead_locked()
            return self.failure is None

    def replica_exited(self, replica: GraphStageClient) -> None:
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

    def worker_exited(self, replica: GraphStageClient) -> None:
        """From the monitor: the replica's worker process is gone. An idle replica is retired (and
        replaced) now; a busy one finds out on its call."""
        returncode = replica.client.returncode
        replica.retire_if_idle(f"worker {replica.client.pid} exited while idle"
                               + ("" if returncode is None else f" with status {returncode}"))

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
            f"stage {self.stage_id} has no live replica: {self._recovery_locked()}", retry_after=self._retry_after_locked())
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
                logger.warning("stage %d: replica %d waits %.0f s before its replacement starts", self.stage_id, slot, delay)
                self._closing.wait(delay)
                continue
            launched: Launched = []
            with self._lock:
                if self._closing.is_set():
                    break
                self._launches.append(launched)
            try:
                replica = self._start_replacement(self, slot, restarts, launched)
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
        self.stages: dict[int, GraphStage | NativeStage] = {}
        self._generations = itertools.count(1)
        self._closed = False
        self._monitor: StageMonitor | None = None
        self._starting: Launched = []
        self.cancel = cancel if cancel is not None else StartCancel()
        self.cancel.bind(self._kill_starting)

    @property
    def ordered_stages(self) -> list[GraphStage | NativeStage]:
        """The started stages in chain order (none before a successful `start`)."""
        return [self.stages[stage_id] for stage_id in self.pipeline.stage_order if stage_id in self.stages]

    @property
    def bundles(self) -> dict[int, VerifiedBundle]:
        """The graph stages' verified bundles, by stage id (what a processor is built from)."""
        return {stage_id: stage.bundle for stage_id, stage in self.stages.items() if isinstance(stage, GraphStage)}

    def start(self) -> None:
        """Verify, reserve the whole plan, then start, load and warm up every replica."""
        stages = [self._plan_stage(stage_id) for stage_id in self.pipeline.stage_order]
        bundles = [stage.bundle for stage in stages if isinstance(stage, GraphStage)]
        for stage in stages:
            if isinstance(stage, NativeStage):
                stage.bind_verified_bundle(bundles)
        for stage in stages:
            self.ledger.declare_capacities(stage.deploy.resource_budget.capacities, declared_by=f"stage {stage.stage_id}")
        owners = [(stage, replica) for stage in stages for replica in range(stage.deploy.num_replicas)]
        reservations = self.ledger.reserve_all([
            (_owner(stage, replica), stage.deploy.resource_budget.demands) for stage, replica in owners
        ])
        launched = self._starting
        try:
            for (stage, replica), reservation in zip(owners, reservations):
                self.cancel.check(f"after {len(launched)} of {len(owners)} replicas")
                if isinstance(stage, NativeStage):
                    stage.start(reservation, self.ledger)
                else:
                    stage.replicas.append(self._start_replica(stage, replica, reservation, launched))
            for stage in stages:
                if isinstance(stage, GraphStage):
                    stage.input_specs = input_specs(stage.replicas[0].load_report)
                    stage.check_batching()
            for stage, following in zip(stages, stages[1:]):
                if isinstance(stage, NativeStage):
                    stage.check_consumer(following.input_specs, following.stage_id)
        except BaseException:
            for stage in stages:
                if isinstance(stage, NativeStage):
                    stage.stop(DEFAULT_SHUTDOWN_TIMEOUT_S)
            self._unwind(launched, reservations)
            raise
        self.stages = {stage.stage_id: stage for stage in stages}
        self._monitor = StageMonitor()
        for stage in stages:
            if isinstance(stage, GraphStage):
                stage.monitor = self._monitor
                for replica in stage.replicas:
                    stage.serve(replica)
                if stage.deploy.reverify_interval_s is not None:
                    self._monitor.every(stage.deploy.reverify_interval_s, stage.check_bundle)

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

    def _plan_stage(self, stage_id: int) -> GraphStage | NativeStage:
        config = self.pipeline.stage(stage_id)
        deploy = self.deploy.stage(stage_id)
        if config.execution_type is StageExecutionType.LLM_POOLING:
            return NativeStage(config, deploy, served=self.served_engine)
        bundle = verify_bundle(deploy.backend.manifest)
        return GraphStage(config, deploy, bundle, worker_route(deploy), self._start_replacement)

    def _start_replica(self, stage: GraphStage, replica: int, reservation: Reservation, launched: Launched, *,
                       restarts: int = 0) -> GraphStageClient:
        """Start, load and warm up one worker charged to `reservation`; `launched` gets it once it exists."""
        try:
            client = WorkerClient.start(stage.route, generation=next(self._generations), startup_timeout=self.startup_timeout)
        except Exception as exc:
            raise StageStartupError(stage.stage_id, replica, f"worker did not start: {exc}") from exc
        stage.register_launch(launched, client, reservation)
        self.cancel.check(f"while stage {stage.stage_id} replica {replica} was starting")  # a cancel that missed it
        try:
            report = client.load(stage.bundle.manifest_path, timeout=self.startup_timeout)
        except Exception as exc:
            raise StageStartupError(stage.stage_id, replica, f"load and warmup refused: {exc}") from exc
        if report.manifest_sha256 != stage.bundle.manifest_sha256:
            raise StageStartupError(stage.stage_id, replica, "the worker loaded another manifest than the one verified here")
        return GraphStageClient(stage, replica, client, reservation, self.ledger, report, restarts=restarts,
                                hang_grace_s=stage.deploy.hang_grace_s)

    def _start_replacement(self, stage: GraphStage, slot: int, restarts: int, launched: Launched) -> GraphStageClient:
        """A new generation for a retired slot: its own reservation, start, load, warmup; all of it
        given back if any step fails."""
        reservation = self.ledger.reserve(_owner(stage, slot), stage.deploy.resource_budget.demands)
        try:
            return self._start_replica(stage, slot, reservation, launched, restarts=restarts)
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


def _owner(stage: GraphStage, replica: int) -> str:
    return f"stage{stage.stage_id}/replica{replica}"
