"""Graph-stage replicas on a Ray cluster: a plan's `distributed_executor_backend: ray`.

Placement. Each graph stage gets one Ray placement group with a bundle per replica (the stage's
`placement`: CPUs, GPUs, custom node resources, and Ray's strategy across the bundles; its ledger
demand on `machine:ram` as Ray's `memory`), created for the whole plan before any worker starts.
A plan that no set of the cluster's nodes can hold is refused first, naming the stage and the
resource; one that could but does not get placed within the startup timeout (resources held by
others) is refused naming the stage too. Where Ray placed each bundle decides the node the
ResourceLedger charges the replica's `machine:` demands to (`bundle_node`): Ray finds the room,
the ledger stays the admission authority, per node.

Workers. A replica's worker is the same verified worker a local replica runs. A `WorkerHost`
actor, holding the replica's bundle, starts it on its node as its child; the worker connects back
to this controller over TCP (the address Ray knows this node by), proves itself with a one-time
token, loads the bundle from the same path on its node, verifies it there, and reports the
manifest hash, which the runtime compares with its own as for any worker. Calls then travel the
wire over TCP; the host actor answers the process questions (`RayWorkerProcess`).

Loss. A worker whose host actor or node is lost exits with it (it watches its parent), so its
connection drops and the replica retires as a dead local worker's would: its requests fail with a
retryable StageUnavailable, `/health` says the stage is recovering, and the replacement's actor
takes the replica's bundle wherever Ray places it again (on a surviving node).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import omnigraph
from omnigraph.pipelines.deploy import MACHINE_PREFIX, DeployConfig, PlacementConfig
from omnigraph.stages.errors import StageError
from omnigraph.workers import procfs
from omnigraph.workers.client import (
    WORKER_FOLDER_PREFIX,
    WORKER_MODULE,
    WorkerClient,
    accept_tcp_worker,
    new_worker_token,
)
from omnigraph.workers.errors import WorkerStartFailed
from omnigraph.workers.process import TCP_PREFIX, WORKER_TOKEN_ENV, log_tail
from omnigraph.workers.route import WorkerRoute

#: The exit status given for a worker whose host actor or node was lost (as if SIGKILLed).
LOST_STATUS = -9
# Why: a host actor answers its process questions in milliseconds; one that has not answered in
# this long is on a node that is going away.
ACTOR_CALL_TIMEOUT_S = 30.0
# Why: a stage's placement asks for the whole bundle a replica holds; a bundle left without
# resources here would let Ray run other work where the plan counted on room.
DEFAULT_PLACEMENT = PlacementConfig()
#: The ledger demand that becomes the bundle's Ray `memory` (bytes): the one a node advertises.
RAM_DEMAND = f"{MACHINE_PREFIX}ram"
#: The ledger demands on a GPU's memory: a placement's `gpu_memory_resource` asks for their sum.
VRAM_DEMAND_PREFIX = f"{MACHINE_PREFIX}vram:"
# Why: a bundle whose node was lost is placed again by Ray within seconds when a survivor has room;
# a replacement polls for it this often until its startup timeout.
BUNDLE_POLL_S = 0.1


class ClusterUnavailable(StageError):
    """The Ray cluster cannot hold the plan (or cannot be reached); nothing was started."""


class WorkerHost:
    """A Ray actor (async, so that waiting for its worker's exit blocks nothing) that starts one
    worker on its node and answers for its process."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._folder: Path | None = None

    async def start(self, command: list[str], env: dict[str, str]) -> tuple[int, str]:
        """Start the worker: (its pid, this node's id)."""
        import ray

        self._folder = Path(tempfile.mkdtemp(prefix=f"{WORKER_FOLDER_PREFIX}{os.getpid()}-"))
        package_parent = str(Path(omnigraph.__file__).resolve().parent.parent)
        env = {**os.environ, **env}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
        with open(self._folder / "worker.log", "wb") as log:
            self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             env=env, start_new_session=True, close_fds=True)
        return self._process.pid, ray.get_runtime_context().get_node_id()

    async def poll(self) -> int | None:
        return self._started.poll()

    async def wait(self, timeout: float | None) -> int | None:
        """The exit status once reaped within `timeout` (None: forever), else None."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (status := self._started.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.02)
        return status

    async def kill(self) -> None:
        if self._started.poll() is None:
            try:
                self._started.kill()
            except ProcessLookupError:
                pass

    async def gone(self, start_ticks: int) -> bool:
        if self._started.poll() is None:
            return False
        try:
            return procfs.process_start_ticks(self._started.pid) != start_ticks
        except FileNotFoundError:
            return True

    async def log_tail(self) -> str:
        return "" if self._folder is None else log_tail(self._folder / "worker.log")

    async def remove_files(self) -> None:
        if self._folder is not None:
            import shutil

            shutil.rmtree(self._folder, ignore_errors=True)

    @property
    def _started(self) -> subprocess.Popen:
        if self._process is None:
            raise RuntimeError("the worker host has not started its worker")
        return self._process


class RayWorkerProcess:
    """A worker started by a WorkerHost actor, seen from the controller (a WorkerProcess). Once the
    actor is unreachable (its node lost, the actor dead) the worker went with it: it is reported
    exited with LOST_STATUS and gone."""

    def __init__(self, actor: Any, pid: int, node: str) -> None:
        self._actor = actor
        self._pid = pid
        self._node = node
        self._lost = False

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def node(self) -> str:
        return self._node

    def _ask(self, method: str, *args: Any, timeout: float = ACTOR_CALL_TIMEOUT_S) -> Any:
        """The actor's answer, or LostActor once it is unreachable."""
        import ray

        if self._lost:
            raise _LostActor
        try:
            return ray.get(getattr(self._actor, method).remote(*args), timeout=timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.RaySystemError):
            self._lost = True
            raise _LostActor from None

    def poll(self) -> int | None:
        try:
            return self._ask("poll")
        except _LostActor:
            return LOST_STATUS

    def wait(self, timeout: float | None = None) -> int:
        try:
            status = self._ask("wait", timeout, timeout=ACTOR_CALL_TIMEOUT_S + (timeout or 0.0)) \
                if timeout is not None else self._wait_forever()
        except _LostActor:
            return LOST_STATUS
        if status is None:
            raise subprocess.TimeoutExpired(f"worker {self._pid} on node {self._node}", timeout or 0.0)
        return status

    def _wait_forever(self) -> int | None:
        import ray

        try:
            return ray.get(self._actor.wait.remote(None))
        except (ray.exceptions.RayActorError, ray.exceptions.RaySystemError):
            self._lost = True
            raise _LostActor from None

    def kill(self) -> None:
        try:
            self._ask("kill")
        except _LostActor:
            pass

    def gone(self, start_ticks: int) -> bool:
        try:
            return bool(self._ask("gone", start_ticks))
        except _LostActor:
            return True

    def exit_fd(self) -> int:
        """A pipe's read end written once the actor's wait for the worker's exit returns (or the
        actor is lost)."""
        read_end, write_end = os.pipe()
        future = self._actor.wait.remote(None).future()

        def exited(_: Any) -> None:
            try:
                os.write(write_end, b"x")
            except OSError:  # the watcher closed its end first: no one is waiting
                pass
            finally:
                os.close(write_end)

        future.add_done_callback(exited)
        return read_end

    def log_tail(self) -> str:
        try:
            return str(self._ask("log_tail"))
        except _LostActor:
            return f"; its host actor on node {self._node} was lost (the node or the actor died)"

    def remove_files(self) -> None:
        """Remove the worker's folder on its node, then end its host actor."""
        import ray

        try:
            self._ask("remove_files")
        except _LostActor:
            return
        ray.kill(self._actor)


