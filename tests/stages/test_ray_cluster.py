"""Graph-stage replicas on a local three-node Ray cluster (`distributed_executor_backend: ray`).

The cluster is Ray's own test cluster (`ray.cluster_utils.Cluster`), every node on 127.0.0.1 with
its own custom resource (`node_a` on the head, `node_b`, `node_c`), so a plan pins a stage to a
node by asking for that resource; node_c also advertises 4 GiB of GPU memory as `gpu_mem`. The
pipeline is examples/two_stage_graph.py's: small integer weights, so every answer is exact and
compares equal to the local backend's.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every node on 127.0.0.1
ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from omnigraph import AsyncOmni, Omni  # noqa: E402
from omnigraph.stages.errors import (  # noqa: E402
    DeadlineExceeded,
    RequestCancelled,
    ReservationRefused,
    StageUnavailable,
)
from omnigraph.stages.ray_cluster import ClusterUnavailable  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]
GiB = 1 << 30
GPU_MEM = 4 * GiB  # node_c advertises this much GPU memory (bytes) as the custom resource gpu_mem

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import two_stage_graph as example  # noqa: E402
from ray_cluster import start_local_cluster  # noqa: E402

from ..plugin.conftest import REFUND_REQUEST, ServerProcess  # noqa: E402
from ..reliability.plans import demo_plan  # noqa: E402


def _stop_cluster(cluster: Cluster) -> None:
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def cluster():
    cluster = start_local_cluster({"node_a": 1}, [{"node_b": 1}, {"node_c": 1, "gpu_mem": GPU_MEM}])
    yield cluster
    _stop_cluster(cluster)


@pytest.fixture(scope="module")
def local_plan(tmp_path_factory) -> Path:
    return example.prepare(tmp_path_factory.mktemp("two-stage"))


def _ray_plan(local_plan: Path, name: str, placements: list[dict], *, replicas: list[int] | None = None,
              ram_demand: int | None = None) -> Path:
    """The example plan on the Ray backend, each stage placed as `placements` says (stage 0's
    replicas each demanding `ram_demand` bytes of its machine's RAM, if given)."""
    data = yaml.safe_load(local_plan.read_text())
    data["distributed_executor_backend"] = "ray"
    for index, (stage, placement) in enumerate(zip(data["stages"], placements)):
        stage["placement"] = placement
        if replicas is not None:
            stage["num_replicas"] = replicas[index]
    if ram_demand is not None:
        data["stages"][0]["resource_budget"]["demands"]["machine:ram"] = ram_demand
    plan = local_plan.with_name(f"{name}.yaml")
    plan.write_text(yaml.safe_dump(data))
    return plan


def _node_with(resource: str) -> str:
    [node] = [node["NodeID"] for node in ray.nodes() if node["Alive"] and resource in node["Resources"]]
    return node


def _nodes_of(omni: Omni | AsyncOmni) -> dict[int, list[str]]:
    return {stage_id: [replica.client.process.node for replica in stage.replicas if replica.serving]
            for stage_id, stage in omni.runtime.stages.items()}


def test_every_node_of_the_test_cluster_is_on_the_loopback_address(cluster):
    assert [node["NodeManagerAddress"] for node in ray.nodes()] == ["127.0.0.1"] * 3


def test_two_stages_on_two_nodes_answer_as_the_local_backend_does(cluster, local_plan):
    plan = _ray_plan(local_plan, "spread", [{"resources": {"node_b": 1}}, {"resources": {"node_c": 1}}])
    inputs = example.make_inputs(24)
    prompts = [{"tensors": {"x": x}} for x in inputs]
    with Omni(deploy_config=local_plan) as omni:
        local = [output.custom_output["scores"] for output in omni.generate(prompts)]
    with Omni(deploy_config=plan) as omni:
        assert _nodes_of(omni) == {0: [_node_with("node_b")], 1: [_node_with("node_c")]}
        placed = [output.custom_output["scores"] for output in omni.generate(prompts)]
        assert not omni.health()
    for x, here, there in zip(inputs, local, placed):
        np.testing.assert_array_equal(there, here)
        np.testing.assert_array_equal(there, example.reference(x))
    assert _live_placement_groups() == []  # the plan's groups went with its shutdown


@pytest.mark.parametrize(("placement", "message"), [
    ({"resources": {"node_z": 1}},
     r"stage 1: a replica's bundle .*'node_z': 1\.0.* cannot be placed: no node has node_z 1"),
    ({"num_cpus": 8}, r"stage 1: .* cannot be placed: no node has CPU 8 \(the most is 2\)"),
    ({"resources": {"node_b": 1}, "strategy": "STRICT_SPREAD"},
     r"stage 1: STRICT_SPREAD puts 2 replicas on 2 nodes, and 1 node\(s\) can hold the bundle"),
])
def test_a_plan_the_cluster_cannot_hold_is_refused_before_any_worker_starts(cluster, local_plan, placement,
                                                                             message):
    plan = _ray_plan(local_plan, "too-big", [{"resources": {"node_b": 1}}, placement], replicas=[1, 2])
    assert _all_free()
    with pytest.raises(ClusterUnavailable, match=message):
        Omni(deploy_config=plan)
    assert _live_placement_groups() == [] and _all_free()  # nothing held, nothing started


def test_the_ledger_charges_each_replica_to_the_node_ray_placed_it_on(cluster, local_plan):
    """The example's machines have 2 GiB of RAM each (its ledger capacity): two replicas of
    1.5 GiB do not fit on one node, and do on two, each charged to its own."""
    packed = _ray_plan(local_plan, "packed", [{"resources": {"node_b": 0.5}}, {"resources": {"node_a": 1}}],
                       replicas=[2, 1], ram_demand=3 << 29)
    assert _all_free()
    refusal = rf"stage0/replica0 \+ stage0/replica1: .*machine:ram@{_node_with('node_b')}"
    with pytest.raises(ReservationRefused, match=refusal):
        Omni(deploy_config=packed)
    assert _live_placement_groups() == [] and _all_free()

    spread = _ray_plan(local_plan, "spread-wide", [{"num_cpus": 2, "strategy": "STRICT_SPREAD"},
                                                   {"resources": {"node_a": 1}}], replicas=[2, 1], ram_demand=3 << 29)
    with Omni(deploy_config=spread) as omni:
        nodes = sorted(_nodes_of(omni)[0])
        assert nodes == sorted([_node_with("node_b"), _node_with("node_c")])
        ledger = omni.runtime.ledger.snapshot()["constraints"]
        for node in nodes:
            assert ledger[f"machine:ram@{node}"]["held"] == 3 << 29
        assert ledger[f"machine:ram@{_node_with('node_a')}"]["held"] == 256 << 20
        assert ledger["machine:ram"]["held"] == 0  # nothing runs on "this machine" as such
        assert len(omni.generate([{"tensors": {"x": x}} for x in example.make_inputs(4)])) == 4


def test_a_call_cancelled_on_a_remote_worker_is_fenced_and_the_worker_serves_on(cluster, make_plan, engine):
    """As locally (test_orchestrator.py): the abort reaches the worker on node_b over the wire."""
    medium = {"tensors": {"x": np.zeros((384, 384), np.float32)}}  # a call of about half a second
    small = {"tensors": {"x": np.ones((4, 4), np.float32)}}

    async def main():
        plan = make_plan("slow", capacity=1000, demand=300, restart={"max_restarts": 0},
                         placement={"resources": {"node_b": 1}})
        async with AsyncOmni(deploy_config=plan) as omni:
            assert _nodes_of(omni) == {0: [_node_with("node_b")]}
            task = asyncio.create_task(engine.first(omni, medium, "doomed"))
            await engine.until_in_flight(omni, "doomed")
            (before,) = engine.replicas(omni)
            await omni.abort("doomed")
            with pytest.raises(RequestCancelled, match="doomed was aborted"):
                await task
            answer = await engine.first(omni, small, "later")  # the same worker, after the fenced call
            (after,) = engine.replicas(omni)
            return before, after, answer, omni.health()

    before, after, answer, health = asyncio.run(main())
    assert answer.custom_output["h200"].shape == (4, 4) and health == {}
    assert (after["pid"], after["node"], after["state"]) == (before["pid"], before["node"], "serving")
    assert after["fenced_calls"] == 1 and after["epoch"] == 1


def test_the_fault_model_holds_for_a_remote_worker(cluster, make_plan, engine):
    """As locally (test_orchestrator.py, test_restarts.py), for a worker on node_b: a deadline
    passed inside a call fences it and the worker serves on; a worker killed mid-call fails its
    request with a retryable 503 and a new generation is started on the same node, its charge
    there held again and nothing quarantined."""
    big = {"tensors": {"x": np.zeros((1024, 1024), np.float32)}}  # a call that runs for many seconds
    small = {"tensors": {"x": np.ones((4, 4), np.float32)}}
    node_b = _node_with("node_b")

    async def main():
        plan = make_plan("slow", capacity=1000, demand=300, placement={"resources": {"node_b": 1}})
        async with AsyncOmni(deploy_config=plan) as omni:
            (first,) = engine.replicas(omni)
            os.kill(first["pid"], signal.SIGSTOP)  # the nodes share this machine: its pid is ours to signal
            try:
                with pytest.raises(DeadlineExceeded, match="deadline passed inside stage 0"):
                    await engine.first(omni, small, "late", deadline_s=2.0)
                await engine.until(lambda: engine.replicas(omni)[0]["fenced_calls"] == 1, "the call fenced")
            finally:
                os.kill(first["pid"], signal.SIGCONT)
            assert (await engine.first(omni, small, "after")).custom_output["h200"].shape == (4, 4)
            assert engine.replicas(omni)[0]["pid"] == first["pid"]

            task = asyncio.create_task(engine.first(omni, big, "doomed"))
            await engine.until_in_flight(omni, "doomed")
            os.kill(first["pid"], signal.SIGKILL)
            with pytest.raises(StageUnavailable, match="WorkerDied") as died:
                await task
            assert died.value.retry_after is not None
            await engine.until_serving(omni, generation=first["generation"] + 1)
            answer = await engine.first(omni, small, "after-replacement")
            return first, engine.replicas(omni)[0], answer, omni.ledger_snapshot()

    first, second, answer, ledger = asyncio.run(main())
    assert answer.custom_output["h200"].shape == (4, 4)
    assert (second["node"], second["restarts"]) == (node_b, 1) and second["pid"] != first["pid"]
    assert ledger["constraints"][f"machine:ram@{node_b}"] == {"capacity": 1000, "held": 300, "quarantined": 0,
                                                             "free": 700}
    assert [(r["owner"], r["state"], r["node"]) for r in ledger["reservations"]] == [
        ("stage0/replica0", "held", node_b)]


@pytest.mark.parametrize("replicas", [1, 2])
def test_gpu_memory_is_asked_of_ray_where_the_cluster_advertises_it(cluster, local_plan, replicas):
    """A replica demanding 3 GiB of `machine:vram:0` on a cluster whose GPU memory is the custom
    resource gpu_mem: one lands on the one node that has it, two are refused before anything starts."""
    data = yaml.safe_load(_ray_plan(local_plan, "vram", [{"resources": {"node_a": 1}},
                                                         {"num_cpus": 1, "gpu_memory_resource": "gpu_mem"}],
                                    replicas=[1, replicas]).read_text())
    data["stages"][1]["resource_budget"] = {"capacities": {"machine:ram": 2 * GiB, "machine:vram:0": 8 * GiB},
                                            "demands": {"machine:ram": 256 << 20, "machine:vram:0": 3 * GiB}}
    plan = local_plan.with_name("vram.yaml")
    plan.write_text(yaml.safe_dump(data))
    assert _all_free()
    if replicas == 2:
        with pytest.raises(ClusterUnavailable, match=r"stage 1: its 2 replicas' bundles .*'gpu_mem': 3221225472\.0.* "
                                                     r"do not fit the cluster: its nodes could hold 1 of them"):
            Omni(deploy_config=plan)
        assert _live_placement_groups() == [] and _all_free()
        return
    with Omni(deploy_config=plan) as omni:
        node_c = _node_with("node_c")
        assert _nodes_of(omni)[1] == [node_c]
        assert omni.runtime.ledger.snapshot()["constraints"][f"machine:vram:0@{node_c}"]["held"] == 3 * GiB
        assert ray.available_resources().get("gpu_mem") == GPU_MEM - 3 * GiB  # Ray holds it for the replica too


def test_omnigraph_serve_places_its_stage_on_the_cluster_ray_address_names(cluster, tmp_path):
    """The README's way: `RAY_ADDRESS=... omnigraph serve --deploy-config PLAN` with the demo Laya
    bundle's replica on node_c answers over HTTP, and leaves no placement group behind."""
    plan = demo_plan(tmp_path)
    data = yaml.safe_load(plan.read_text())
    data["distributed_executor_backend"] = "ray"
    data["stages"][0]["placement"] = {"num_cpus": 1, "resources": {"node_c": 1}}
    plan.write_text(yaml.safe_dump(data))
    server = ServerProcess(["--deploy-config", str(plan)], {"RAY_ADDRESS": cluster.address,
                                                              "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
                           tmp_path / "server.log")
    try:
        server.wait_ready()
        answer = httpx.post(f"{server.url}/v1/systemone", json=REFUND_REQUEST, timeout=60)
        assert answer.status_code == 200, answer.text
        assert 0.0 <= answer.json()["answers"]["refund"]["noul"] <= 1.0
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
        assert len(_live_placement_groups()) == 1
        log = (tmp_path / "server.log").read_text()
        assert f"node {_node_with('node_c')}" in log  # the placement line names the node
    finally:
        server.stop()
    assert _live_placement_groups() == [] and _all_free()


def _all_free(timeout: float = 10.0) -> bool:
    """Whether every node's resources are free again within `timeout` s (Ray returns a removed
    placement group's resources asynchronously; nothing else runs on this cluster)."""
    deadline = time.monotonic() + timeout
    while True:
        total, free = ray.cluster_resources(), ray.available_resources()
        if all(free.get(name) == amount for name, amount in total.items() if name != "object_store_memory"):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _live_placement_groups() -> list[str]:
    return [group["name"] for group in ray.util.placement_group_table().values() if group["state"] != "REMOVED"]


def test_a_node_lost_under_load_loses_no_answer_and_its_replica_is_replaced_on_a_survivor(cluster, local_plan):
    """Two nodes join with room for stage 0's replicas (`replica_room`: 2 on node_d, 1 on node_e);
    node_e is removed while 8 clients keep requests in flight (the module's last test)."""
    cluster.add_node(num_cpus=2, resources={"node_d": 1, "replica_room": 2})
    cluster.add_node(num_cpus=2, resources={"node_e": 1, "replica_room": 1})
    cluster.wait_for_nodes()
    plan = _ray_plan(local_plan, "lossy", [{"resources": {"replica_room": 1}, "strategy": "SPREAD"},
                                           {"resources": {"node_a": 1}}], replicas=[2, 1])
    asyncio.run(_serve_through_a_node_loss(cluster, plan))


async def _serve_through_a_node_loss(cluster: Cluster, plan: Path) -> None:
    node_d, node_e = _node_with("node_d"), _node_with("node_e")
    inputs = example.make_inputs(400)
    answers: dict[int, np.ndarray] = {}
    retries = 0
    async with AsyncOmni(deploy_config=plan) as omni:
        assert sorted(_nodes_of(omni)[0]) == sorted([node_d, node_e])

        async def client(first: int) -> None:
            nonlocal retries
            for index in range(first, len(inputs), 8):
                while True:
                    try:
                        async for output in omni.generate({"tensors": {"x": inputs[index]}}):
                            assert index not in answers, "an answer came twice"
                            answers[index] = output.custom_output["scores"]
                        break
                    except StageUnavailable as exc:  # a 503 with Retry-After: the client retries
                        assert exc.retry_after is not None
                        retries += 1
                        await asyncio.sleep(0.05)

        states: list[tuple[str, str | None]] = []

        async def watch_health() -> None:  # what /health reads, sampled through the loss
            while True:
                states.append(omni.runtime.stage_states()[0])
                await asyncio.sleep(0.01)

        clients = [asyncio.ensure_future(client(first)) for first in range(8)]
        while len(answers) < 40:
            await asyncio.sleep(0.01)
        watcher = asyncio.ensure_future(watch_health())
        [lost] = [node for node in cluster.worker_nodes if node.node_id == node_e]
        await asyncio.to_thread(cluster.remove_node, lost)
        await asyncio.gather(*clients)
        deadline = time.monotonic() + 120
        while sorted(_nodes_of(omni)[0]) != [node_d, node_d] and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        watcher.cancel()
        # the lost replica was replaced on the survivor (else: what each replica slot says)
        assert _nodes_of(omni)[0] == [node_d, node_d], omni.execution_plan["stages"][0]["replicas"]
        ledger = omni.runtime.ledger.snapshot()["constraints"]  # and charged there; the lost one released
        assert ledger[f"machine:ram@{node_d}"]["held"] == 2 * (256 << 20)
        assert (ledger[f"machine:ram@{node_e}"]["held"], ledger[f"machine:ram@{node_e}"]["quarantined"]) == (0, 0)
        assert omni.runtime.stage_states()[0] == ("ok", None) and not omni.health()
        # while it was being replaced, the stage said so (one replica serving)
        assert any(state == "degraded" and "1 of 2 replicas serve" in (why or "") for state, why in states), states
    assert sorted(answers) == list(range(len(inputs)))  # none lost
    for index, x in enumerate(inputs):
        np.testing.assert_array_equal(answers[index], example.reference(x))  # none wrong

