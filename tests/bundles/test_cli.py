"""`omnigraph bundle pack|verify|inspect` end to end, as a user runs them: exit status and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def omnigraph(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omnigraph.plugin.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_pack_verify_inspect_succeed_on_a_good_folder(bundle_dir: Path) -> None:
    packed = omnigraph(
        "bundle", "pack", str(bundle_dir), "--component", "test.matmul", "--example-inputs", "inputs.npz"
    )
    assert packed.returncode == 0, packed.stderr
    assert packed.stdout.startswith(f"packed {bundle_dir.resolve() / 'manifest.json'} (sha256 ")

    verified = omnigraph("bundle", "verify", str(bundle_dir))
    assert verified.returncode == 0, verified.stderr
    assert "ok " in verified.stdout and "(3 files, sha256 " in verified.stdout

    table = omnigraph("bundle", "inspect", str(bundle_dir))
    assert table.returncode == 0, table.stderr
    assert "component    test.matmul" in table.stdout

    as_json = omnigraph("bundle", "inspect", str(bundle_dir / "manifest.json"), "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["metadata"]["example_inputs_file"] == "inputs.npz"


@pytest.mark.parametrize(
    ("damage", "command", "error"),
    [
        (lambda root: (root / "weights.bin").write_bytes(b"\0" * 24), "verify", "BundleHashMismatch"),
        (lambda root: (root / "notes.txt").write_text("x"), "verify", "BundleUnlistedFile"),
        (lambda root: (root / "inputs.npz").unlink(), "inspect", "BundleFileMissing"),
        (lambda root: (root / "manifest.json").write_text("{"), "inspect", "ManifestInvalid"),
    ],
)
def test_a_damaged_bundle_fails_with_one_line(packed, damage, command: str, error: str) -> None:
    damage(packed.root)
    result = omnigraph("bundle", command, str(packed.root))
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith(f"omnigraph: error: {error}: ")
    assert result.stderr.count("\n") == 1


def test_pack_refusal_is_one_line_and_writes_nothing(bundle_dir: Path) -> None:
    result = omnigraph("bundle", "pack", str(bundle_dir), "--component", "test.matmul", "--graph", "model.onnx")
    assert result.returncode == 1
    assert result.stderr == (
        f"omnigraph: error: BundleFileMissing: graph_file 'model.onnx' is not a file in {bundle_dir.resolve()}\n"
    )
    assert not (bundle_dir / "manifest.json").exists()
