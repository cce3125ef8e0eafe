"""Fixtures for the worker tests: tiny ONNX graphs packed into real bundles, and CPU routes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

from omnigraph.bundles import VerifiedBundle, pack_bundle
from omnigraph.workers.client import WorkerClient
from omnigraph.workers.route import WorkerRoute

OPSET = [oh.make_opsetid("", 17)]
# IR 10: what every onnxruntime since 1.16 reads (onnx 1.23 would write 14, too new for ORT 1.31).
IR_VERSION = 10


def _has_cuda() -> bool:
    return "CUDAExecutionProvider" in ort.get_available_providers()


requires_cuda = pytest.mark.skipif(not _has_cuda(), reason="needs onnxruntime-gpu with a CUDA device")


def affine_graph() -> onnx.ModelProto:
    """y = relu(x) * 2 - 1 (float32 [n, k]); z = argmax-like int64 sum of ids; two inputs, two outputs."""
    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", "k"])
    ids = oh.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["n", 3])
    y = oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", "k"])
    z = oh.make_tensor_value_info("z", onnx.TensorProto.INT64, ["n"])
    two = oh.make_tensor("two", onnx.TensorProto.FLOAT, [], [2.0])
    one = oh.make_tensor("one", onnx.TensorProto.FLOAT, [], [1.0])
    axes = oh.make_tensor("axes", onnx.TensorProto.INT64, [1], [1])
    nodes = [
        oh.make_node("Relu", ["x"], ["r"], name="relu"),
        oh.make_node("Mul", ["r", "two"], ["m"], name="double"),
        oh.make_node("Sub", ["m", "one"], ["y"], name="shift"),
        oh.make_node("ReduceSum", ["ids", "axes"], ["z"], name="sum_ids", keepdims=0),
    ]
    graph = oh.make_graph(nodes, "affine", [x, ids], [y, z], initializer=[two, one, axes])
    return oh.make_model(graph, opset_imports=OPSET, ir_version=IR_VERSION)


def slow_graph(width: int = 1024, depth: int = 24) -> onnx.ModelProto:
    """A chain of ``depth`` [n, width] x [width, width] MatMuls: seconds per call at n = 4096."""
    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", width])
    y = oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", width])
    weight = np.full((width, width), 1.0 / width, np.float32)
    nodes, previous = [], "x"
    for i in range(depth):
        nodes.append(oh.make_node("MatMul", [previous, "w"], [f"h{i}"], name=f"matmul{i}"))
        previous = f"h{i}"
    nodes.append(oh.make_node("Identity", [previous], ["y"], name="out"))
    graph = oh.make_graph(nodes, "slow", [x], [y], initializer=[onnx.numpy_helper.from_array(weight, "w")])
    return oh.make_model(graph, opset_imports=OPSET, ir_version=IR_VERSION)


def pack_graph(folder: Path, model: onnx.ModelProto, example: dict[str, np.ndarray] | None) -> VerifiedBundle:
    folder.mkdir(parents=True)
    onnx.save(model, folder / "graph.onnx")
    if example is not None:
        np.savez(folder / "inputs.npz", **example)
    return pack_bundle(folder, component="test.graph", example_inputs_file="inputs.npz" if example is not None else None)


def affine_inputs(n: int, k: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((n, k)).astype(np.float32),
        "ids": rng.integers(0, 1000, size=(n, 3), dtype=np.int64),
    }


@pytest.fixture
def affine_bundle(tmp_path: Path) -> VerifiedBundle:
    return pack_graph(tmp_path / "affine", affine_graph(), affine_inputs(2, 4))


@pytest.fixture
def slow_bundle(tmp_path: Path) -> VerifiedBundle:
    return pack_graph(tmp_path / "slow", slow_graph(), {"x": np.ones((1, 1024), np.float32)})


@pytest.fixture
def cpu_route() -> WorkerRoute:
    return WorkerRoute(name="local-cpu", interpreter=sys.executable, ep="cpu", max_io_bytes=64 * 1024 * 1024, intra_op_num_threads=1)


@pytest.fixture
def start_worker(cpu_route: WorkerRoute) -> Callable[..., WorkerClient]:
    """Start workers that are closed (and checked gone) when the test ends."""
    clients: list[WorkerClient] = []

    def start(route: WorkerRoute = cpu_route, generation: int = 1) -> WorkerClient:
        client = WorkerClient.start(route, generation=generation, startup_timeout=60.0)
        clients.append(client)
        return client

    yield start
    for client in clients:
        client.close(timeout=5.0)
        assert client.wait_exit(5.0)
