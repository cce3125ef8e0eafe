"""pack_bundle: defaults for hand packing, exporter metadata, and folders it refuses to pack."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

import omnigraph.bundles.hashing as hashing
from omnigraph.bundles import (
    BundleFileMissing,
    BundlePathUnsafe,
    ExternalDataOutsideBundle,
    ManifestInvalid,
    load_manifest,
    pack_bundle,
    sha256_file,
)

EXPORTER_METADATA = {
    "checkpoint_revision": "convaiinnovations/laya@abc123",
    "precision": "bf16",
    "layout": {"max_len": 512, "buckets": [16, 32]},
    "exporter": {"name": "laya exporter", "torch": "2.13"},
    "calibration": {"temperature": {"choice": 1.2}, "version": "f" * 64},
    "validation": {"max_abs_diff": 1e-5},
}


def test_hand_packing_fills_sensible_defaults(bundle_dir: Path) -> None:
    bundle = pack_bundle(bundle_dir, component="test.matmul")
    metadata = bundle.manifest.metadata
    assert metadata.graph_file == "graph.onnx"
    assert metadata.example_inputs_file is None
    assert metadata.checkpoint_revision == sha256_file(bundle_dir / "graph.onnx")
    assert metadata.precision == "fp32"
    assert metadata.exporter["name"] == "omnigraph bundle pack"
    assert (metadata.layout, metadata.calibration, metadata.validation) == ({}, {}, {})
    assert load_manifest(bundle_dir) == bundle.manifest


def test_exporter_metadata_is_written_as_given(bundle_dir: Path) -> None:
    bundle = pack_bundle(
        bundle_dir, component="laya.decision", example_inputs_file="inputs.npz", metadata=EXPORTER_METADATA
    )
    written = json.loads(bundle.manifest_path.read_text())["metadata"]
    assert written == {**EXPORTER_METADATA, "graph_file": "graph.onnx", "example_inputs_file": "inputs.npz"}


@pytest.mark.parametrize(("dtype", "precision"), [(np.float16, "fp16"), (np.float32, "fp32")])
def test_precision_is_inferred_from_the_graph_weights(tmp_path: Path, matmul_model, dtype, precision: str) -> None:
    onnx.save(matmul_model(dtype), tmp_path / "graph.onnx")
    assert pack_bundle(tmp_path, component="test.matmul").manifest.metadata.precision == precision


def test_repacking_replaces_the_manifest_and_leaves_no_temporary_file(bundle_dir: Path) -> None:
    first = pack_bundle(bundle_dir, component="test.matmul")
    (bundle_dir / "tokenizer.json").write_text("{}")
    second = pack_bundle(bundle_dir, component="test.matmul")
    assert "manifest.json" not in second.manifest.files
    assert set(second.manifest.files) == set(first.manifest.files) | {"tokenizer.json"}
    assert sorted(path.name for path in bundle_dir.iterdir()) == [
        "graph.onnx", "inputs.npz", "manifest.json", "tokenizer.json", "weights.bin"
    ]


def _refused_without_writing(folder: Path, error: type[Exception], message: str, **kwargs) -> None:
    with pytest.raises(error, match=message):
        pack_bundle(folder, **{"component": "test.matmul", **kwargs})
    assert not (folder / "manifest.json").exists()


def test_missing_graph_or_inputs_are_refused(bundle_dir: Path) -> None:
    _refused_without_writing(bundle_dir, BundleFileMissing, "graph_file 'model.onnx' is not a file in",
                             graph_file="model.onnx")
    _refused_without_writing(bundle_dir, BundleFileMissing, "example_inputs_file 'x.npz' is not a file in",
                             example_inputs_file="x.npz")
    _refused_without_writing(bundle_dir / "absent", BundleFileMissing, "absent: not a directory")


def test_unsafe_names_and_links_out_are_refused(bundle_dir: Path, tmp_path: Path) -> None:
    (bundle_dir / "read me.txt").write_text("hi")
    _refused_without_writing(bundle_dir, BundlePathUnsafe, "cannot pack: file 'read me.txt': each path component")
    (bundle_dir / "read me.txt").unlink()
    (tmp_path / "secret").write_text("s")
    (bundle_dir / "secret").symlink_to(tmp_path / "secret")
    _refused_without_writing(bundle_dir, BundlePathUnsafe, "secret: a symbolic link leads outside the bundle")


def test_graph_whose_external_data_is_not_in_the_folder_is_refused(tmp_path: Path, matmul_model) -> None:
    folder = tmp_path / "bundle"
    folder.mkdir()
    onnx.save(matmul_model(), folder / "graph.onnx", save_as_external_data=True, location="weights.bin",
              size_threshold=0)
    (folder / "weights.bin").rename(tmp_path / "weights.bin")
    _refused_without_writing(folder, ExternalDataOutsideBundle, "reads external data from 'weights.bin'")


def test_bad_metadata_and_component_are_refused(bundle_dir: Path) -> None:
    _refused_without_writing(bundle_dir, ManifestInvalid, "metadata: unknown key 'graph_file'",
                             metadata={"graph_file": "graph.onnx"})
    _refused_without_writing(bundle_dir, ManifestInvalid, "metadata.precision must be one of",
                             metadata={"precision": "int8"})
    _refused_without_writing(bundle_dir, ManifestInvalid, "component must be a name", component="my model")
    _refused_without_writing(bundle_dir, ManifestInvalid, "custom_ops: missing key 'abi_version'",
                             custom_ops={"library_file": "weights.bin", "domain": "og"})


def test_large_files_report_hashing_progress_to_the_callers_display(bundle_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(hashing, "PROGRESS_MIN_BYTES", 100)
    reports: dict[str, list] = {}

    class Display:
        def __init__(self, path: Path, size: int) -> None:
            self.counts = reports.setdefault(path.name, [size])

        def update(self, count: int) -> None:
            self.counts.append(count)

        def close(self) -> None:
            self.counts.append("closed")

    pack_bundle(bundle_dir, component="test.matmul", progress=Display)
    assert sorted(reports) == ["graph.onnx", "inputs.npz"]  # weights.bin is under the size that reports
    for name, (size, *counts, last) in reports.items():
        assert size == (bundle_dir / name).stat().st_size and sum(counts) == size and last == "closed"
