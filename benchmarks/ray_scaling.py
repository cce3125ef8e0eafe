"""Graph-stage replicas on a Ray cluster against local ones (issue 22), side by side in one run.

    python benchmarks/ray_scaling.py [--json PATH] [--seconds 6] [--quick]

One local Ray test cluster (`ray.cluster_utils.Cluster`): a head node and three simulated nodes on
127.0.0.1 (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), node i holding the custom resource `sim_node_i`.
Three cases:

- **scaling**: a compute-bound one-stage plan (a chain of MATMULS 512 x 512 MatMul + Relu on a
  64 x 512 request, one ORT thread per replica, batching off) with 1, 2 and 3 replicas, local
  (children of this process) and on Ray (replica i pinned to node i); CLIENTS_PER_REPLICA closed-loop
  clients per replica. Rows: requests/s, its ratio to the same backend's 1 replica, and Ray's
  ratio to local at the same count. The simulated nodes share this machine's cores: past its core
  count, more replicas cannot add throughput on either backend.
- **latency**: batch 1 (a 4 x 4 request through the two-stage example's chain) through a local and
  a Ray plan, one replica per stage, in alternating blocks: the median time added by the Ray path
  and the ratio.
- **transport**: the same identity call with 4 KB, 1 MB and 16 MB tensors to a worker on another
  node: omnigraph's wire over TCP (a WorkerClient started by RayCluster) against a Ray actor on
  that node holding the same ONNX session (arguments and result through Ray's object store), in
  alternating blocks. This is the measurement behind sending tensors over the wire.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every node on 127.0.0.1

import numpy as np
import onnx
import onnx.helper as oh
import ray
import yaml
from onnx import numpy_helper
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

try:
    from benchmarks import laya_gpu as harness
    from benchmarks.throughput import closed_loop
    from benchmarks.wire import identity_bundle, interleaved_timings_us
except ImportError:  # run as a script: this folder is sys.path[0]
    import laya_gpu as harness
    from throughput import closed_loop
    from wire import identity_bundle, interleaved_timings_us

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import two_stage_graph
from ray_cluster import start_local_cluster

from omnigraph import AsyncOmni, Omni
from omnigraph.bundles import pack_bundle
from omnigraph.pipelines.deploy import PlacementConfig, validate_deploy_config
from omnigraph.stages.ray_cluster import RayCluster, StagePlacement
from omnigraph.workers.route import WorkerRoute

SIM_NODES = 3
REPLICAS = (1, 2, 3)
CLIENTS_PER_REPLICA = 2  # one request queued behind each running one: a replica never waits for work
MATMULS, WIDTH, ROWS = 8, 512, 64  # ~270 MFLOP a request: tens of ms on one core, far above any transport
TRANSPORT_BYTES = (4 << 10, 1 << 20, 16 << 20)
LATENCY_ITERATIONS, TRANSPORT_ITERATIONS = 2000, 400
QUICK_DIVISOR = 10
RAM = "machine:ram"
LOCAL_ROUTE = {"name": "local-cpu", "ep": "cpu", "intra_op_num_threads": 1}


def matmul_chain_bundle(folder: Path) -> Path:
    """MATMULS x (MatMul by a fixed WIDTH x WIDTH matrix, Relu): CPU-bound work per request."""
    rng = np.random.default_rng(0)
    nodes, initializers, name = [], [], "x"
    for layer in range(MATMULS):
        weight = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
        initializers.append(numpy_helper.from_array(weight, f"w{layer}"))
        nodes += [oh.make_node("MatMul", [name, f"w{layer}"], [f"m{layer}"]),
                  oh.make_node("Relu", [f"m{layer}"], [f"y{layer}" if layer < MATMULS - 1 else "y"])]
        name = f"y{layer}"
    graph = oh.make_graph(nodes, "matmul_chain",
                          [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", WIDTH])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", WIDTH])],
                          initializer=initializers)
    folder.mkdir(parents=True)
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=10), folder / "graph.onnx")
    np.savez(folder / "inputs.npz", x=np.ones((2, WIDTH), np.float32))
    pack_bundle(folder, component="bench.matmul_chain", example_inputs_file="inputs.npz")
    return folder


def one_stage_plan(bundle: Path, replicas: int, backend: str) -> dict[str, Any]:
    """The chain as one final stage; on Ray, replica i's bundle asks for `sim_node_i`'s node by
    STRICT_SPREAD over nodes that all hold `sim_node`."""
    stage: dict[str, Any] = {
        "stage_id": 0, "model_stage": "chain", "final_output": True, "final_output_type": "tensors",
        "num_replicas": replicas, "batching": {"max_batch_rows": 1},
        "backend": {"name": "external.graph.v1", "manifest": str(bundle), "route": LOCAL_ROUTE},
        "resource_budget": {"capacities": {RAM: 4 << 30}, "demands": {RAM: 256 << 20}},
    }
    plan: dict[str, Any] = {"pipeline": "ray_scaling", "max_queued_requests": 64, "stages": [stage]}
    if backend == "ray":
        plan["distributed_executor_backend"] = "ray"
        stage["placement"] = {"strategy": "STRICT_SPREAD", "num_cpus": 1, "resources": {"sim_node": 1}}
    return plan


class Rows:
    """The run's rows, each with the machine's identity, rewritten to --json after each case."""

    def __init__(self, json_path: Path | None, argv: list[str]) -> None:
        self.json_path = json_path
        self.rows: list[dict[str, Any]] = []
        self.identity = {"cpu": harness.cpu_name(), "cores": os.cpu_count(), "load_average_1m": os.getloadavg()[0],
                         "ray": ray.__version__, "versions": harness._versions(),
                         "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         "command": " ".join(["benchmarks/ray_scaling.py", *argv])}

    def add(self, case: str, metric: str, value: Any, unit: str, **fields: Any) -> None:
        self.rows.append({"case": case, "metric": metric, "value": value, "unit": unit, **fields, **self.identity})
        print(f"{case:<44} {metric:<28} {value:>12} {unit}", flush=True)

    def write(self) -> None:
        if self.json_path is not None:
            harness.write_json(self.json_path, self.rows)


def case_scaling(rows: Rows, bundle: Path, seconds: float) -> None:
    request = {"tensors": {"x": np.random.default_rng(1).standard_normal((ROWS, WIDTH)).astype(np.float32)}}

    async def measure(replicas: int, backend: str) -> float:
        async with AsyncOmni(deploy_config=validate_deploy_config(one_stage_plan(bundle, replicas, backend))) as omni:
            async def call() -> None:
                async for output in omni.generate(request):
                    assert output.error is None, output.error

            load = await closed_loop(call, CLIENTS_PER_REPLICA * replicas, seconds, warmup_s=1.0)
            return len(load.latencies) / load.seconds

    throughput: dict[tuple[str, int], float] = {}
    for replicas in REPLICAS:
        for backend in ("local", "ray"):
            throughput[backend, replicas] = per_s = asyncio.run(measure(replicas, backend))
            rows.add(f"scaling {backend}, {replicas} replica(s)", "requests_per_s", round(per_s, 1), "1/s",
                     backend=backend, replicas=replicas)
            rows.add(f"scaling {backend}, {replicas} replica(s)", "x_one_replica",
                     round(per_s / throughput[backend, 1], 2), "ratio", backend=backend, replicas=replicas)
        rows.add(f"scaling ray / local, {replicas} replica(s)", "ray_over_local",
                 round(throughput["ray", replicas] / throughput["local", replicas], 3), "ratio", replicas=replicas)
        rows.write()


def case_latency(rows: Rows, plans: dict[str, Path], iterations: int) -> None:
    x = np.arange(16, dtype=np.float32).reshape(4, 4) % 5 - 2
    with Omni(deploy_config=plans["local"]) as local, Omni(deploy_config=plans["ray"]) as placed:
        expected = local.generate([{"tensors": {"x": x}}])[0].custom_output["scores"]
        assert np.array_equal(placed.generate([{"tensors": {"x": x}}])[0].custom_output["scores"], expected)
        timings = interleaved_timings_us({backend: lambda omni=omni: omni.generate([{"tensors": {"x": x}}])
                                          for backend, omni in (("local", local), ("ray", placed))}, iterations)
    medians = {backend: float(np.median(samples)) for backend, samples in timings.items()}
    for backend, samples in timings.items():
        rows.add(f"latency batch 1, two stages, {backend}", "p50_us", round(medians[backend], 1), "us",
                 backend=backend, p90_us=round(float(np.percentile(samples, 90)), 1), samples=len(samples))
    rows.add("latency batch 1, two stages", "ray_added_p50_us", round(medians["ray"] - medians["local"], 1), "us")
    rows.add("latency batch 1, two stages", "ray_over_local_p50", round(medians["ray"] / medians["local"], 3), "ratio")
    rows.write()


@ray.remote
class SessionActor:
    """The identity graph's ONNX session in a Ray actor: calls carry tensors through Ray."""

    def __init__(self, graph: str) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])

    def run(self, x: np.ndarray) -> np.ndarray:
        return self.session.run(None, {"x": x})[0]


