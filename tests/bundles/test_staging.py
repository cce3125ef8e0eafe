"""staged_bundle_dir: a bundle folder appears whole, or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnigraph.bundles import staged_bundle_dir


def test_success_renames_the_staged_folder_onto_out(tmp_path: Path) -> None:
    out = tmp_path / "cache" / "bundle"
    with staged_bundle_dir(out) as staging:
        assert staging.parent == out.parent and staging.is_dir() and not out.exists()
        (staging / "graph.onnx").write_bytes(b"g")
    assert (out / "graph.onnx").read_bytes() == b"g"
    assert sorted(path.name for path in out.parent.iterdir()) == ["bundle"]


def test_failure_removes_the_staged_folder(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    with pytest.raises(RuntimeError, match="export failed"):
        with staged_bundle_dir(out) as staging:
            (staging / "half.bin").write_bytes(b"h")
            raise RuntimeError("export failed")
    assert list(tmp_path.iterdir()) == []


def test_existing_out_is_refused_unless_replace(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    out.mkdir()
    (out / "old.bin").write_bytes(b"old")
    with pytest.raises(FileExistsError, match="already exists"):
        with staged_bundle_dir(out):
            pass
    with staged_bundle_dir(out, replace=True) as staging:
        (staging / "new.bin").write_bytes(b"new")
    assert [path.name for path in out.iterdir()] == ["new.bin"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bundle"]


def test_out_appearing_during_the_export_is_left_untouched(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    with pytest.raises(FileExistsError, match="appeared while the bundle was being written"):
        with staged_bundle_dir(out) as staging:
            (staging / "mine.bin").write_bytes(b"mine")
            out.mkdir()
            (out / "theirs.bin").write_bytes(b"theirs")
    assert [path.name for path in out.iterdir()] == ["theirs.bin"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bundle"]


def test_a_file_in_the_way_is_never_replaced(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    out.write_text("not a folder")
    with pytest.raises(FileExistsError, match="is not a folder"):
        with staged_bundle_dir(out, replace=True):
            pass
    assert out.read_text() == "not a folder"
