"""The CLI and the embedded demo: `omnigraph bundle synth|build cua_s1` and `default_bundle()`."""

from __future__ import annotations

from omnigraph.bundles import verify_bundle
from omnigraph.pipelines.cua_s1.pipeline import CUA_S1_PIPELINE
from omnigraph.pipelines.registry import get_pipeline
from omnigraph.plugin.cli import main


def test_the_installed_entry_point_names_the_declaration():
    assert get_pipeline("cua_s1") == CUA_S1_PIPELINE


def test_synth_then_build_from_the_command_line(tmp_path, capsys):
    checkpoint, bundle = tmp_path / "checkpoint", tmp_path / "bundle"
    assert main(["bundle", "synth", "cua_s1", "--size", "tiny", "--seed", "3", "--out", str(checkpoint)]) == 0
    assert main(["bundle", "build", "cua_s1", "--checkpoint", str(checkpoint), "--out", str(bundle)]) == 0
    assert verify_bundle(bundle).manifest.component == "cua_s1.head"
    assert f"sha256 {verify_bundle(bundle).manifest_sha256}" in capsys.readouterr().out


def test_unsupported_size_and_precision_fail_with_one_line(tmp_path, capsys):
    assert main(["bundle", "synth", "cua_s1", "--size", "full", "--out", str(tmp_path / "c")]) != 0
    assert "unknown Cua-S1 checkpoint size 'full'" in capsys.readouterr().err
    assert main(["bundle", "build", "cua_s1", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "b"),
                 "--precision", "bf16"]) != 0
    assert "precision must be one of fp32" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_default_bundle_is_built_once_into_the_cache(tmp_path, monkeypatch):
    from omnigraph.pipelines.cua_s1.export import default_bundle

    monkeypatch.setenv("OMNIGRAPH_CACHE", str(tmp_path))
    first = default_bundle()
    assert first.is_relative_to(tmp_path / "bundles")
    stamp = (first / "manifest.json").stat().st_mtime_ns
    assert default_bundle() == first and (first / "manifest.json").stat().st_mtime_ns == stamp
    assert verify_bundle(first).manifest.metadata.layout["hidden_size"] == 128
