"""Why a bundle was refused: one exception class per kind of fault, each message naming the file."""

from __future__ import annotations


class BundleError(Exception):
    """A bundle (or the folder being packed into one) cannot be trusted or used."""


class ManifestInvalid(BundleError):
    """manifest.json is not valid JSON or does not follow the manifest schema."""


class BundleFileMissing(BundleError):
    """A file the manifest (or the caller) names is not in the bundle."""


class BundleHashMismatch(BundleError):
    """A listed file's sha256 differs from the one recorded in the manifest."""


class BundleUnlistedFile(BundleError):
    """The bundle folder holds a file the manifest does not list."""


class BundlePathUnsafe(BundleError):
    """A name or link could reach outside the bundle, or names something that is not a plain file."""


class ExternalDataOutsideBundle(BundleError):
    """An ONNX external-data reference points at a file outside the verified set."""


class MemberInvalid(BundleError):
    """A file does not parse as what its name says (an .npz archive, JSON, an ONNX graph)."""
