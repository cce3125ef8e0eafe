"""verify_bundle: a packed bundle passes, and every kind of tampering is refused with the file named."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from omnigraph.bundles import (
    BundleError,
    BundleFileMissing,
    BundleHashMismatch,
    BundlePathUnsafe,
    BundleUnlistedFile,
    ExternalDataOutsideBundle,
    ManifestInvalid,
    VerifiedBundle,
    pack_bundle,
    sha256_file,
    verify_bundle,
)


def test_packed_bundle_verifies_from_its_folder_or_its_manifest(packed: VerifiedBundle, bundle_dir: Path) -> None:
    for path in (bundle_dir, bundle_dir / "manifest.json"):
        bundle = verify_bundle(path)
        assert bundle == packed
    assert bundle.root == bundle_dir.resolve()
    assert bundle.graph_path == bundle.root / "graph.onnx"
    assert bundle.example_inputs_path == bundle.root / "inputs.npz"
    assert bundle.custom_ops_path is None
    assert bundle.manifest_sha256 == hashlib.sha256((bundle_dir / "manifest.json").read_bytes()).hexdigest()
    assert set(bundle.manifest.files) == {"graph.onnx", "weights.bin", "inputs.npz"}
    assert bundle.manifest.files["weights.bin"] == sha256_file(bundle_dir / "weights.bin")


def test_file_gives_members_only(packed: VerifiedBundle) -> None:
    assert packed.file("weights.bin") == packed.root / "weights.bin"
    with pytest.raises(BundleFileMissing, match="tokenizer.json: not a file of this bundle"):
        packed.file("tokenizer.json")


def test_one_changed_byte_is_refused(packed: VerifiedBundle) -> None:
    weights = packed.root / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[5] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(BundleHashMismatch, match=f"{weights}: sha256 is [0-9a-f]{{64}}, manifest.json lists"):
        verify_bundle(packed.root)


def test_missing_file_is_refused(packed: VerifiedBundle) -> None:
    (packed.root / "inputs.npz").unlink()
    with pytest.raises(BundleFileMissing, match="inputs.npz: listed in manifest.json but not in the bundle"):
        verify_bundle(packed.root)


@pytest.mark.parametrize("extra", ["notes.txt", "sub/dir/extra.bin", ".hidden"])
def test_unlisted_file_is_refused(packed: VerifiedBundle, extra: str) -> None:
    (packed.root / extra).parent.mkdir(parents=True, exist_ok=True)
    (packed.root / extra).write_text("surprise")
    with pytest.raises(BundleUnlistedFile, match=f"{extra}: in the bundle but not listed in manifest.json"):
        verify_bundle(packed.root)


def test_missing_manifest_is_refused(bundle_dir: Path) -> None:
    with pytest.raises(BundleFileMissing, match="no manifest.json"):
        verify_bundle(bundle_dir)


def test_bad_json_and_wrong_schema_version_are_refused(packed: VerifiedBundle, edit_manifest) -> None:
    manifest = packed.manifest_path
    edit_manifest(packed.root, lambda d: d.update(schema_version=2))
    with pytest.raises(ManifestInvalid, match=f"{manifest}: schema_version 2 is not supported"):
        verify_bundle(packed.root)
    manifest.write_text('{"schema_version": 1,')
    with pytest.raises(ManifestInvalid, match=f"{manifest}: not valid JSON"):
        verify_bundle(packed.root)


@pytest.mark.parametrize(
    ("name", "reason"), [("../weights.bin", "'.' and '..' components"), ("/tmp/w.bin", "absolute paths")]
)
def test_unsafe_names_in_the_manifest_are_refused(packed, edit_manifest, name: str, reason: str) -> None:
    edit_manifest(packed.root, lambda d: d["files"].update({name: "0" * 64}))
    with pytest.raises(BundlePathUnsafe, match=f"manifest.json: files entry '{name}': {reason}"):
        verify_bundle(packed.root)


def test_symlink_leaving_the_bundle_is_refused(packed: VerifiedBundle, tmp_path: Path, edit_manifest) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret")
    (packed.root / "link.bin").symlink_to(outside)
    edit_manifest(packed.root, lambda d: d["files"].update({"link.bin": sha256_file(outside)}))
    with pytest.raises(BundlePathUnsafe, match="link.bin: a symbolic link leads outside the bundle"):
        verify_bundle(packed.root)


def test_directory_symlink_leaving_the_bundle_is_refused(packed: VerifiedBundle, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (packed.root / "sub").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(BundlePathUnsafe, match="sub: a symbolic link leads outside"):
        verify_bundle(packed.root)


def test_symlink_inside_the_bundle_is_a_member_like_any_file(bundle_dir: Path) -> None:
    (bundle_dir / "alias.npz").symlink_to("inputs.npz")
    bundle = pack_bundle(bundle_dir, component="test.matmul")
    assert bundle.manifest.files["alias.npz"] == bundle.manifest.files["inputs.npz"]
    assert verify_bundle(bundle_dir) == bundle


def test_special_files_are_refused(packed: VerifiedBundle) -> None:
    os.mkfifo(packed.root / "pipe")
    with pytest.raises(BundlePathUnsafe, match="pipe: a special file"):
        verify_bundle(packed.root)


def test_custom_ops_library_is_verified_like_any_member(bundle_dir: Path, edit_manifest) -> None:
    (bundle_dir / "libops.so").write_bytes(b"\x7fELF fake library")
    bundle = pack_bundle(
        bundle_dir, component="test.matmul", custom_ops={"library_file": "libops.so", "abi_version": 1, "domain": "og"}
    )
    assert bundle.custom_ops_path == bundle.root / "libops.so"
    assert bundle.manifest.custom_ops.sha256 == sha256_file(bundle_dir / "libops.so")

    edit_manifest(bundle_dir, lambda d: d["custom_ops"].update(sha256="1" * 64))
    with pytest.raises(ManifestInvalid, match=f"custom_ops.sha256 {'1' * 64} disagrees with files\\['libops.so'\\]"):
        verify_bundle(bundle_dir)

    pack_bundle(bundle_dir, component="test.matmul", custom_ops=bundle.manifest.custom_ops)
    (bundle_dir / "libops.so").write_bytes(b"\x7fELF another library")
    with pytest.raises(BundleHashMismatch, match="libops.so: sha256 is"):
        verify_bundle(bundle_dir)


def _repoint_weights(bundle: VerifiedBundle, matmul_model, point_at, location: str) -> None:
    """Rewrite graph.onnx so its weight is external data at `location`."""
    model = matmul_model()
    point_at(model.graph.initializer[0], location)
    onnx.save(model, bundle.graph_path)


@pytest.mark.parametrize(
    ("location", "reason"),
    [
        ("inputs.bin", "reads external data from 'inputs.bin', which is not a file of the bundle"),
        ("../outside.bin", "'.' and '..' components are not allowed"),
        ("/tmp/outside.bin", "absolute paths are not allowed"),
        ("manifest.json", "reads external data from 'manifest.json', which is not a file"),
    ],
)
def test_external_data_outside_the_verified_set_is_refused(
    packed: VerifiedBundle, matmul_model, point_at, edit_manifest, location: str, reason: str
) -> None:
    _repoint_weights(packed, matmul_model, point_at, location)
    edit_manifest(packed.root, lambda d: d["files"].update({"graph.onnx": sha256_file(packed.graph_path)}))
    with pytest.raises(ExternalDataOutsideBundle) as refused:
        verify_bundle(packed.root)
    assert str(refused.value).startswith(f"{packed.graph_path}: ")
    assert reason in str(refused.value)


def test_external_data_hidden_in_a_subgraph_is_checked(tmp_path: Path, point_at) -> None:
    """An If node's branch holds a constant whose data is external: it must be listed too."""
    folder = tmp_path / "bundle"
    folder.mkdir()
    value = numpy_helper.from_array(np.ones(3, np.float32), "branch_value")
    point_at(value, "branch.bin")
    branch = helper.make_graph(
        [helper.make_node("Constant", [], ["out"], value=value)],
        "branch",
        [],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [3])],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["flag"], ["y"], then_branch=branch, else_branch=branch)],
        "conditional",
        [helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "graph.onnx")
    with pytest.raises(ExternalDataOutsideBundle, match="tensor 'branch_value' reads external data from 'branch.bin'"):
        pack_bundle(folder, component="test.if")
    (folder / "branch.bin").write_bytes(np.ones(3, np.float32).tobytes())
    assert pack_bundle(folder, component="test.if").manifest.files.keys() == {"graph.onnx", "branch.bin"}


