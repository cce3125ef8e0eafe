"""Tiny ONNX graphs and bundle folders built with onnx.helper, shared by the bundle tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, external_data_helper, helper, numpy_helper

from omnigraph.bundles import VerifiedBundle, pack_bundle

ModelFactory = Callable[..., onnx.ModelProto]


def _matmul_model(weight_dtype: type = np.float32, *, extra_nodes: tuple[onnx.NodeProto, ...] = ()) -> onnx.ModelProto:
    """y[B, 3] = x[B, 2] @ w, with w an initializer; `extra_nodes` may consume y and must produce z."""
    elem_type = helper.np_dtype_to_tensor_dtype(np.dtype(weight_dtype))
    weight = numpy_helper.from_array(np.arange(6, dtype=weight_dtype).reshape(2, 3), "w")
    outputs = [helper.make_tensor_value_info("z" if extra_nodes else "y", elem_type, ["B", 3])]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), *extra_nodes],
        "tiny",
        [helper.make_tensor_value_info("x", elem_type, ["B", 2])],
        outputs,
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="omnigraph-tests")
    model.ir_version = 10
    return model


def _point_at(tensor: onnx.TensorProto, location: str) -> None:
    """Make `tensor` an external-data reference to `location` (whatever that names)."""
    external_data_helper.set_external_data(tensor, location=location, offset=0, length=len(tensor.raw_data))
    tensor.data_location = TensorProto.EXTERNAL
    tensor.ClearField("raw_data")


@pytest.fixture
def matmul_model() -> ModelFactory:
    return _matmul_model


@pytest.fixture
def point_at() -> Callable[[onnx.TensorProto, str], None]:
    return _point_at


@pytest.fixture
def bundle_dir(tmp_path: Path) -> Path:
    """An unpacked bundle folder: graph.onnx whose weight lives in weights.bin, plus inputs.npz."""
    folder = tmp_path / "bundle"
    folder.mkdir()
    onnx.save(
        _matmul_model(), folder / "graph.onnx", save_as_external_data=True, location="weights.bin", size_threshold=0
    )
    np.savez(folder / "inputs.npz", x=np.ones((1, 2), np.float32))
    return folder


@pytest.fixture
def packed(bundle_dir: Path) -> VerifiedBundle:
    return pack_bundle(bundle_dir, component="test.matmul", example_inputs_file="inputs.npz")


@pytest.fixture
def edit_manifest() -> Callable[[Path, Callable[[dict[str, Any]], None]], None]:
    """Rewrite a bundle's manifest.json through a function that edits the parsed document in place."""

    def edit(bundle: Path, change: Callable[[dict[str, Any]], None]) -> None:
        path = bundle / "manifest.json"
        document = json.loads(path.read_text())
        change(document)
        path.write_text(json.dumps(document))

    return edit
