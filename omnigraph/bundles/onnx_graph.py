"""Read an ONNX model's structure (never its external weights) and walk all of it.

A graph hides tensors and nodes in more places than `graph.initializer` and `graph.node`: control
flow subgraphs (If/Loop/Scan attributes), model-local functions and training graphs. Verification
and inspection must see all of them, so the walk lives here once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import onnx

from omnigraph.bundles.errors import MemberInvalid

# The IR version every graph omnigraph writes declares. The onnx package stamps its own newest one
# (IR 14 in onnx 1.23), which an older ONNX Runtime refuses to load ("max supported IR version: 13"
# on the GPU image's 1.2x); IR 10 is read by ONNX Runtime 1.16 and later and carries every feature
# our graphs use.
IR_VERSION = 10


def load_graph_structure(path: Path) -> onnx.ModelProto:
    """The ONNX model at `path` without its external weights (they are never read here)."""
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and onnx's own errors share no base class
        raise MemberInvalid(f"{path}: not a readable ONNX model: {exc}") from None


def parse_graph_structure(data: bytes, *, source: Path) -> onnx.ModelProto:
    """The ONNX model serialized in `data` (read from `source`), external weights not loaded."""
    try:
        return onnx.load_from_string(data)
    except Exception as exc:  # as in load_graph_structure
        raise MemberInvalid(f"{source}: not a readable ONNX model: {exc}") from None


def iter_graphs(model: onnx.ModelProto) -> Iterator[onnx.GraphProto]:
    """The main graph, the training graphs and every subgraph nested in node attributes."""
    for graph in (model.graph, *(t.initialization for t in model.training_info),
                  *(t.algorithm for t in model.training_info)):
        yield from _with_subgraphs(graph)
    for function in model.functions:
        for node in function.node:
            for subgraph in _subgraphs(node):
                yield from _with_subgraphs(subgraph)


def iter_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Every node: of every graph from iter_graphs and of every model-local function."""
    for graph in iter_graphs(model):
        yield from graph.node
    for function in model.functions:
        yield from function.node


def iter_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto: initializers (dense and sparse) and tensor-valued node attributes."""
    for graph in iter_graphs(model):
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield from (sparse.values, sparse.indices)
    for node in iter_nodes(model):
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("sparse_tensor"):
                yield from (attribute.sparse_tensor.values, attribute.sparse_tensor.indices)
            for sparse in attribute.sparse_tensors:
                yield from (sparse.values, sparse.indices)


def _with_subgraphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for subgraph in _subgraphs(node):
            yield from _with_subgraphs(subgraph)


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attribute in node.attribute:
        if attribute.HasField("g"):
            yield attribute.g
        yield from attribute.graphs
