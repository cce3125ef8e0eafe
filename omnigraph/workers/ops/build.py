"""Compile the omnigraph custom-op library and write it beside its build manifest.

With nvcc (`$OMNIGRAPH_NVCC`, `/usr/local/cuda/bin/nvcc`, or on PATH) the library holds the CPU
kernels and the CUDA kernels, built for `sm_<arch>` plus portable `compute_80` PTX; the CUDA
runtime is linked statically, so the same file also loads (CPU kernels only) where no GPU or CUDA
runtime exists. Without nvcc, or with `cuda=False`, the C++ compiler builds the CPU kernels alone
(the CUDA code is compiled out by the OMNIGRAPH_OPS_WITH_CUDA macro).

Builds are cached under `$OMNIGRAPH_CACHE/ops/<sha256 of sources, headers, compiler and flags>`,
built in a temporary folder and renamed into place, never modified after.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from omnigraph.bundles.defaults import cache_root
from omnigraph.bundles.hashing import sha256_file
from omnigraph.workers.ops.headers import ort_include_dir
from omnigraph.workers.ops.loader import DOMAIN, SUPPORTED_ABI_VERSION, library_info

__all__ = ["LIBRARY_NAME", "MANIFEST_NAME", "BuiltLibrary", "OpsBuildError", "build_library", "find_nvcc"]

LIBRARY_NAME = "libomnigraph_ops.so"
MANIFEST_NAME = "libomnigraph_ops.json"
OPS = ("ModernBertAttention", "GeGLU", "AddLayerNorm")
_CSRC = Path(__file__).with_name("csrc")
_CPU_SOURCES = ("custom_ops.cc", "kernels_cpu.cc")
_CUDA_SOURCES = ("kernels_cuda.cu",)
_HEADERS = ("kernels.h",)
_PORTABLE_PTX = "80"
_CXX_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden")
_CUDA_MACRO = "-DOMNIGRAPH_OPS_WITH_CUDA"
_NVCC_FLAGS = ("-std=c++17", "-O3", "-Xcompiler", "-fPIC,-fvisibility=hidden", _CUDA_MACRO)


class OpsBuildError(RuntimeError):
    """The library could not be built; the message holds the failing command's output."""


@dataclass(frozen=True)
class BuiltLibrary:
    library_path: Path
    library_sha256: str
    manifest_path: Path


def _cache_root() -> Path:
    return cache_root() / "ops"


def find_nvcc() -> Path | None:
    """nvcc from `$OMNIGRAPH_NVCC`, `/usr/local/cuda/bin/nvcc`, or PATH; None when absent."""
    configured = os.environ.get("OMNIGRAPH_NVCC")
    if configured:
        if not os.access(configured, os.X_OK):
            raise OpsBuildError(f"OMNIGRAPH_NVCC={configured} is not an executable")
        return Path(configured)
    default = Path("/usr/local/cuda/bin/nvcc")
    if os.access(default, os.X_OK):
        return default
    found = shutil.which("nvcc")
    return Path(found) if found else None


def _find_cxx() -> Path:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and (found := shutil.which(name)):
            return Path(found)
    raise OpsBuildError("no C++ compiler found (set CXX)")


def _version(compiler: Path) -> str:
    result = subprocess.run([str(compiler), "--version"], capture_output=True, text=True)
    if result.returncode != 0:
        raise OpsBuildError(f"{compiler} --version failed: {result.stderr.strip()}")
    return result.stdout.strip()


def _check_arch(arch: str) -> None:
    match = re.fullmatch(r"(\d{2,3})[af]?", arch)
    if match is None or int(match.group(1)) < int(_PORTABLE_PTX):
        raise OpsBuildError(f"arch must be a compute capability of 80 or above such as 90a, got {arch!r}")


def _commands(
    compilers: tuple[Path, Path | None], include: Path, arch: str | None, build_dir: Path, csrc: Path = _CSRC
) -> list[list[str]]:
    """The compile and link commands for (C++ compiler, nvcc); `arch` None means the CPU-only build.

    Host sources always go through the C++ compiler, so the only device code in the library is the
    kernels' own (sm_<arch> and compute_80 PTX); nvcc compiles the .cu file and links.
    """
    cxx, nvcc = compilers
    library = str(build_dir / LIBRARY_NAME)
    if arch is None:
        sources = [str(csrc / name) for name in _CPU_SOURCES]
        return [[str(cxx), *_CXX_FLAGS, "-shared", f"-I{include}", *sources, "-o", library]]
    assert nvcc is not None
    gencode = [
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        f"-gencode=arch=compute_{_PORTABLE_PTX},code=compute_{_PORTABLE_PTX}",
    ]
    commands, objects = [], []
    for name in _CPU_SOURCES:
        objects.append(str(build_dir / (name + ".o")))
        commands.append([str(cxx), *_CXX_FLAGS, _CUDA_MACRO, f"-I{include}", "-c", str(csrc / name), "-o", objects[-1]])
    for name in _CUDA_SOURCES:
        objects.append(str(build_dir / (name + ".o")))
        commands.append([str(nvcc), *_NVCC_FLAGS, *gencode, "-c", str(csrc / name), "-o", objects[-1]])
    commands.append([str(nvcc), "-shared", "--cudart", "static", *objects, "-o", library])
    return commands


