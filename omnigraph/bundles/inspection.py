"""Inspection: what a bundle holds and what its graph expects, read without loading any weights."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import onnx

from omnigraph.bundles.external_data import external_data_members
from omnigraph.bundles.onnx_graph import iter_nodes, load_graph_structure
from omnigraph.bundles.verify import read_bundle_layout

# Operator domains defined by the ONNX standard; nodes elsewhere need a runtime or library that has them.
STANDARD_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training"})


def inspect_bundle(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON-ready description of a bundle folder (or its manifest.json).

    The folder layout is checked (names, links, missing or unlisted files) but file contents are not
    hashed (`verify_bundle` does that) and external weights are never read.
    """
    layout = read_bundle_layout(path)
    root, manifest = layout.root, layout.manifest
    graph_file = manifest.metadata.graph_file
    model = load_graph_structure(root / graph_file)
    initializer_names = {tensor.name for tensor in model.graph.initializer}
    file_sizes = {name: (root / name).stat().st_size for name in manifest.files}
    return {
        "bundle": str(root),
        "manifest_sha256": layout.manifest_sha256,
        "component": manifest.component,
        "graph_file": graph_file,
        "ir_version": model.ir_version,
        "producer": " ".join(part for part in (model.producer_name, model.producer_version) if part),
        "opset_imports": {entry.domain or "ai.onnx": entry.version for entry in model.opset_import},
        "inputs": [_describe_value(value) for value in model.graph.input if value.name not in initializer_names],
        "outputs": [_describe_value(value) for value in model.graph.output],
        "node_count": sum(1 for _ in iter_nodes(model)),
        "custom_op_types": _custom_op_types(model),
        "external_data_files": sorted(external_data_members(root, graph_file, model)),
        "files": file_sizes,
        "total_bytes": sum(file_sizes.values()) + len(layout.manifest_bytes),
        "custom_ops": None if manifest.custom_ops is None else manifest.custom_ops.to_dict(),
        "metadata": manifest.metadata.to_dict(),
    }


def format_inspection(report: dict[str, Any]) -> str:
    """The report of inspect_bundle as aligned text for a terminal."""
    metadata = report["metadata"]
    opsets = ", ".join(f"{domain} {version}" for domain, version in sorted(report["opset_imports"].items()))
    lines = [
        f"bundle       {report['bundle']}",
        f"component    {report['component']}",
        f"manifest     sha256 {report['manifest_sha256']}",
        f"size         {_human_bytes(report['total_bytes'])} in {len(report['files']) + 1} files",
        f"graph        {report['graph_file']} (ir {report['ir_version']}, {report['node_count']} nodes; "
        f"opsets {opsets})",
        f"precision    {metadata['precision']}",
        f"checkpoint   {metadata['checkpoint_revision']}",
        f"exporter     {metadata['exporter'].get('name')}",
    ]
    if report["external_data_files"]:
        lines.append(f"weights      {', '.join(report['external_data_files'])}")
    if report["custom_op_types"]:
        used = "; ".join(f"{domain}: {', '.join(types)}" for domain, types in sorted(report["custom_op_types"].items()))
        lines.append(f"custom ops   {used}")
    if report["custom_ops"] is not None:
        library = report["custom_ops"]
        lines.append(
            f"op library   {library['library_file']} (domain {library['domain']}, abi {library['abi_version']})"
        )
    for title, values in (("inputs", report["inputs"]), ("outputs", report["outputs"])):
        lines.append("")
        rows = [(value["name"], value["dtype"], _shape_text(value["shape"])) for value in values]
        lines.extend(_table((title, "dtype", "shape"), rows))
    lines += ["", "(file hashes are not checked here; `omnigraph bundle verify` checks them)"]
    return "\n".join(lines)


def _describe_value(value: onnx.ValueInfoProto) -> dict[str, Any]:
    """Name, dtype and shape of a graph input or output; symbolic dims by name, unknown dims as None."""
    kind = value.type.WhichOneof("value")
    if kind != "tensor_type":
        return {"name": value.name, "dtype": kind or "unknown", "shape": None}
    tensor_type = value.type.tensor_type
    shape = None
    if tensor_type.HasField("shape"):
        shape = [
            dim.dim_value if dim.HasField("dim_value") else (dim.dim_param or None) for dim in tensor_type.shape.dim
        ]
    return {"name": value.name, "dtype": _dtype_name(tensor_type.elem_type), "shape": shape}


def _dtype_name(elem_type: int) -> str:
    """numpy-style name of an ONNX element type (float32, int64, bfloat16, ...)."""
    name = onnx.TensorProto.DataType.Name(elem_type).lower()
    return {"float": "float32", "double": "float64"}.get(name, name)


def _custom_op_types(model: onnx.ModelProto) -> dict[str, list[str]]:
    """Op types per non-standard domain that the graph calls (model-local functions excluded)."""
    local_functions = {(function.domain, function.name) for function in model.functions}
    used: dict[str, set[str]] = {}
    for node in iter_nodes(model):
        if node.domain not in STANDARD_DOMAINS and (node.domain, node.op_type) not in local_functions:
            used.setdefault(node.domain, set()).add(node.op_type)
    return {domain: sorted(types) for domain, types in sorted(used.items())}


def _shape_text(shape: Sequence[int | str | None] | None) -> str:
    if shape is None:
        return "unknown"
    return "[" + ", ".join("?" if dim is None else str(dim) for dim in shape) + "]"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    return ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in (header, *rows)]


def _human_bytes(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    value, units = size / 1024, ["KiB", "MiB", "GiB", "TiB"]
    while value >= 1024 and len(units) > 1:
        value /= 1024
        units.pop(0)
    return f"{value:.1f} {units[0]}"
