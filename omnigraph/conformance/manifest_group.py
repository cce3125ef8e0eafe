"""The manifest group: generated bundles, valid and damaged, that a target must accept or refuse.

Each case's bundle is generated from the fixture (bundle_cases.py) in a fresh temporary folder.
`inproc` verifies it with `omnigraph.bundles.verify_bundle` and expects the specific refusal code
below; a `worker:` target is asked to load it, and must refuse every damaged bundle with the wire
code `bundle_invalid` whose message names what the case's `names` list says.

Codes (`expect.code`), one per BundleError class:

    manifest_invalid               manifest.json is not JSON, or breaks the schema
    file_missing                   a listed file (or manifest.json itself) is absent
    hash_mismatch                  a file's sha256 differs from the manifest's
    unlisted_file                  the folder holds a file the manifest does not list
    path_unsafe                    an absolute, `..`, backslash or odd name; a link out of the bundle
    external_data_outside_bundle   an ONNX external-data reference outside the listed files
    bundle_invalid                 any other refusal (e.g. a listed graph that is not ONNX)
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from omnigraph.bundles import (
    BundleError,
    BundleFileMissing,
    BundleHashMismatch,
    BundlePathUnsafe,
    BundleUnlistedFile,
    ExternalDataOutsideBundle,
    ManifestInvalid,
    verify_bundle,
)
from omnigraph.conformance.bundle_cases import build_case_bundle
from omnigraph.conformance.expect import check_accepted, check_refused, expected_outcome
from omnigraph.conformance.report import CaseFailed, CaseRunner
from omnigraph.conformance.suite import Case, Group
from omnigraph.conformance.targets import Target

if TYPE_CHECKING:
    from omnigraph.conformance.worker_target import WorkerTargetSession

# The one code a worker answers for any bundle it refuses to trust (omnigraph.workers.errors).
WORKER_REFUSAL_CODE = "bundle_invalid"

_CODES: tuple[tuple[type[BundleError], str], ...] = (
    (ManifestInvalid, "manifest_invalid"),
    (BundleFileMissing, "file_missing"),
    (BundleHashMismatch, "hash_mismatch"),
    (BundleUnlistedFile, "unlisted_file"),
    (BundlePathUnsafe, "path_unsafe"),
    (ExternalDataOutsideBundle, "external_data_outside_bundle"),
)


def bundle_error_code(error: BundleError) -> str:
    """The stable code of a BundleError (the most specific class that matches)."""
    return next((code for cls, code in _CODES if isinstance(error, cls)), "bundle_invalid")


@contextlib.contextmanager
def open_runner(group: Group, target: Target) -> Iterator[CaseRunner]:
    graphs = group.setup.get("graphs", {})
    with tempfile.TemporaryDirectory(prefix="omnigraph-conformance-manifest-") as scratch:
        if target.kind == "worker":
            from omnigraph.conformance.worker_target import WorkerTargetSession

            with WorkerTargetSession(target.command, setup=group.setup) as session:
                yield lambda case: _check_worker(case, graphs, Path(scratch), session)
        else:
            yield lambda case: _check_inproc(case, graphs, Path(scratch))


def _case_bundle(case: Case, graphs: dict, scratch: Path) -> Path:
    workdir = scratch / case.id
    workdir.mkdir()
    return build_case_bundle(case.send, graphs, workdir, where=case.id)


def _check_inproc(case: Case, graphs: dict, scratch: Path) -> None:
    path = _case_bundle(case, graphs, scratch)
    try:
        bundle = verify_bundle(path)
    except BundleError as error:
        check_refused(case.expect, bundle_error_code(error), str(error), case_id=case.id)
        return
    check_accepted(case.expect, case_id=case.id)
    listed = case.expect.get("files")
    if listed is not None and sorted(bundle.manifest.files) != sorted(listed):
        raise CaseFailed(f"verified files {sorted(bundle.manifest.files)} != expected {sorted(listed)}")


def _check_worker(case: Case, graphs: dict, scratch: Path, session: WorkerTargetSession) -> None:
    path = _case_bundle(case, graphs, scratch)
    refusal = session.load_bundle(path)
    if expected_outcome(case.expect, case_id=case.id) == "accepted":
        if refusal is not None:
            raise CaseFailed(f"load refused ({refusal[0]}: {refusal[1]}), expected accepted")
        return
    if refusal is None:
        raise CaseFailed(f"load accepted, expected refused ({case.expect['code']})")
    code, message = refusal
    check_refused({**case.expect, "code": WORKER_REFUSAL_CODE}, code, message, case_id=case.id)
