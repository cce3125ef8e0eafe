"""Worker-side checks before the op library is handed to ONNX Runtime.

A bundle that needs the omnigraph ops names its library in the manifest's `custom_ops` entry
(file, sha256, ABI version, domain). Before `SessionOptions.register_custom_ops_library(path)`, the
worker re-hashes the file (it may have changed since the bundle was verified), checks that the
entry's ABI and domain are the ones this code speaks, and asks the binary its own ABI version.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from omnigraph.bundles.hashing import sha256_file

if TYPE_CHECKING:
    from omnigraph.bundles import VerifiedBundle

__all__ = [
    "DOMAIN",
    "SUPPORTED_ABI_VERSION",
    "OpsLibraryError",
    "OpsLibraryInfo",
    "checked_library_path",
    "custom_ops_library",
    "library_info",
]

# The ABI (op names, inputs, outputs, attributes, semantics) this Python code was written for;
# equal to kAbiVersion in csrc/kernels.h.
SUPPORTED_ABI_VERSION = 1
DOMAIN = "omnigraph"


class OpsLibraryError(RuntimeError):
    """The op library is missing, altered, or speaks another ABI; the message names the file."""


@dataclass(frozen=True)
class OpsLibraryInfo:
    """What the binary says about itself."""

    abi_version: int
    has_cuda: bool


def library_info(path: Path) -> OpsLibraryInfo:
    """Loads the library (it links no GPU library dynamically, so this works without a GPU) and
    reads its exported ABI version and whether its CUDA kernels are compiled in."""
    try:
        library = ctypes.CDLL(str(path))
        abi = library.OmnigraphOpsAbiVersion
        has_cuda = library.OmnigraphOpsHasCuda
    except (OSError, AttributeError) as exc:
        raise OpsLibraryError(f"{path}: not an omnigraph op library: {exc}") from exc
    abi.restype = ctypes.c_int
    has_cuda.restype = ctypes.c_int
    return OpsLibraryInfo(abi_version=int(abi()), has_cuda=bool(has_cuda()))


def checked_library_path(path: Path, *, sha256: str, abi_version: int, domain: str = DOMAIN) -> Path:
    """The library path to register with ORT, once its bytes, ABI and domain are the expected ones.

    `sha256`, `abi_version` and `domain` come from the bundle's `custom_ops` manifest entry
    (`CustomOpsEntry`); the path is `VerifiedBundle.custom_ops_path`.
    """
    path = Path(path)
    if not path.is_file():
        raise OpsLibraryError(f"{path}: op library not found")
    if domain != DOMAIN:
        raise OpsLibraryError(f"{path}: the manifest names domain {domain!r}; this worker knows {DOMAIN!r}")
    if abi_version != SUPPORTED_ABI_VERSION:
        raise OpsLibraryError(
            f"{path}: the manifest says ABI version {abi_version}; this worker speaks {SUPPORTED_ABI_VERSION}"
        )
    actual = sha256_file(path)
    if actual != sha256:
        raise OpsLibraryError(f"{path}: sha256 {actual} does not match the manifest's {sha256}")
    binary_abi = library_info(path).abi_version
    if binary_abi != abi_version:
        raise OpsLibraryError(f"{path}: the binary reports ABI version {binary_abi}, the manifest {abi_version}")
    return path


def custom_ops_library(bundle: VerifiedBundle) -> Path | None:
    """The checked library path of a verified bundle's `custom_ops` entry; None if it needs none.

    The worker registers the result: `SessionOptions.register_custom_ops_library(str(path))`.
    """
    entry = bundle.manifest.custom_ops
    if entry is None:
        return None
    assert bundle.custom_ops_path is not None  # set whenever the manifest has the entry
    return checked_library_path(
        bundle.custom_ops_path, sha256=entry.sha256, abi_version=entry.abi_version, domain=entry.domain
    )