class _LostActor(Exception):
    """The host actor is unreachable."""


class RayCluster:
    """The plan's graph stages placed on a Ray cluster: `reserve` the whole plan's placement groups,
    then `start_worker` per replica; `close` removes them (and stops a Ray started here)."""

    def __init__(self, address: str | None) -> None:
        try:
            import ray
        except ImportError:
            raise ClusterUnavailable("distributed_executor_backend: ray needs Ray: install omnigraph[ray]") from None
        self._ray = ray
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            try:
                ray.init(address=address or os.environ.get("RAY_ADDRESS") or None, log_to_driver=False,
                         logging_level=logging.WARNING)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ClusterUnavailable(f"cannot reach the Ray cluster at {address or 'RAY_ADDRESS'}: {exc}") from None
        self._groups: dict[int, Any] = {}
        self._bundles: dict[int, dict[str, float]] = {}
        self._host_class: Any = ray.remote(WorkerHost)  # an actor class (typed loosely by Ray)
        # the address this node's workers and the others reach the controller by, and its node id
        # (where what runs in this process, a native stage, is charged)
        self.controller_host = ray.util.get_node_ip_address()
        self.controller_node = str(ray.get_runtime_context().get_node_id())

    def reserve(self, stages: Sequence[StagePlacement], timeout: float) -> None:
        """One placement group per stage, all placed within `timeout` s, or none kept
        (ClusterUnavailable naming the stage and what it lacks)."""
        from ray.util.placement_group import placement_group

        for stage in stages:
            _check_fits(stage, self._ray.nodes())
        try:
            for stage in stages:
                bundle = self._bundles[stage.stage_id] = stage.bundle()
                self._groups[stage.stage_id] = placement_group(
                    [bundle] * stage.replicas, strategy=stage.placement.strategy,
                    name=f"omnigraph-stage{stage.stage_id}-{os.getpid()}")
            deadline = time.monotonic() + timeout
            for stage_id, group in self._groups.items():
                if not group.wait(max(deadline - time.monotonic(), 0.0)):
                    raise ClusterUnavailable(f"stage {stage_id}: its placement group was not placed within "
                                             f"{timeout:g} s (the resources it asks for are held by other work)")
        except BaseException:
            self.close()
            raise

    def bundle_node(self, stage_id: int, replica: int, timeout: float) -> str:
        """The node Ray placed replica `replica`'s bundle on; after a node loss, once Ray placed it
        again (WorkerStartFailed if it is not within `timeout` s: no survivor has room yet)."""
        from ray.util import placement_group_table

        deadline = time.monotonic() + timeout
        while not (node := placement_group_table(self._groups[stage_id])["bundles_to_node_id"].get(replica)):
            if time.monotonic() >= deadline:
                raise WorkerStartFailed(f"stage {stage_id} replica {replica}'s bundle {self._bundles[stage_id]} "
                                        f"is on no node: no surviving node had room within {timeout:g} s")
            time.sleep(BUNDLE_POLL_S)
        return str(node)

    def start_worker(self, stage_id: int, replica: int, route: WorkerRoute, node: str, *, generation: int,
                     startup_timeout: float) -> WorkerClient:
        """Start replica `replica`'s worker in its placement-group bundle, which is on `node` (where
        its reservation is charged), and return its client (its hello checked); WorkerStartFailed
        if it does not start, connect and say hello in time, or lands elsewhere (the bundle moved)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        deadline = time.monotonic() + startup_timeout
        bundle = self._bundles[stage_id]
        listener = socket.create_server((self.controller_host, 0))
        actor = None
        try:
            host, port = listener.getsockname()[:2]
            token = new_worker_token()
            actor = self._host_class.options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), memory=bundle.get("memory"),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._groups[stage_id], replica),
                max_restarts=0, name=None).remote()
            command = [route.interpreter, "-m", WORKER_MODULE, "--connect", f"{TCP_PREFIX}{host}:{port}",
                       "--generation", str(generation), "--route", route.to_json()]
            try:
                pid, started_on = self._ray.get(actor.start.remote(command, {**route.env, WORKER_TOKEN_ENV: token}),
                                          timeout=max(deadline - time.monotonic(), 1e-3))
            except self._ray.exceptions.GetTimeoutError:
                raise WorkerStartFailed(f"no node took stage {stage_id} replica {replica}'s bundle {bundle} "
                                        f"within {startup_timeout:g} s") from None
            if started_on != node:
                raise WorkerStartFailed(f"stage {stage_id} replica {replica}'s bundle moved from node {node} to "
                                        f"{started_on} while its worker started")
            process = RayWorkerProcess(actor, pid, node)
            sock = accept_tcp_worker(listener, token, process, deadline)
            return WorkerClient.attach(route, generation=generation, process=process, sock=sock,
                                       startup_timeout=max(deadline - time.monotonic(), 1e-3))
        except BaseException:
            if actor is not None:
                self._ray.kill(actor)
            raise
        finally:
            listener.close()

    def close(self) -> None:
        """Remove the placement groups (their actors end with them); stop Ray if this started it."""
        from ray.util.placement_group import remove_placement_group

        for group in self._groups.values():
            try:
                remove_placement_group(group)
            except Exception:  # the cluster is going away already
                pass
        self._groups.clear()
        self._bundles.clear()
        if self._started_ray and self._ray.is_initialized():
            self._ray.shutdown()


@dataclass(frozen=True)
class StagePlacement:
    """What one graph stage asks of the cluster: `replicas` bundles as its `placement` says, each
    with the replica's ledger demand on RAM as Ray's `memory` and, where the placement names the
    cluster's GPU-memory resource, its demand on GPU memory as that."""

    stage_id: int
    replicas: int
    placement: PlacementConfig
    demands: Mapping[str, int]

    def bundle(self) -> dict[str, float]:
        """One replica's Ray placement-group bundle."""
        bundle = self.placement.bundle()
        if ram := self.demands.get(RAM_DEMAND, 0):
            bundle["memory"] = float(ram)
        vram = sum(amount for name, amount in self.demands.items() if name.startswith(VRAM_DEMAND_PREFIX))
        if self.placement.gpu_memory_resource is not None and vram:
            bundle[self.placement.gpu_memory_resource] = float(vram)
        return bundle


