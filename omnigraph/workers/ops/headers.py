"""The ONNX Runtime C/C++ headers the op library compiles against.

No Python wheel ships them; Debian's `libonnxruntime-dev` (suite trixie, ORT 1.21) does, and the
C API is backward compatible, so a library built against them loads into later runtimes. They are
taken from `ORT_INCLUDE_DIR` when set, else downloaded once with apt from the Debian mirror this
machine's apt already uses (a temporary sources list adding trixie; nothing is installed) and
unpacked into the cache.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["OrtHeadersError", "ort_include_dir"]

_REQUIRED = ("onnxruntime_c_api.h", "onnxruntime_cxx_api.h")
_PACKAGE = "libonnxruntime-dev"
_SUITE = "trixie"


class OrtHeadersError(RuntimeError):
    """The ORT headers could not be found or fetched."""


def _has_headers(directory: Path) -> bool:
    return all((directory / name).is_file() for name in _REQUIRED)


def _debian_mirror() -> str:
    """The first non-security Debian mirror apt is configured with (deb822 or one-line format)."""
    deb822 = Path("/etc/apt/sources.list.d/debian.sources")
    if deb822.is_file():
        for uri in re.findall(r"^URIs:\s*(\S+)", deb822.read_text(), flags=re.MULTILINE):
            if "security" not in uri:
                return uri
    one_line = Path("/etc/apt/sources.list")
    if one_line.is_file():
        for line in one_line.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3 and fields[0] == "deb" and "security" not in fields[2]:
                return next(field for field in fields[1:] if "://" in field)
    raise OrtHeadersError("no Debian mirror configured for apt; set ORT_INCLUDE_DIR to the ONNX Runtime headers")


def _fetch_into(dest: Path) -> None:
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise OrtHeadersError(f"{tool} not found; set ORT_INCLUDE_DIR to the ONNX Runtime headers")
    with tempfile.TemporaryDirectory(prefix="omnigraph-ort-headers-") as tmp:
        work = Path(tmp)
        (work / "lists" / "partial").mkdir(parents=True)
        (work / "cache" / "archives" / "partial").mkdir(parents=True)
        (work / "sources.list").write_text(f"deb [trusted=yes] {_debian_mirror()} {_SUITE} main\n")
        options = [
            "-o", f"Dir::Etc::SourceList={work / 'sources.list'}",
            "-o", "Dir::Etc::SourceParts=/nonexistent",
            "-o", f"Dir::State::Lists={work / 'lists'}",
            "-o", f"Dir::Cache={work / 'cache'}",  # no write to the system's apt cache
        ]  # fmt: skip
        for step in (["update"], ["download", _PACKAGE]):
            result = subprocess.run(["apt-get", *options, "-qq", *step], cwd=work, capture_output=True, text=True)
            if result.returncode != 0:
                raise OrtHeadersError(f"apt-get {' '.join(step)} failed: {result.stderr.strip()[-500:]}")
        debs = sorted(work.glob(f"{_PACKAGE}_*.deb"))
        if not debs:
            raise OrtHeadersError(f"apt-get download {_PACKAGE} produced no .deb")
        subprocess.run(["dpkg", "-x", str(debs[0]), str(work / "x")], check=True, capture_output=True)
        source = work / "x" / "usr" / "include" / "onnxruntime"
        if not _has_headers(source):
            raise OrtHeadersError(f"{debs[0].name} holds no {', '.join(_REQUIRED)}")
        shutil.copytree(source, dest)


def ort_include_dir(cache_root: Path) -> Path:
    """`ORT_INCLUDE_DIR`, else the headers cached under `cache_root/ort-headers` (fetched once)."""
    configured = os.environ.get("ORT_INCLUDE_DIR")
    if configured:
        directory = Path(configured)
        if not _has_headers(directory):
            raise OrtHeadersError(f"ORT_INCLUDE_DIR={configured} lacks {' or '.join(_REQUIRED)}")
        return directory
    cached = cache_root / "ort-headers"
    if _has_headers(cached):
        return cached
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".ort-headers-", dir=cache_root))
    try:
        _fetch_into(staging / "include")
        try:
            os.rename(staging / "include", cached)
        except OSError:
            if not _has_headers(cached):  # lost a race to a complete copy: fine; anything else: raise
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return cached
