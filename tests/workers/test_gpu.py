"""CUDA routes on a real GPU: IOBinding calls, CUDA graphs per input shape, a true partial split."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

from omnigraph.workers.errors import PlacementRefused
from omnigraph.workers.route import WorkerRoute

from .conftest import IR_VERSION, OPSET, affine_inputs, pack_graph, requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]
CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"


def mlp_graph(width: int = 64) -> onnx.ModelProto:
    """x [n, width] -> relu(x @ w1 + b) @ w2: every node has a CUDA kernel."""
    rng = np.random.default_rng(0)
    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", width])
    y = oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", width])
    inits = [
        onnx.numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32) / 8, "w1"),
        onnx.numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), "b"),
        onnx.numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32) / 8, "w2"),
    ]
    nodes = [
        oh.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        oh.make_node("Add", ["h", "b"], ["hb"], name="bias"),
        oh.make_node("Relu", ["hb"], ["r"], name="relu"),
        oh.make_node("MatMul", ["r", "w2"], ["y"], name="mm2"),
    ]
    return oh.make_model(oh.make_graph(nodes, "mlp", [x], [y], initializer=inits), opset_imports=OPSET, ir_version=IR_VERSION)


def split_graph() -> onnx.ModelProto:
    """A MatMul (CUDA kernel) feeding Det, which has only a CPU kernel: a real partial split."""
    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 3, 3])
    d = oh.make_tensor_value_info("d", onnx.TensorProto.FLOAT, ["n"])
    w = onnx.numpy_helper.from_array(np.eye(3, dtype=np.float32) * 2, "w")
    nodes = [
        oh.make_node("MatMul", ["x", "w"], ["m"], name="scale"),
        oh.make_node("Relu", ["m"], ["r"], name="relu"),
        oh.make_node("Det", ["r"], ["d"], name="det"),
    ]
    return oh.make_model(oh.make_graph(nodes, "split", [x], [d], initializer=[w]), opset_imports=OPSET, ir_version=IR_VERSION)


def cuda_route(**fields) -> WorkerRoute:
    # use_tf32 off: Hopper's TF32 MatMuls round to 10 mantissa bits, the CPU reference does not
    return WorkerRoute(**{"name": "gpu", "interpreter": sys.executable, "ep": "cuda", "gpu_mem_limit": 2 << 30,
                          "provider_options": {"use_tf32": 0}, **fields})


def test_io_binding_calls_match_the_cpu(start_worker, affine_bundle):
    client = start_worker(cuda_route(allowed_providers=(CUDA, CPU), min_fraction_on_target=0.5))
    report = client.load(affine_bundle.manifest_path)
    assert report.session_providers[0] == CUDA
    assert report.placement.nodes_by_provider.get(CUDA, 0) >= 3
    reference = ort.InferenceSession(str(affine_bundle.graph_path), providers=[CPU])
    for call in range(50):
        inputs = affine_inputs(1 + call % 7, 32, seed=call)
        got = client.run(inputs, request_id=f"r{call}", stage_id=0, epoch=0)
        expected = reference.run(None, inputs)
        np.testing.assert_allclose(got["y"], expected[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got["z"], expected[1])
    stats = client.stats()
    assert stats["device_memory"] is not None and stats["device_memory"]["total_bytes"] > 0


def test_cuda_graphs_per_shape_match_the_cpu(start_worker, tmp_path):
    bundle = pack_graph(tmp_path / "mlp", mlp_graph(), {"x": np.ones((2, 64), np.float32)})
    # CUDA only (fallback disabled); three graphs: the example's 2 rows, then 1 and 4; 8 runs uncaptured
    client = start_worker(cuda_route(enable_cuda_graph=True, max_cuda_graphs=3))
    report = client.load(bundle.manifest_path)
    assert report.placement.fraction_on_target == 1.0
    reference = ort.InferenceSession(str(bundle.graph_path), providers=[CPU])
    rng = np.random.default_rng(0)
    for round_ in range(5):  # ORT captures each shape's graph after its warm-up runs, then replays
        for n in (1, 2, 4, 8):
            x = rng.standard_normal((n, 64)).astype(np.float32)
            got = client.run({"x": x}, request_id=f"{round_}-{n}", stage_id=0, epoch=0)["y"]
            np.testing.assert_allclose(got, reference.run(None, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert client.stats()["cuda_graph_shapes"] == 3


def test_cuda_graphs_of_a_graph_with_several_inputs_and_outputs(start_worker, affine_bundle):
    """Inputs of two dtypes share one device buffer, outputs another: each comes back as its own tensor."""
    client = start_worker(cuda_route(enable_cuda_graph=True, allowed_providers=(CUDA, CPU), min_fraction_on_target=0.5))
    client.load(affine_bundle.manifest_path)
    reference = ort.InferenceSession(str(affine_bundle.graph_path), providers=[CPU])
    for round_ in range(5):
        for n in (1, 3, 8):
            inputs = affine_inputs(n, 32, seed=10 * round_ + n)
            got = client.run(inputs, request_id=f"{round_}-{n}", stage_id=0, epoch=0)
            expected = reference.run(None, inputs)
            np.testing.assert_allclose(got["y"], expected[0], rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(got["z"], expected[1])
            assert got["z"].dtype == expected[1].dtype and got["y"].shape == expected[0].shape
    assert client.stats()["cuda_graph_shapes"] == 4  # the example's shape, then 1, 3 and 8 rows


def test_calls_above_the_capture_size_run_uncaptured(start_worker, tmp_path):
    bundle = pack_graph(tmp_path / "mlp", mlp_graph(), {"x": np.ones((2, 64), np.float32)})
    client = start_worker(cuda_route(enable_cuda_graph=True, cuda_graph_max_rows=2))
    client.load(bundle.manifest_path)  # warm-up: the example's 2 rows take a slot
    reference = ort.InferenceSession(str(bundle.graph_path), providers=[CPU])
    rng = np.random.default_rng(0)
    for round_ in range(4):
        for n in (1, 2, 3, 5, 26):
            x = rng.standard_normal((n, 64)).astype(np.float32)
            got = client.run({"x": x}, request_id=f"{round_}-{n}", stage_id=0, epoch=0)["y"]
            np.testing.assert_allclose(got, reference.run(None, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert client.stats()["cuda_graph_shapes"] == 2  # 1 and 2 rows; 3, 5 and 26 never took a slot


def test_a_true_partial_split_is_reported_and_enforced(start_worker, tmp_path):
    bundle = pack_graph(tmp_path / "split", split_graph(), {"x": np.ones((2, 3, 3), np.float32)})
    lenient = start_worker(cuda_route(allowed_providers=(CUDA, CPU), min_fraction_on_target=0.3))
    placement = lenient.load(bundle.manifest_path).placement
    assert placement.node_providers["det"] == CPU
    assert placement.node_providers["scale"] == CUDA
    assert 0.0 < placement.fraction_on_target < 1.0
    x = np.random.default_rng(0).standard_normal((4, 3, 3)).astype(np.float32)
    expected = np.linalg.det(np.maximum(x * 2, 0))
    np.testing.assert_allclose(lenient.run({"x": x}, request_id="r", stage_id=0, epoch=0)["d"], expected, rtol=1e-4, atol=1e-5)

    strict = start_worker(cuda_route())
    with pytest.raises(PlacementRefused) as info:
        strict.load(bundle.manifest_path)
    assert "det (Det on CPUExecutionProvider)" in str(info.value)
    assert "scale" not in info.value.report.off_target_nodes()
