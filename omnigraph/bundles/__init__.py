"""Bundles: the manifest-verified folders of ONNX graphs and files that graph stages run.

The ground floor of omnigraph: it imports only the standard library and `onnx`, because the graph
worker process (numpy + onnxruntime + onnx) verifies bundles too.
"""

from omnigraph.bundles.errors import (
    BundleError,
    BundleFileMissing,
    BundleHashMismatch,
    BundlePathUnsafe,
    BundleUnlistedFile,
    ExternalDataOutsideBundle,
    ManifestInvalid,
)
from omnigraph.bundles.hashing import sha256_file
from omnigraph.bundles.inspection import format_inspection, inspect_bundle
from omnigraph.bundles.manifest import BundleMetadata, CustomOpsEntry, Manifest, load_manifest
from omnigraph.bundles.pack import pack_bundle
from omnigraph.bundles.paths import MANIFEST_NAME
from omnigraph.bundles.staging import staged_bundle_dir
from omnigraph.bundles.verify import VerifiedBundle, verify_bundle

__all__ = [
    "MANIFEST_NAME",
    "BundleError",
    "BundleFileMissing",
    "BundleHashMismatch",
    "BundleMetadata",
    "BundlePathUnsafe",
    "BundleUnlistedFile",
    "CustomOpsEntry",
    "ExternalDataOutsideBundle",
    "Manifest",
    "ManifestInvalid",
    "VerifiedBundle",
    "format_inspection",
    "inspect_bundle",
    "load_manifest",
    "pack_bundle",
    "sha256_file",
    "staged_bundle_dir",
    "verify_bundle",
]