def _source_hashes(cuda: bool) -> dict[str, str]:
    names = (*_CPU_SOURCES, *(_CUDA_SOURCES if cuda else ()), *_HEADERS)
    return {name: sha256_file(_CSRC / name) for name in sorted(names)}


def _compile(commands: list[list[str]]) -> None:
    for command in commands:
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            output = (result.stdout + result.stderr).strip()
            raise OpsBuildError(f"{' '.join(command)} failed (exit {result.returncode}):\n{output[-4000:]}")


def _build_into_cache(arch: str | None) -> Path:
    """The cached folder holding the library and its manifest, building it on a miss."""
    cache = _cache_root()
    include = ort_include_dir(cache)
    cxx = _find_cxx()
    nvcc = None
    if arch is not None:
        nvcc = find_nvcc()
        if nvcc is None:
            raise OpsBuildError("nvcc not found (set OMNIGRAPH_NVCC or build with cuda=False)")
    compilers = (cxx, nvcc)
    sources = _source_hashes(cuda=arch is not None)
    headers_sha256 = sha256_file(include / "onnxruntime_c_api.h")
    versions = {str(tool): _version(tool) for tool in compilers if tool is not None}
    flags = _commands(compilers, Path("ORT_INCLUDE"), arch, Path("BUILD"), Path("CSRC"))  # location-free
    key_material = json.dumps(
        {"sources": sources, "ort_c_api_h": headers_sha256, "compilers": versions, "commands": flags},
        sort_keys=True,
    )
    target = cache / hashlib.sha256(key_material.encode()).hexdigest()[:32]
    if (target / MANIFEST_NAME).is_file():
        return target

    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=cache))
    try:
        commands = _commands(compilers, include, arch, staging)
        _compile(commands)
        library = staging / LIBRARY_NAME
        info = library_info(library)
        if info.abi_version != SUPPORTED_ABI_VERSION:
            raise OpsBuildError(
                f"the sources declare ABI {info.abi_version} but loader.SUPPORTED_ABI_VERSION is "
                f"{SUPPORTED_ABI_VERSION}: bump both together"
            )
        manifest = {
            "name": "omnigraph_ops",
            "domain": DOMAIN,
            "ops": list(OPS),
            "abi_version": info.abi_version,
            "library_file": LIBRARY_NAME,
            "library_sha256": sha256_file(library),
            "backend": "cpu" if arch is None else "cuda",
            "architectures": [] if arch is None else [f"sm_{arch}", f"compute_{_PORTABLE_PTX}"],
            "cuda_runtime": None if arch is None else "static",
            "compilers": versions,
            "commands": flags,
            "sources": sources,
            "ort_headers": {"onnxruntime_c_api.h": headers_sha256},
        }
        for obj in staging.glob("*.o"):
            obj.unlink()
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / MANIFEST_NAME).is_file():  # another process built the same key first: fine
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _install(source: Path, out: Path) -> None:
    """Copies `source` into `out` under a temporary name, then renames it over its final name."""
    fd, tmp = tempfile.mkstemp(prefix=f".{source.name}.", dir=out)
    os.close(fd)
    try:
        shutil.copyfile(source, tmp)
        os.chmod(tmp, 0o755 if source.suffix == ".so" else 0o644)
        os.replace(tmp, out / source.name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_library(out: Path, arch: str = "90a", *, cuda: bool | None = None) -> BuiltLibrary:
    """Builds (or takes from the cache) the op library and writes it and its manifest into `out`.

    `cuda=None` builds the CUDA library when nvcc is found and the CPU-only one otherwise;
    `cuda=True` requires nvcc; `cuda=False` always builds the CPU-only library.
    """
    _check_arch(arch)
    if cuda is None:
        cuda = find_nvcc() is not None
    built = _build_into_cache(arch if cuda else None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _install(built / LIBRARY_NAME, out)
    _install(built / MANIFEST_NAME, out)  # last: a manifest in `out` means its library is complete
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    return BuiltLibrary(
        library_path=out / LIBRARY_NAME, library_sha256=manifest["library_sha256"], manifest_path=out / MANIFEST_NAME
    )