def test_graph_in_a_subfolder_resolves_external_data_beside_it(tmp_path: Path, matmul_model) -> None:
    folder = tmp_path / "bundle"
    (folder / "model").mkdir(parents=True)
    onnx.save(matmul_model(), folder / "model" / "graph.onnx", save_as_external_data=True, location="w.bin",
              size_threshold=0)
    bundle = pack_bundle(folder, component="test.matmul", graph_file="model/graph.onnx")
    assert set(bundle.manifest.files) == {"model/graph.onnx", "model/w.bin"}
    assert verify_bundle(folder) == bundle


def test_every_listed_onnx_file_is_checked_not_only_the_graph(
    packed: VerifiedBundle, matmul_model, point_at, edit_manifest
) -> None:
    draft = matmul_model()
    point_at(draft.graph.initializer[0], "gone.bin")
    onnx.save(draft, packed.root / "draft.onnx")
    edit_manifest(packed.root, lambda d: d["files"].update({"draft.onnx": sha256_file(packed.root / "draft.onnx")}))
    with pytest.raises(ExternalDataOutsideBundle, match="draft.onnx: tensor 'w' reads external data from 'gone.bin'"):
        verify_bundle(packed.root)


def test_unreadable_graph_is_refused(packed: VerifiedBundle, edit_manifest) -> None:
    packed.graph_path.write_bytes(b"this is not protobuf \xff\xff\xff")
    edit_manifest(packed.root, lambda d: d["files"].update({"graph.onnx": sha256_file(packed.graph_path)}))
    with pytest.raises(BundleError, match="graph.onnx: not a readable ONNX model"):
        verify_bundle(packed.root)
