"""build_library: the CPU-only and nvcc builds, their manifests, the cache, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnigraph.bundles.hashing import sha256_file
from omnigraph.plugin.cli import main as cli_main
from omnigraph.workers.ops import build
from omnigraph.workers.ops.build import LIBRARY_NAME, MANIFEST_NAME, OpsBuildError, build_library
from omnigraph.workers.ops.headers import OrtHeadersError, ort_include_dir
from omnigraph.workers.ops.loader import SUPPORTED_ABI_VERSION, library_info


def test_cpu_build_writes_library_and_manifest(cpu_library):
    manifest = json.loads(cpu_library.manifest_path.read_text())
    assert cpu_library.library_path.name == LIBRARY_NAME
    assert cpu_library.manifest_path == cpu_library.library_path.with_name(MANIFEST_NAME)
    assert sha256_file(cpu_library.library_path) == cpu_library.library_sha256 == manifest["library_sha256"]
    assert manifest["abi_version"] == SUPPORTED_ABI_VERSION
    assert manifest["backend"] == "cpu" and manifest["architectures"] == []
    assert manifest["domain"] == "omnigraph"
    assert set(manifest["ops"]) == {"ModernBertAttention", "GeGLU", "AddLayerNorm"}
    assert set(manifest["sources"]) == {"custom_ops.cc", "kernels_cpu.cc", "kernels.h"}
    source_dir = Path(__file__).parents[2] / "omnigraph" / "workers" / "ops" / "csrc"
    assert manifest["sources"]["kernels_cpu.cc"] == sha256_file(source_dir / "kernels_cpu.cc")
    assert library_info(cpu_library.library_path).has_cuda is False


def test_cuda_build_records_architectures_and_static_runtime(cuda_library):
    manifest = json.loads(cuda_library.manifest_path.read_text())
    assert manifest["backend"] == "cuda"
    assert manifest["architectures"] == ["sm_90a", "compute_80"]
    assert manifest["cuda_runtime"] == "static"
    assert "kernels_cuda.cu" in manifest["sources"]
    nvcc_commands = [command for command in manifest["commands"] if "kernels_cuda.cu" in " ".join(command)]
    assert "-gencode=arch=compute_90a,code=sm_90a" in nvcc_commands[0]
    assert "-gencode=arch=compute_80,code=compute_80" in nvcc_commands[0]
    info = library_info(cuda_library.library_path)
    assert info.has_cuda is True and info.abi_version == SUPPORTED_ABI_VERSION


def test_second_build_comes_from_the_cache(cpu_library, tmp_path, monkeypatch):
    def no_compile(commands):
        raise AssertionError(f"compiled although cached: {commands}")

    monkeypatch.setattr(build, "_compile", no_compile)
    again = build_library(tmp_path / "again", cuda=False)
    assert again.library_sha256 == cpu_library.library_sha256
    assert again.manifest_path.read_bytes() == cpu_library.manifest_path.read_bytes()


def test_cold_build_lands_atomically_in_a_fresh_cache(cpu_library, tmp_path, monkeypatch):
    monkeypatch.setenv("ORT_INCLUDE_DIR", str(ort_include_dir(build._cache_root())))
    monkeypatch.setenv("OMNIGRAPH_CACHE", str(tmp_path / "cache"))
    built = build_library(tmp_path / "out", cuda=False)
    entries = list((tmp_path / "cache" / "ops").iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith(".")  # no staging folder left behind
    assert sorted(path.name for path in entries[0].iterdir()) == [MANIFEST_NAME, LIBRARY_NAME]
    assert sha256_file(entries[0] / LIBRARY_NAME) == built.library_sha256


def test_rebuild_into_the_same_folder_replaces_files(cpu_library, tmp_path):
    first = build_library(tmp_path, cuda=False)
    second = build_library(tmp_path, cuda=False)
    assert first == second
    assert sorted(path.name for path in tmp_path.iterdir()) == [MANIFEST_NAME, LIBRARY_NAME]


@pytest.mark.parametrize("arch", ["", "75", "sm_90", "90b", "9"])
def test_bad_arch_is_refused_before_building(arch, tmp_path):
    with pytest.raises(OpsBuildError, match="arch must be a compute capability of 80 or above"):
        build_library(tmp_path / "out", arch=arch, cuda=False)
    assert not (tmp_path / "out").exists()


def test_missing_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("OMNIGRAPH_NVCC", str(tmp_path / "no-nvcc"))
    with pytest.raises(OpsBuildError, match="OMNIGRAPH_NVCC=.*no-nvcc is not an executable"):
        build_library(tmp_path / "out", cuda=True)


def test_bad_ort_include_dir_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("ORT_INCLUDE_DIR", str(tmp_path))
    with pytest.raises(OrtHeadersError, match="lacks onnxruntime_c_api.h"):
        build_library(tmp_path / "out", cuda=False)


def test_cli_ops_build(cuda_library, tmp_path, capsys):
    """`omnigraph ops build` builds the nvcc library (cached by the fixture) into --out."""
    assert cli_main(["ops", "build", "--arch", "90a", "--out", str(tmp_path)]) == 0
    assert f"built {tmp_path / LIBRARY_NAME} (sha256 {cuda_library.library_sha256})" in capsys.readouterr().out
