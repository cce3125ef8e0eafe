"""Packing: write manifest.json over the files already in a folder, making it a bundle."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnx

from omnigraph import __version__
from omnigraph.bundles.errors import BundleFileMissing, BundlePathUnsafe, ManifestInvalid
from omnigraph.bundles.external_data import check_external_data, graph_members
from omnigraph.bundles.hashing import ProgressFactory, sha256_file
from omnigraph.bundles.manifest import SCHEMA_VERSION, BundleMetadata, CustomOpsEntry, Manifest
from omnigraph.bundles.members import check_member_format
from omnigraph.bundles.onnx_graph import iter_tensors, load_graph_structure
from omnigraph.bundles.paths import MANIFEST_NAME, check_member_name, scan_bundle_tree
from omnigraph.bundles.verify import VerifiedBundle, verify_bundle

# Metadata a caller may give; graph_file and example_inputs_file are pack_bundle's own arguments.
PACK_METADATA_KEYS = ("checkpoint_revision", "precision", "layout", "exporter", "calibration", "validation")


def pack_bundle(
    directory: str | os.PathLike[str],
    *,
    component: str,
    graph_file: str = "graph.onnx",
    example_inputs_file: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    custom_ops: CustomOpsEntry | Mapping[str, Any] | None = None,
    progress: ProgressFactory | None = None,
) -> VerifiedBundle:
    """Hash every file under `directory` (but manifest.json) into `directory/manifest.json`.

    Model exporters pass full `metadata`; a user packing by hand gets defaults for what they leave
    out: checkpoint_revision = the graph's sha256, precision inferred from the graph's float
    initializers, exporter = this packer, empty layout / calibration / validation. `custom_ops` is a
    CustomOpsEntry or a mapping of its fields (sha256 may be left out: it is the library file's).
    The folder is refused, and nothing written, if it holds unsafe names, links out of it, a
    member that does not parse as its name says (bundles/members.py), or a graph whose external
    data is not among its files. The manifest is replaced atomically and the
    result verified from disk. `progress` opens a display for each big file hashed (hashing.py).
    """
    root = Path(directory)
    if not root.is_dir():
        raise BundleFileMissing(f"{root}: not a directory")
    root = Path(os.path.realpath(root))
    given = dict(metadata or {})
    unknown = sorted(set(given) - set(PACK_METADATA_KEYS))
    if unknown:
        raise ManifestInvalid(f"metadata: unknown key {unknown[0]!r} (expected {', '.join(PACK_METADATA_KEYS)})")

    names = scan_bundle_tree(root)
    for name in names:
        try:
            check_member_name(name, what="file")
        except BundlePathUnsafe as exc:
            raise BundlePathUnsafe(f"{root}: cannot pack: {exc}") from None
    if custom_ops is not None and not isinstance(custom_ops, (CustomOpsEntry, Mapping)):
        raise ManifestInvalid(f"custom_ops must be a CustomOpsEntry or a mapping, got {type(custom_ops).__name__}")
    library_file = custom_ops.library_file if isinstance(custom_ops, CustomOpsEntry) else (custom_ops or {}).get(
        "library_file"
    )
    for field, member in (
        ("graph_file", graph_file),
        ("example_inputs_file", example_inputs_file),
        ("custom_ops.library_file", library_file),
    ):
        if member is not None and member not in names:
            raise BundleFileMissing(f"{field} {member!r} is not a file in {root}")
    graphs = {member: load_graph_structure(root / member) for member in graph_members(names, graph_file)}
    for member, model in graphs.items():
        check_external_data(root, member, model, names)
    for name in names:
        check_member_format(root / name)

    files = {name: sha256_file(root / name, progress=progress) for name in names}
    defaults: dict[str, Any] = {
        "checkpoint_revision": files[graph_file],
        "layout": {},
        "exporter": {"name": "omnigraph bundle pack", "omnigraph": __version__, "onnx": onnx.__version__},
        "calibration": {},
        "validation": {},
    }
    if "precision" not in given:
        defaults["precision"] = infer_precision(graphs[graph_file])
    manifest = Manifest(
        schema_version=SCHEMA_VERSION,
        component=component,
        files=files,
        metadata=BundleMetadata(graph_file=graph_file, example_inputs_file=example_inputs_file, **(defaults | given)),
        custom_ops=_custom_ops_entry(custom_ops, files),
    )
    _write_atomically(root / MANIFEST_NAME, manifest.to_json())
    return verify_bundle(root)


def infer_precision(model: onnx.ModelProto) -> str:
    """The manifest precision of a graph: bf16 or fp16 if any float weight has that type, else fp32."""
    types = {tensor.data_type for tensor in iter_tensors(model)}
    if onnx.TensorProto.BFLOAT16 in types:
        return "bf16"
    if onnx.TensorProto.FLOAT16 in types:
        return "fp16"
    return "fp32"


def _custom_ops_entry(
    custom_ops: CustomOpsEntry | Mapping[str, Any] | None, files: dict[str, str]
) -> CustomOpsEntry | None:
    if custom_ops is None or isinstance(custom_ops, CustomOpsEntry):
        return custom_ops
    fields = dict(custom_ops)
    fields.setdefault("sha256", files.get(fields.get("library_file", "")))
    return CustomOpsEntry.from_dict(fields)


def _write_atomically(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path` in one step."""
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
