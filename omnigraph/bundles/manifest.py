"""The bundle manifest: manifest.json parsed into frozen dataclasses, validated once on construction.

manifest.json lists every file of a bundle with its sha256 (paths relative to the manifest) and says
what the bundle is (`component`) and how it was made (`metadata`). Anything the schema does not
name is refused rather than ignored, so a typo cannot silently change what a worker loads.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from omnigraph.bundles.errors import BundleError, BundleFileMissing, ManifestInvalid
from omnigraph.bundles.hashing import FileIdentity, is_sha256_hex
from omnigraph.bundles.paths import MANIFEST_NAME, check_member_name
from omnigraph.bundles.strict_json import loads_strict

SCHEMA_VERSION = 1
# Why: a manifest lists file names, hashes and small metadata (the Laya bundle's is under 8 KiB);
# the limit stops an oversized one from costing gigabytes of parser memory before it is refused.
MAX_MANIFEST_BYTES = 1 << 20
# Why: the schema nests at most a few levels (metadata.layout holds small tables); deeper text is
# refused before the recursive JSON parser runs.
MAX_MANIFEST_DEPTH = 32
PRECISIONS = ("fp32", "fp16", "bf16")
_COMPONENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class CustomOpsEntry:
    """The custom-operator library a bundle's graph needs (a member file, checked like any other)."""

    library_file: str
    abi_version: int
    sha256: str
    domain: str

    def __post_init__(self) -> None:
        check_member_name(self.library_file, what="custom_ops.library_file")
        if type(self.abi_version) is not int or self.abi_version < 0:
            raise ManifestInvalid(f"custom_ops.abi_version must be a non-negative integer, got {self.abi_version!r}")
        if not is_sha256_hex(self.sha256):
            raise ManifestInvalid(f"custom_ops.sha256 must be 64 lowercase hex digits, got {self.sha256!r}")
        _require_text(self.domain, "custom_ops.domain")

    @classmethod
    def from_dict(cls, data: object) -> CustomOpsEntry:
        return cls(**_exact_keys(data, "custom_ops", required=_field_names(cls)))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BundleMetadata:
    """How a bundle was made and how to use it; the JSON objects are copied so they cannot drift."""

    graph_file: str
    example_inputs_file: str | None
    checkpoint_revision: str
    precision: str
    layout: dict[str, Any]
    exporter: dict[str, Any]
    calibration: dict[str, Any]
    validation: dict[str, Any]

    def __post_init__(self) -> None:
        check_member_name(self.graph_file, what="metadata.graph_file")
        if self.example_inputs_file is not None:
            check_member_name(self.example_inputs_file, what="metadata.example_inputs_file")
        _require_text(self.checkpoint_revision, "metadata.checkpoint_revision")
        if self.precision not in PRECISIONS:
            raise ManifestInvalid(f"metadata.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        for name in ("layout", "exporter", "calibration", "validation"):
            object.__setattr__(self, name, _json_object_copy(getattr(self, name), f"metadata.{name}"))
        _require_text(self.exporter.get("name"), "metadata.exporter.name")

    @classmethod
    def from_dict(cls, data: object) -> BundleMetadata:
        return cls(**_exact_keys(data, "metadata", required=_field_names(cls)))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Manifest:
    """A whole manifest.json; construction checks that the parts agree with each other."""

    schema_version: int
    component: str
    files: dict[str, str]
    metadata: BundleMetadata
    custom_ops: CustomOpsEntry | None = None

    def __post_init__(self) -> None:
        if type(self.schema_version) is not int:
            raise ManifestInvalid(f"schema_version must be an integer, got {self.schema_version!r}")
        if self.schema_version != SCHEMA_VERSION:
            raise ManifestInvalid(
                f"schema_version {self.schema_version} is not supported (this omnigraph reads {SCHEMA_VERSION})"
            )
        if not isinstance(self.component, str) or not _COMPONENT.fullmatch(self.component):
            raise ManifestInvalid(
                f"component must be a name of letters, digits and '_.-' such as 'laya.decision', got {self.component!r}"
            )
        if not isinstance(self.files, dict) or not self.files:
            raise ManifestInvalid(f"files must be a non-empty object of path -> sha256, got {self.files!r}")
        for name, digest in self.files.items():
            check_member_name(name, what="files entry")
            if name == MANIFEST_NAME:
                raise ManifestInvalid(f"files: {MANIFEST_NAME!r} cannot list itself")
            if not is_sha256_hex(digest):
                raise ManifestInvalid(f"files[{name!r}]: sha256 must be 64 lowercase hex digits, got {digest!r}")
        object.__setattr__(self, "files", dict(sorted(self.files.items())))
        if not isinstance(self.metadata, BundleMetadata):
            raise ManifestInvalid(f"metadata must be a BundleMetadata, got {type(self.metadata).__name__}")
        self._require_listed(self.metadata.graph_file, "metadata.graph_file")
        if self.metadata.example_inputs_file is not None:
            self._require_listed(self.metadata.example_inputs_file, "metadata.example_inputs_file")
        if self.custom_ops is not None:
            if not isinstance(self.custom_ops, CustomOpsEntry):
                raise ManifestInvalid(f"custom_ops must be a CustomOpsEntry, got {type(self.custom_ops).__name__}")
            library = self.custom_ops.library_file
            self._require_listed(library, "custom_ops.library_file")
            if self.custom_ops.sha256 != self.files[library]:
                raise ManifestInvalid(
                    f"custom_ops.sha256 {self.custom_ops.sha256} disagrees with "
                    f"files[{library!r}] {self.files[library]}"
                )

    def _require_listed(self, name: str, field: str) -> None:
        if name not in self.files:
            raise ManifestInvalid(f"{field} {name!r} is not among the listed files")

    @classmethod
    def from_dict(cls, data: object) -> Manifest:
        """Build from parsed JSON, refusing missing and unknown keys."""
        values = _exact_keys(
            data, "manifest", required=("schema_version", "component", "files", "metadata"), optional=("custom_ops",)
        )
        values["metadata"] = BundleMetadata.from_dict(values["metadata"])
        custom_ops = values.pop("custom_ops", None)
        return cls(**values, custom_ops=None if custom_ops is None else CustomOpsEntry.from_dict(custom_ops))

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "schema_version": self.schema_version,
            "component": self.component,
            "files": dict(self.files),
            "metadata": self.metadata.to_dict(),
        }
        if self.custom_ops is not None:
            data["custom_ops"] = self.custom_ops.to_dict()
        return data

    def to_json(self) -> str:
        """The canonical manifest.json text (sorted keys, two-space indent, final newline)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n"


def manifest_location(path: str | os.PathLike[str]) -> Path:
    """The manifest.json of `path`, which is a bundle folder or that file itself."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    elif path.name != MANIFEST_NAME and path.exists():
        raise ManifestInvalid(f"{path}: expected a bundle folder or its {MANIFEST_NAME}")
    if not path.exists():
        raise BundleFileMissing(f"{path}: no {MANIFEST_NAME} (`omnigraph bundle pack DIR` writes one)")
    return path


