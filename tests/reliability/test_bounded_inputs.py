"""Bounded inputs (issue 18, findings 12 and 13): deploy YAMLs and manifests are refused, cheaply
and by name, before they can cost unbounded memory or recursion; a bundle member that does not
parse as its name says (a truncated .npz or tokenizer JSON) is refused by pack and verify."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from omnigraph.bundles import ManifestInvalid, pack_bundle, verify_bundle
from omnigraph.bundles.errors import MemberInvalid
from omnigraph.bundles.manifest import MAX_MANIFEST_BYTES
from omnigraph.pipelines.deploy import DeployConfigError, load_deploy_config
from omnigraph.plugin.cli import main as omnigraph_cli

# The first levels of a "billion laughs": each level nine times the one before. Nine levels grew to
# 4.5 GB; three are enough to show that the first alias is refused.
ALIAS_BOMB = "\n".join(
    ["a: &a [x, x, x, x, x, x, x, x, x]"]
    + [f"{level}: &{level} [{', '.join([f'*{below}'] * 9)}]" for below, level in zip("ab", "bc")]
) + "\npipeline: laya\n"


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# ---- deploy YAML -----------------------------------------------------------------------------


def test_a_yaml_alias_bomb_is_refused_at_its_first_alias(tmp_path):
    with pytest.raises(DeployConfigError, match=r"line 2: YAML aliases \(\*a\) are not allowed"):
        load_deploy_config(write(tmp_path / "deploy.yaml", ALIAS_BOMB))


def test_a_key_written_twice_is_refused_naming_the_key_and_both_lines(tmp_path):
    text = "pipeline: laya\nstages:\n  - stage_id: 0\n    num_replicas: 1\n    num_replicas: 4\n"
    with pytest.raises(DeployConfigError, match=r"line 5: duplicate key 'num_replicas' \(first at line 4\)"):
        load_deploy_config(write(tmp_path / "deploy.yaml", text))


def test_a_base_config_that_is_not_a_regular_file_is_refused_before_reading(tmp_path):
    with pytest.raises(DeployConfigError, match=r"/dev/zero: not a regular file"):
        load_deploy_config(write(tmp_path / "deploy.yaml", "base_config: /dev/zero\npipeline: laya\n"))


def test_an_oversized_base_config_is_refused_by_its_size(tmp_path):
    base = write(tmp_path / "base.yaml", "pipeline: laya\n" + "# padding\n" * 200_000)
    with pytest.raises(DeployConfigError, match=rf"{base}: \d+ bytes, more than a deploy YAML may hold"):
        load_deploy_config(write(tmp_path / "deploy.yaml", "base_config: base.yaml\n"))


def test_deeply_nested_yaml_is_refused_with_its_line(tmp_path):
    with pytest.raises(DeployConfigError, match=r"nested deeper than \d+ levels"):
        load_deploy_config(write(tmp_path / "deploy.yaml", "pipeline: " + "[" * 5000 + "]" * 5000 + "\n"))


# ---- manifests -------------------------------------------------------------------------------


@pytest.fixture
def bundle_dir(tmp_path: Path) -> Path:
    """graph.onnx (y = x @ w), its weights in weights.bin, inputs.npz and a tokenizer.json."""
    folder = tmp_path / "bundle"
    folder.mkdir()
    weight = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "tiny",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 3])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, folder / "graph.onnx", save_as_external_data=True, location="weights.bin", size_threshold=0)
    np.savez(folder / "inputs.npz", x=np.ones((4, 2), np.float32))
    vocab = {f"token{i}": i for i in range(200)}
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordLevel", "vocab": vocab}}, indent=1))
    return folder


def pack(folder: Path):
    return pack_bundle(folder, component="test.matmul", example_inputs_file="inputs.npz")


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])


def relist(bundle: Path, name: str) -> None:
    """Record `name`'s current sha256 in the manifest: a bundle repacked after the damage."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"][name] = hashlib.sha256((bundle / name).read_bytes()).hexdigest()
    (bundle / "manifest.json").write_text(json.dumps(manifest))


def test_an_oversized_manifest_is_refused_by_its_size(bundle_dir):
    pack(bundle_dir)
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    manifest["metadata"]["layout"]["padding"] = "x" * MAX_MANIFEST_BYTES
    (bundle_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestInvalid, match="bytes, more than a manifest may hold"):
        verify_bundle(bundle_dir)


def test_a_deeply_nested_manifest_is_refused_before_parsing(bundle_dir):
    pack(bundle_dir)
    manifest = (bundle_dir / "manifest.json").read_text()
    nested = manifest.replace('"layout": {}', '"layout": {"deep": ' + "[" * 100_000 + "]" * 100_000 + "}")
    (bundle_dir / "manifest.json").write_text(nested)
    with pytest.raises(ManifestInvalid, match="nested deeper than"):
        verify_bundle(bundle_dir)


# ---- members ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["inputs.npz", "tokenizer.json"])
def test_pack_refuses_a_truncated_member_and_writes_no_manifest(bundle_dir, name):
    truncate(bundle_dir / name)
    with pytest.raises(MemberInvalid, match=rf"{bundle_dir / name}: not .*truncated or damaged"):
        pack(bundle_dir)
    assert not (bundle_dir / "manifest.json").exists()


@pytest.mark.parametrize("name", ["inputs.npz", "tokenizer.json"])
def test_bundle_verify_refuses_a_bundle_repacked_with_a_truncated_member(bundle_dir, name, capsys):
    pack(bundle_dir)
    truncate(bundle_dir / name)
    relist(bundle_dir, name)
    assert omnigraph_cli(["bundle", "verify", str(bundle_dir)]) == 1
    error = capsys.readouterr().err
    assert f"MemberInvalid: {bundle_dir / name}: not" in error and "truncated or damaged" in error


def test_bundle_verify_refuses_a_weights_file_shorter_than_its_graph_reads(bundle_dir, capsys):
    pack(bundle_dir)
    truncate(bundle_dir / "weights.bin")
    relist(bundle_dir, "weights.bin")
    assert omnigraph_cli(["bundle", "verify", str(bundle_dir)]) == 1
    error = capsys.readouterr().err
    assert f"MemberInvalid: {bundle_dir / 'weights.bin'}: 16 bytes, but tensor 'w'" in error and "truncated" in error
