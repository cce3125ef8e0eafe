"""The two-stage example's pipeline served across a local three-node Ray cluster.

    python examples/ray_cluster.py [--requests 200] [--out DIR]

Starts Ray's own test cluster (`ray.cluster_utils.Cluster`): a head node with the `head_node`
resource and two nodes with `feature_node`, every one on 127.0.0.1. Builds the two bundles
(two_stage_graph.py's), places ray_cluster.yaml beside them (stage 0's two replicas spread over
the feature nodes, stage 1 on the head), serves the same requests through the local plan and the
Ray plan with AsyncOmni, and prints one JSON line last:

    {"nodes_used": 3, "answers": 200, "lost": 0, "identical_to_local": true}

Exits 0 only if no answer was lost and every one equals the local backend's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every node on 127.0.0.1, never another address

import numpy as np
import ray
from ray.cluster_utils import Cluster
from two_stage_graph import make_inputs, prepare

from omnigraph import AsyncOmni

HERE = Path(__file__).resolve().parent
CLIENTS = 16  # concurrent clients, each sending its requests one after another (within the plans' queue bound)


def start_local_cluster(head: dict[str, float], nodes: Sequence[dict[str, float]]) -> Cluster:
    """Ray's test cluster on 127.0.0.1, joined by this driver: a head of 1 CPU with the custom
    resources `head`, and a node of 2 CPUs per entry of `nodes` (its custom resources). Also used by
    tests/stages/test_ray_cluster.py and benchmarks/ray_scaling.py."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": head})
    for resources in nodes:
        cluster.add_node(num_cpus=2, resources=resources)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    addresses = {node["NodeManagerAddress"] for node in ray.nodes()}
    if addresses != {"127.0.0.1"}:
        raise RuntimeError(f"a node is not on the loopback address: {sorted(addresses)}")
    return cluster


async def serve(plan: Path, inputs: list[np.ndarray]) -> tuple[dict[int, np.ndarray], set[str]]:
    """The requests from CLIENTS clients at once; the answers by index and the nodes the
    replicas ran on."""
    answers: dict[int, np.ndarray] = {}
    async with AsyncOmni(deploy_config=plan) as omni:
        nodes = {replica["node"] for stage in omni.execution_plan["stages"] for replica in stage["replicas"]}

        async def client(first: int) -> None:
            for index in range(first, len(inputs), CLIENTS):
                async for output in omni.generate({"tensors": {"x": inputs[index]}}, request_id=f"ray-{index}"):
                    if output.finished and output.error is None:
                        answers[index] = output.custom_output["scores"]

        await asyncio.gather(*(client(first) for first in range(CLIENTS)))
    return answers, nodes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="where to build the bundles (default: a temporary folder)")
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args(argv)
    inputs = make_inputs(args.requests)
    cluster = start_local_cluster({"head_node": 1}, [{"feature_node": 1}] * 2)
    try:
        with tempfile.TemporaryDirectory(prefix="ray-cluster-") as scratch:
            out = args.out or Path(scratch)
            local_plan = prepare(out)
            ray_plan = out / "ray_cluster.yaml"
            shutil.copyfile(HERE / "ray_cluster.yaml", ray_plan)
            local, _ = asyncio.run(serve(local_plan, inputs))
            placed, nodes = asyncio.run(serve(ray_plan, inputs))
    finally:
        ray.shutdown()
        cluster.shutdown()
    identical = sorted(placed) == sorted(local) and all(np.array_equal(placed[i], local[i]) for i in placed)
    summary = {"nodes_used": len(nodes), "answers": len(placed), "lost": len(inputs) - len(placed),
               "identical_to_local": identical}
    print(json.dumps(summary))
    return 0 if identical and summary["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
