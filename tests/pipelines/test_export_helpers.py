"""The exporters' shared manifest entries: versioned calibration, exporter identity, ORT validation."""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from omnigraph import __version__ as omnigraph_version
from omnigraph.pipelines.export import (
    BundleValidationFailed,
    exporter_info,
    validate_in_onnxruntime,
    versioned_calibration,
)

WEIGHT = np.array([[1.0, -2.0], [0.5, 3.0], [0.0, 1.0]], dtype=np.float32)  # [H=3, 2]


@pytest.fixture
def matmul_graph(tmp_path):
    """`y = x @ WEIGHT`, x float32 [P, 3]."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["P", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["P", 2])],
        initializer=[numpy_helper.from_array(WEIGHT, "w")],
    )
    path = tmp_path / "graph.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


INPUTS = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
REFERENCE = INPUTS["x"].astype(np.float64) @ WEIGHT.astype(np.float64)


def test_calibration_version_is_the_sha256_of_the_values_canonical_json():
    calibration = versioned_calibration({"temperature": 1.5, "by": {"b": 1, "a": 2}})
    canonical = '{"by":{"a":2,"b":1},"temperature":1.5}'
    assert calibration == {"temperature": 1.5, "by": {"b": 1, "a": 2},
                           "version": hashlib.sha256(canonical.encode()).hexdigest()}
    assert versioned_calibration({"temperature": 1.0})["version"] != calibration["version"]


def test_exporter_info_names_the_exporter_and_the_libraries():
    info = exporter_info("omnigraph.pipelines.demo.export", 3, 17, fast=False)
    assert info == {"name": "omnigraph.pipelines.demo.export", "version": 3, "omnigraph": omnigraph_version,
                    "onnx": onnx.__version__, "onnxruntime": ort.__version__, "opset": 17, "fast": False}


def test_a_graph_that_reproduces_its_reference_is_described_for_the_manifest(matmul_graph):
    validation = validate_in_onnxruntime(matmul_graph, INPUTS, {"y": REFERENCE}, 1e-5,
                                         reference="numpy float64 x @ w", inputs_file="inputs.npz")
    assert validation["reference"] == "numpy float64 x @ w"
    assert validation["runtime"] == f"onnxruntime {ort.__version__} CPUExecutionProvider"
    assert validation["inputs"] == "inputs.npz"
    assert validation["tolerance"] == {"y": 1e-5}
    assert 0.0 <= validation["max_abs_diff"]["y"] <= 1e-5


def test_a_difference_above_tolerance_is_refused_with_its_size(matmul_graph):
    wrong = REFERENCE.copy()
    wrong[1, 0] += 0.25
    with pytest.raises(BundleValidationFailed, match=r"graph.onnx: y differs from the reference \(ref\) by 0.25"):
        validate_in_onnxruntime(matmul_graph, INPUTS, {"y": wrong}, 1e-3, reference="ref", inputs_file="inputs.npz")


def test_a_nan_reference_is_refused(matmul_graph):
    with pytest.raises(BundleValidationFailed, match="differs"):
        validate_in_onnxruntime(matmul_graph, INPUTS, {"y": np.full((2, 2), np.nan)}, 1e-3, reference="ref",
                                inputs_file="inputs.npz")


def test_a_shape_mismatch_is_refused(matmul_graph):
    with pytest.raises(BundleValidationFailed, match=r"y has shape \(2, 2\), the reference \(ref\) \(2,\)"):
        validate_in_onnxruntime(matmul_graph, INPUTS, {"y": REFERENCE[:, 0]}, 1e-3, reference="ref",
                                inputs_file="inputs.npz")
