"""Tiny ONNX graphs written as fixture data, built with onnx.helper (no model files checked in).

A graph spec: `{"opset": 17, "inputs": [{"name", "dtype", "shape"}], "outputs": [...],
"initializers": [{"name", "dtype", "shape", "values" | "fill", "external"?: "weights.bin"}],
"nodes": [{"op", "inputs", "outputs", "attributes"?}]}`. A shape entry that is a string is a
symbolic (dynamic) dimension. An initializer with `external` is stored as ONNX external data in that
file (relative to the graph), the way real bundles keep their weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from omnigraph.bundles.onnx_graph import IR_VERSION
from omnigraph.conformance.suite import FixtureInvalid
from omnigraph.conformance.tensors import tensor_from_spec


def build_model(spec: Mapping[str, Any], *, where: str) -> tuple[onnx.ModelProto, dict[str, bytes]]:
    """The model a spec describes and the external-data files it needs (file name -> bytes)."""
    try:
        inputs = [_value_info(item) for item in spec["inputs"]]
        outputs = [_value_info(item) for item in spec["outputs"]]
        nodes = [
            helper.make_node(node["op"], node["inputs"], node["outputs"], **node.get("attributes", {}))
            for node in spec["nodes"]
        ]
        opset = spec.get("opset", 17)
    except (KeyError, TypeError) as exc:
        raise FixtureInvalid(f"{where}: graph spec needs inputs, outputs and nodes ({exc})") from None
    items = spec.get("initializers", [])
    initializers = [
        numpy_helper.from_array(tensor_from_spec(item, where=f"{where} initializer {item.get('name')}"), item["name"])
        for item in items
    ]
    graph = helper.make_graph(nodes, spec.get("name", "conformance"), inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="omnigraph.conformance")
    model.ir_version = IR_VERSION
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise FixtureInvalid(f"{where}: the graph spec is not a valid ONNX model: {exc}") from None
    # Moved out only after the check: the checker wants external files to exist already.
    external: dict[str, bytearray] = {}
    for item, tensor in zip(items, model.graph.initializer):
        if "external" in item:
            _move_to_external(tensor, item["external"], external)
    return model, {name: bytes(data) for name, data in external.items()}


def write_model(spec: Mapping[str, Any], directory: Path, graph_file: str, *, where: str) -> None:
    """Write the graph (and its external-data files) into `directory`."""
    model, external = build_model(spec, where=where)
    for name, data in external.items():
        (directory / name).write_bytes(data)
    (directory / graph_file).write_bytes(model.SerializeToString())


def _value_info(item: Mapping[str, Any]) -> onnx.ValueInfoProto:
    dtype = item["dtype"]
    elem_type = TensorProto.BFLOAT16 if dtype == "bfloat16" else helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return helper.make_tensor_value_info(item["name"], elem_type, item["shape"])


def _move_to_external(tensor: TensorProto, location: str, files: dict[str, bytearray]) -> None:
    data = files.setdefault(location, bytearray())
    offset = len(data)
    raw = tensor.raw_data
    data += raw
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(len(raw)))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