def parse_manifest(data: bytes, *, source: str) -> Manifest:
    """Parse manifest.json bytes; errors start with `source` (the manifest's path)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestInvalid(f"{source}: {len(data)} bytes, more than a manifest may hold ({MAX_MANIFEST_BYTES})")
    try:
        text = data.decode("utf-8")
        document = loads_strict(text, max_depth=MAX_MANIFEST_DEPTH)
    except ValueError as exc:  # also UnicodeDecodeError and JSONDecodeError
        raise ManifestInvalid(f"{source}: not valid JSON: {exc}") from None
    try:
        return Manifest.from_dict(document)
    except BundleError as exc:
        raise type(exc)(f"{source}: {exc}") from None


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Parse and validate the manifest of a bundle folder (or a manifest.json) without checking files."""
    location = manifest_location(path)
    return parse_manifest(read_manifest_bytes(location)[0], source=str(location))


def read_manifest_bytes(path: Path) -> tuple[bytes, FileIdentity]:
    """manifest.json's bytes and identity, refusing a file over MAX_MANIFEST_BYTES before reading it."""
    with open(path, "rb") as handle:
        status = os.fstat(handle.fileno())
        if status.st_size > MAX_MANIFEST_BYTES:
            raise ManifestInvalid(
                f"{path}: {status.st_size} bytes, more than a manifest may hold ({MAX_MANIFEST_BYTES})"
            )
        return handle.read(MAX_MANIFEST_BYTES + 1), FileIdentity.of(status)


def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(field.name for field in fields(cls))


def _exact_keys(
    data: object, where: str, *, required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ManifestInvalid(f"{where} must be a JSON object, got {type(data).__name__}")
    missing = [key for key in required if key not in data]
    if missing:
        raise ManifestInvalid(f"{where}: missing key {missing[0]!r}")
    unknown = sorted(key for key in data if key not in required and key not in optional)
    if unknown:
        raise ManifestInvalid(f"{where}: unknown key {unknown[0]!r} (expected {', '.join(required + optional)})")
    return dict(data)


def _require_text(value: object, field: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ManifestInvalid(f"{field} must be a non-empty string, got {value!r}")


def _json_object_copy(value: object, field: str) -> dict[str, Any]:
    """A detached copy of a JSON object, refusing values JSON cannot hold (NaN, arbitrary objects)."""
    if not isinstance(value, dict):
        raise ManifestInvalid(f"{field} must be a JSON object, got {type(value).__name__}")
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ManifestInvalid(f"{field} is not plain JSON: {exc}") from None
