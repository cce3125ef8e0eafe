"""Bundle verification: the check every stage (and every worker) runs before trusting a bundle."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from omnigraph.bundles.errors import BundleFileMissing, BundleHashMismatch
from omnigraph.bundles.external_data import check_external_data, graph_members
from omnigraph.bundles.hashing import FileIdentity, ProgressFactory, sha256_file_identity
from omnigraph.bundles.manifest import Manifest, manifest_location, parse_manifest, read_manifest_bytes
from omnigraph.bundles.members import check_member_format
from omnigraph.bundles.onnx_graph import load_graph_structure, parse_graph_structure
from omnigraph.bundles.paths import MANIFEST_NAME, check_bundle_tree, check_regular_file_inside


@dataclass(frozen=True)
class VerifiedBundle:
    """A bundle whose every file matched its manifest when verify_bundle (or pack_bundle) returned it.

    `identities` holds each member's (and manifest.json's) stat identity as it was opened for
    hashing: what bundles/watch.py compares to notice a change without hashing again.
    """

    root: Path
    manifest_path: Path
    manifest: Manifest
    manifest_sha256: str
    graph_path: Path
    example_inputs_path: Path | None
    custom_ops_path: Path | None
    identities: Mapping[str, FileIdentity] = field(default_factory=dict, compare=False)

    def file(self, name: str) -> Path:
        """The path of a verified member, by its manifest name."""
        if name not in self.manifest.files:
            raise BundleFileMissing(f"{self.root / name}: not a file of this bundle (manifest {self.manifest_path})")
        return self.root / name


@dataclass(frozen=True)
class BundleLayout:
    """A parsed manifest whose folder holds exactly the listed files (contents not yet hashed)."""

    root: Path
    manifest_path: Path
    manifest_bytes: bytes
    manifest: Manifest
    manifest_identity: FileIdentity

    @property
    def manifest_sha256(self) -> str:
        """The sha256 of manifest.json's bytes: the bundle's identity."""
        return hashlib.sha256(self.manifest_bytes).hexdigest()


def read_bundle_layout(path: str | os.PathLike[str]) -> BundleLayout:
    """Parse the manifest of a bundle folder (or its manifest.json) and check the folder's files.

    Refuses bad JSON or schema, an oversized manifest, unsafe names, links out of the bundle,
    missing and unlisted files; it does not hash, so it is cheap enough for inspection.
    """
    root = Path(os.path.realpath(manifest_location(path).parent))
    manifest_path = check_regular_file_inside(root, MANIFEST_NAME)
    manifest_bytes, identity = read_manifest_bytes(manifest_path)
    manifest = parse_manifest(manifest_bytes, source=str(manifest_path))
    check_bundle_tree(root, manifest.files)
    return BundleLayout(root, manifest_path, manifest_bytes, manifest, identity)


def verify_bundle(path: str | os.PathLike[str], *, progress: ProgressFactory | None = None) -> VerifiedBundle:
    """Check a bundle folder (or its manifest.json) completely, or raise the BundleError that says why.

    In order: the manifest parses and follows the schema; the folder holds exactly the listed files,
    none reached through a link out of it; every file's sha256 matches; every member parses as its
    name says (bundles/members.py); every ONNX graph parses and its external-data references name
    listed files. `progress` opens a display for each big file hashed (hashing.py).
    """
    return complete_verification(read_bundle_layout(path), {}, progress=progress)


def complete_verification(
    layout: BundleLayout, contents: Mapping[str, tuple[bytes, FileIdentity]], *,
    progress: ProgressFactory | None = None,
) -> VerifiedBundle:
    """verify_bundle's checks of `layout`, hashing the members in `contents` (already read whole,
    with their identity when opened) from those bytes and the others from disk."""
    root, manifest = layout.root, layout.manifest
    identities = {MANIFEST_NAME: layout.manifest_identity}
    for name, expected in manifest.files.items():
        if name in contents:
            data, identities[name] = contents[name]
            actual = hashlib.sha256(data).hexdigest()
        else:
            actual, identities[name] = sha256_file_identity(root / name, progress=progress)
        if actual != expected:
            raise BundleHashMismatch(f"{root / name}: sha256 is {actual}, {MANIFEST_NAME} lists {expected}")
    for name in manifest.files:
        check_member_format(root / name, contents[name][0] if name in contents else None)
    for graph_file in graph_members(manifest.files, manifest.metadata.graph_file):
        if graph_file in contents:
            model = parse_graph_structure(contents[graph_file][0], source=root / graph_file)
        else:
            model = load_graph_structure(root / graph_file)
        check_external_data(root, graph_file, model, manifest.files)
    metadata = manifest.metadata
    return VerifiedBundle(
        root=root,
        manifest_path=layout.manifest_path,
        manifest=manifest,
        manifest_sha256=layout.manifest_sha256,
        graph_path=root / metadata.graph_file,
        example_inputs_path=None if metadata.example_inputs_file is None else root / metadata.example_inputs_file,
        custom_ops_path=None if manifest.custom_ops is None else root / manifest.custom_ops.library_file,
        identities=identities,
    )
