"""inspect_bundle / format_inspection: the graph's interface and the bundle's make-up, weights unread."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from omnigraph.bundles import BundleUnlistedFile, VerifiedBundle, format_inspection, inspect_bundle, pack_bundle


def test_report_describes_interface_files_and_metadata(packed: VerifiedBundle) -> None:
    report = inspect_bundle(packed.root)
    assert report["component"] == "test.matmul"
    assert report["manifest_sha256"] == packed.manifest_sha256
    assert report["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["B", 2]}]
    assert report["outputs"] == [{"name": "y", "dtype": "float32", "shape": ["B", 3]}]
    assert report["opset_imports"] == {"ai.onnx": 17}
    assert report["ir_version"] == 10
    assert report["producer"] == "omnigraph-tests"
    assert report["external_data_files"] == ["weights.bin"]
    assert report["files"]["weights.bin"] == 24  # six float32 weights
    assert report["total_bytes"] == sum(path.stat().st_size for path in packed.root.iterdir())
    assert report["custom_op_types"] == {}
    assert report["metadata"]["example_inputs_file"] == "inputs.npz"
    json.dumps(report)  # JSON-ready, as `omnigraph bundle inspect --json` prints it


def test_custom_domains_and_symbolic_or_unknown_dims_are_reported(tmp_path: Path) -> None:
    local_double = helper.make_function(
        "local", "Double", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])],
        [helper.make_opsetid("", 17)],
    )
    unknown_dim = helper.make_tensor_value_info("tokens", TensorProto.INT64, ["batch", None])
    graph = helper.make_graph(
        [
            helper.make_node("FusedEmbed", ["tokens"], ["h"], domain="omnigraph"),
            helper.make_node("Double", ["h"], ["h2"], domain="local"),
            helper.make_node("FusedGelu", ["h2"], ["out"], domain="omnigraph"),
            helper.make_node("Attention", ["out"], ["att"], domain="com.microsoft"),
        ],
        "custom",
        [unknown_dim],
        [helper.make_tensor_value_info("att", TensorProto.BFLOAT16, None)],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("omnigraph", 1),
                       helper.make_opsetid("local", 1), helper.make_opsetid("com.microsoft", 1)],
        functions=[local_double],
    )
    onnx.save(model, tmp_path / "graph.onnx")
    report = inspect_bundle(pack_bundle(tmp_path, component="test.custom").root)
    assert report["inputs"] == [{"name": "tokens", "dtype": "int64", "shape": ["batch", None]}]
    assert report["outputs"] == [{"name": "att", "dtype": "bfloat16", "shape": None}]
    assert report["custom_op_types"] == {"com.microsoft": ["Attention"], "omnigraph": ["FusedEmbed", "FusedGelu"]}
    assert report["opset_imports"]["omnigraph"] == 1
    assert report["node_count"] == 5  # four graph nodes and the function's Add

    text = format_inspection(report)
    assert "custom ops   com.microsoft: Attention; omnigraph: FusedEmbed, FusedGelu" in text
    assert "tokens  int64  [batch, ?]" in text
    assert "att      bfloat16  unknown" in text


def test_formatted_report_is_a_readable_table(packed: VerifiedBundle) -> None:
    text = format_inspection(inspect_bundle(packed.manifest_path))
    lines = text.splitlines()
    assert lines[0] == f"bundle       {packed.root}"
    assert "component    test.matmul" in lines
    assert "graph        graph.onnx (ir 10, 1 nodes; opsets ai.onnx 17)" in lines
    assert "weights      weights.bin" in lines
    assert ["inputs  dtype    shape", "x       float32  [B, 2]"] == lines[lines.index("inputs  dtype    shape"):][:2]
    assert "omnigraph bundle verify" in lines[-1]


def test_inspect_refuses_a_folder_that_does_not_match_its_manifest(packed: VerifiedBundle) -> None:
    (packed.root / "extra.bin").write_bytes(b"x")
    with pytest.raises(BundleUnlistedFile, match="extra.bin"):
        inspect_bundle(packed.root)