def case_transport(rows: Rows, scratch: Path, iterations: int) -> None:
    bundle = identity_bundle(scratch / "identity")
    cluster = RayCluster(None)  # this driver's Ray: not stopped by close()
    cluster.reserve([StagePlacement(0, 1, PlacementConfig(num_cpus=1, resources={"sim_node_1": 1}), {})],
                    timeout=60)
    node = cluster.bundle_node(0, 0, timeout=60)
    route = WorkerRoute(name="bench-tcp", interpreter=sys.executable, intra_op_num_threads=1,
                        max_io_bytes=2 * max(TRANSPORT_BYTES))
    client = cluster.start_worker(0, 0, route, node, generation=1, startup_timeout=60)
    actor = SessionActor.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                                 ).remote(str(scratch / "identity" / "graph.onnx"))
    try:
        client.load(bundle.manifest_path)
        for nbytes in TRANSPORT_BYTES:
            x = np.random.default_rng(nbytes).standard_normal(nbytes // 4).astype(np.float32)
            feed = {"x": x}
            assert np.array_equal(client.run(feed, request_id="check", stage_id=0, epoch=0)["y"], x)
            assert np.array_equal(ray.get(actor.run.remote(x)), x)
            count = iterations if nbytes <= (1 << 20) else max(20, iterations // 8)  # 16 MB: ms per call
            timings = interleaved_timings_us({
                "wire over TCP": lambda feed=feed: client.run(feed, request_id="bench", stage_id=0, epoch=0),
                "Ray actor call (object store)": lambda x=x: ray.get(actor.run.remote(x)),
            }, count)
            medians = {path: float(np.median(samples)) for path, samples in timings.items()}
            for path, median in medians.items():
                rows.add(f"transport {nbytes >> 10} KB round trip, {path}", "p50_us", round(median, 1), "us",
                         bytes=nbytes, path=path, samples=len(timings[path]))
            rows.add(f"transport {nbytes >> 10} KB", "object_store_over_wire_p50",
                     round(medians["Ray actor call (object store)"] / medians["wire over TCP"], 3), "ratio",
                     bytes=nbytes)
            rows.write()
    finally:
        ray.kill(actor)
        client.kill()
        client.wait_exit(10)
        client.close()
        client.process.remove_files()
        cluster.close()


def two_stage_plans(scratch: Path) -> dict[str, Path]:
    """The two-stage example on the local backend and on Ray (stage 0 on sim node 1, stage 1 on
    sim node 2)."""
    local = two_stage_graph.prepare(scratch / "two-stage")
    data = yaml.safe_load(local.read_text())
    data["distributed_executor_backend"] = "ray"
    for stage, node in zip(data["stages"], ("sim_node_1", "sim_node_2")):
        stage["placement"] = {"num_cpus": 1, "resources": {node: 1}}
    placed = local.with_name("two_stage_ray.yaml")
    placed.write_text(yaml.safe_dump(data))
    return {"local": local, "ray": placed}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds per scaling point")
    parser.add_argument("--quick", action="store_true", help="a tenth of the samples (a smoke run)")
    args = parser.parse_args(argv)
    divisor = QUICK_DIVISOR if args.quick else 1
    cluster = start_local_cluster({"head_node": 1}, [{"sim_node": 1, f"sim_node_{index}": 1}
                                                     for index in range(1, SIM_NODES + 1)])
    rows = Rows(args.json, argv)
    try:
        with tempfile.TemporaryDirectory(prefix="ray-scaling-") as folder:
            scratch = Path(folder)
            case_transport(rows, scratch, TRANSPORT_ITERATIONS // divisor)
            case_latency(rows, two_stage_plans(scratch), LATENCY_ITERATIONS // divisor)
            case_scaling(rows, matmul_chain_bundle(scratch / "chain"), args.seconds / (2 if args.quick else 1))
    finally:
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
