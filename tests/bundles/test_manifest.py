"""The manifest schema: what parses, and the precise refusal for each way a manifest can be wrong."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from omnigraph.bundles import (
    BundleMetadata,
    BundlePathUnsafe,
    CustomOpsEntry,
    Manifest,
    ManifestInvalid,
    load_manifest,
)
from omnigraph.bundles.manifest import parse_manifest

GRAPH_SHA = "a" * 64
WEIGHTS_SHA = "b" * 64
LIBRARY_SHA = "c" * 64

VALID: dict[str, Any] = {
    "schema_version": 1,
    "component": "laya.decision",
    "files": {"graph.onnx": GRAPH_SHA, "weights.bin": WEIGHTS_SHA, "ops/libomnigraph_ops.so": LIBRARY_SHA},
    "metadata": {
        "graph_file": "graph.onnx",
        "example_inputs_file": None,
        "checkpoint_revision": "rev-1",
        "precision": "bf16",
        "layout": {"max_len": 512},
        "exporter": {"name": "laya exporter", "version": "1"},
        "calibration": {"temperature": [1.0, 1.5, 2.0]},
        "validation": {},
    },
    "custom_ops": {
        "library_file": "ops/libomnigraph_ops.so",
        "abi_version": 1,
        "sha256": LIBRARY_SHA,
        "domain": "omnigraph",
    },
}


def parse(document: dict[str, Any]) -> Manifest:
    return parse_manifest(json.dumps(document).encode(), source="test/manifest.json")


def changed(edit) -> dict[str, Any]:
    document = copy.deepcopy(VALID)
    edit(document)
    return document


def test_valid_manifest_parses_into_typed_parts_and_round_trips() -> None:
    manifest = parse(VALID)
    assert manifest.component == "laya.decision"
    assert manifest.metadata == BundleMetadata(**VALID["metadata"])
    assert manifest.custom_ops == CustomOpsEntry(**VALID["custom_ops"])
    assert parse_manifest(manifest.to_json().encode(), source="again") == manifest
    assert json.loads(manifest.to_json()) == VALID


def test_custom_ops_is_optional() -> None:
    manifest = parse(changed(lambda d: d.pop("custom_ops")))
    assert manifest.custom_ops is None
    assert "custom_ops" not in json.loads(manifest.to_json())


def test_manifest_objects_are_frozen_and_detached_from_the_caller() -> None:
    layout = {"buckets": [16, 32]}
    metadata = BundleMetadata("g.onnx", None, "rev", "fp32", layout, {"name": "x"}, {}, {})
    layout["buckets"].append(64)
    assert metadata.layout == {"buckets": [16, 32]}
    with pytest.raises(AttributeError):
        metadata.precision = "fp16"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("files"), "manifest: missing key 'files'"),
        (lambda d: d.update(extra=1), "manifest: unknown key 'extra'"),
        (lambda d: d["metadata"].pop("precision"), "metadata: missing key 'precision'"),
        (lambda d: d["metadata"].update(tokenizer="t.json"), "metadata: unknown key 'tokenizer'"),
        (lambda d: d["custom_ops"].pop("domain"), "custom_ops: missing key 'domain'"),
        (lambda d: d.update(schema_version=2), "schema_version 2 is not supported"),
        (lambda d: d.update(schema_version="1"), "schema_version must be an integer"),
        (lambda d: d.update(schema_version=True), "schema_version must be an integer"),
        (lambda d: d.update(component=""), "component must be a name"),
        (lambda d: d.update(component=["laya"]), "component must be a name"),
        (lambda d: d.update(files={}), "files must be a non-empty object"),
        (lambda d: d.update(files=["graph.onnx"]), "files must be a non-empty object"),
        (lambda d: d["files"].update({"weights.bin": "B" * 64}), "files['weights.bin']: sha256 must be 64 lowercase"),
        (lambda d: d["files"].update({"weights.bin": "ab12"}), "files['weights.bin']: sha256 must be 64 lowercase hex"),
        (lambda d: d["files"].update({"manifest.json": "d" * 64}), "'manifest.json' cannot list itself"),
        (lambda d: d["metadata"].update(graph_file="model.onnx"), "metadata.graph_file 'model.onnx' is not among"),
        (lambda d: d["metadata"].update(example_inputs_file="inputs.npz"), "metadata.example_inputs_file 'inputs.npz'"),
        (lambda d: d["metadata"].update(precision="int4"), "metadata.precision must be one of fp32, fp16, bf16"),
        (lambda d: d["metadata"].update(checkpoint_revision=""), "metadata.checkpoint_revision must be a non-empty"),
        (lambda d: d["metadata"].update(layout=[]), "metadata.layout must be a JSON object, got list"),
        (lambda d: d["metadata"].update(exporter={"version": "1"}), "metadata.exporter.name must be a non-empty"),
        (lambda d: d["custom_ops"].update(abi_version=-1), "custom_ops.abi_version must be a non-negative integer"),
        (lambda d: d["custom_ops"].update(abi_version=1.0), "custom_ops.abi_version must be a non-negative integer"),
        (lambda d: d["custom_ops"].update(sha256="c" * 63), "custom_ops.sha256 must be 64 lowercase hex"),
        (lambda d: d["custom_ops"].update(sha256="e" * 64), f"custom_ops.sha256 {'e' * 64} disagrees with files"),
        (lambda d: d["custom_ops"].update(library_file="libops.so"), "custom_ops.library_file 'libops.so' is not"),
    ],
)
def test_schema_violations_are_refused_with_the_field_and_file(edit, message: str) -> None:
    with pytest.raises(ManifestInvalid) as refused:
        parse(changed(edit))
    assert str(refused.value).startswith("test/manifest.json: ")
    assert message in str(refused.value)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("../weights.bin", "'.' and '..' components are not allowed"),
        ("sub/../../weights.bin", "'.' and '..' components are not allowed"),
        ("./weights.bin", "'.' and '..' components are not allowed"),
        ("/etc/passwd", "absolute paths are not allowed"),
        ("sub\\weights.bin", "backslashes are not allowed"),
        ("sub//weights.bin", "each path component must be"),
        ("weights.bin/", "each path component must be"),
        ("weights bin", "each path component must be"),
        ("C:weights.bin", "each path component must be"),
        ("wei\nghts.bin", "each path component must be"),
    ],
)
def test_unsafe_member_names_are_refused(name: str, reason: str) -> None:
    with pytest.raises(BundlePathUnsafe) as refused:
        parse(changed(lambda d: d["files"].update({name: WEIGHTS_SHA})))
    assert f"test/manifest.json: files entry {name!r}: {reason}" in str(refused.value)


def test_unsafe_graph_file_name_is_refused() -> None:
    with pytest.raises(BundlePathUnsafe, match="metadata.graph_file '/abs/graph.onnx': absolute paths"):
        parse(changed(lambda d: d["metadata"].update(graph_file="/abs/graph.onnx")))


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (b"{", "not valid JSON"),
        (b"[]", "manifest must be a JSON object, got list"),
        (b'{"schema_version": 1, "schema_version": 1}', "duplicate key 'schema_version'"),
        (b'{"schema_version": NaN}', "NaN is not a JSON number"),
        (b"\xff\xfe{}", "not valid JSON"),
    ],
)
def test_unusable_json_is_refused(text: bytes, reason: str) -> None:
    with pytest.raises(ManifestInvalid, match=reason):
        parse_manifest(text, source="m.json")


def test_metadata_must_be_plain_json() -> None:
    with pytest.raises(ManifestInvalid, match="metadata.calibration is not plain JSON"):
        BundleMetadata("g.onnx", None, "rev", "fp32", {}, {"name": "x"}, {"t": float("nan")}, {})
    with pytest.raises(ManifestInvalid, match="metadata.validation is not plain JSON"):
        BundleMetadata("g.onnx", None, "rev", "fp32", {}, {"name": "x"}, {}, {"when": object()})


def test_load_manifest_reads_a_folder_or_its_manifest(tmp_path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps(VALID))
    assert load_manifest(tmp_path) == load_manifest(tmp_path / "manifest.json") == parse(VALID)
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ManifestInvalid, match="expected a bundle folder or its manifest.json"):
        load_manifest(tmp_path / "other.json")
