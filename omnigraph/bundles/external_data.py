"""ONNX external-data references: which files a graph reads besides itself.

ONNX Runtime opens an external tensor's `location` relative to the graph file, wherever it points.
So every external location must be a safe member name that the bundle lists; the weights
themselves are never read here.
"""

from __future__ import annotations

import posixpath
from collections.abc import Collection, Iterable
from pathlib import Path

import onnx

from omnigraph.bundles.errors import BundlePathUnsafe, ExternalDataOutsideBundle, MemberInvalid
from omnigraph.bundles.onnx_graph import iter_tensors
from omnigraph.bundles.paths import check_member_name

ONNX_SUFFIX = ".onnx"


def graph_members(names: Iterable[str], graph_file: str) -> list[str]:
    """The members read as ONNX models: the bundle's graph and any other `*.onnx` file."""
    return sorted({graph_file, *(name for name in names if name.endswith(ONNX_SUFFIX))})


def external_data_members(root: Path, graph_file: str, model: onnx.ModelProto) -> dict[str, str]:
    """Member name -> first tensor name, for every external-data file the graph root/graph_file reads."""
    return {member: tensor for member, (_, tensor) in external_data_references(root, graph_file, model).items()}


def external_data_references(root: Path, graph_file: str, model: onnx.ModelProto) -> dict[str, tuple[str, str]]:
    """Member name -> (location as the graph writes it, first tensor name), for every external-data
    file the graph root/graph_file reads."""
    graph_dir = posixpath.dirname(graph_file)
    members: dict[str, tuple[str, str]] = {}
    for tensor in iter_tensors(model):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((entry.value for entry in tensor.external_data if entry.key == "location"), "")
        if not location:
            raise ExternalDataOutsideBundle(f"{root / graph_file}: external tensor {tensor.name!r} has no location")
        try:
            check_member_name(location, what=f"external data of tensor {tensor.name!r}")
        except BundlePathUnsafe as exc:
            raise ExternalDataOutsideBundle(f"{root / graph_file}: {exc}") from None
        members.setdefault(posixpath.join(graph_dir, location), (location, tensor.name))
    return members


def check_external_data(root: Path, graph_file: str, model: onnx.ModelProto, listed: Collection[str]) -> None:
    """Refuse a graph that reads external data from a file outside the `listed` member names, or
    past the end of its file (a truncated weights file would otherwise fail only at session load)."""
    for member, tensor_name in external_data_members(root, graph_file, model).items():
        if member not in listed:
            raise ExternalDataOutsideBundle(
                f"{root / graph_file}: tensor {tensor_name!r} reads external data from {member!r}, "
                "which is not a file of the bundle"
            )
    graph_dir = posixpath.dirname(graph_file)
    sizes: dict[str, int] = {}
    for tensor in iter_tensors(model):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entries = {entry.key: entry.value for entry in tensor.external_data}
        if not entries.get("length"):
            continue  # ONNX Runtime then reads what the tensor's shape takes and checks it itself
        member = posixpath.join(graph_dir, entries["location"])
        size = sizes.setdefault(member, (root / member).stat().st_size)
        end = int(entries.get("offset") or 0) + int(entries["length"])
        if end > size:
            raise MemberInvalid(
                f"{root / member}: {size} bytes, but tensor {tensor.name!r} of {root / graph_file} reads up to "
                f"byte {end} (truncated?)"
            )