def _check_fits(stage: StagePlacement, nodes: list[dict[str, Any]]) -> None:
    """Refuse a stage whose bundles no set of the cluster's nodes could hold (their totals, not
    what is free now), naming the resource."""
    stage_id, replicas, placement, bundle = stage.stage_id, stage.replicas, stage.placement, stage.bundle()
    alive = [node.get("Resources", {}) for node in nodes if node.get("Alive")]
    for name, amount in bundle.items():
        most = max((totals.get(name, 0.0) for totals in alive), default=0.0)
        if most < amount:
            where = f"no node has {name} {amount:g}" + (f" (the most is {most:g})" if most else "")
            raise ClusterUnavailable(f"stage {stage_id}: a replica's bundle {bundle} cannot be placed: {where}")
    holders = sum(all(totals.get(name, 0.0) >= amount for name, amount in bundle.items()) for totals in alive)
    if placement.strategy == "STRICT_SPREAD" and holders < replicas:
        raise ClusterUnavailable(f"stage {stage_id}: STRICT_SPREAD puts {replicas} replicas on {replicas} nodes, "
                                 f"and {holders} node(s) can hold the bundle {bundle}")
    if placement.strategy == "STRICT_PACK":
        for name, amount in bundle.items():
            most = max((totals.get(name, 0.0) for totals in alive), default=0.0)
            if most < amount * replicas:
                raise ClusterUnavailable(f"stage {stage_id}: STRICT_PACK puts {replicas} replicas on one node, "
                                         f"which needs {name} {amount * replicas:g}; the most a node has is {most:g}")
    room = sum(int(min(totals.get(name, 0.0) // amount for name, amount in bundle.items())) for totals in alive)
    if room < replicas:
        raise ClusterUnavailable(f"stage {stage_id}: its {replicas} replicas' bundles {bundle} do not fit the cluster: "
                                 f"its nodes could hold {room} of them")


def cluster_for(deploy: DeployConfig) -> RayCluster | None:
    """The plan's Ray cluster, or None for a local plan."""
    return RayCluster(deploy.ray_address) if deploy.distributed_executor_backend == "ray" else None


__all__ = ["ClusterUnavailable", "RayCluster", "RayWorkerProcess", "StagePlacement", "WorkerHost", "cluster_for"]
