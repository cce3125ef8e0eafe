"""Noticing a served bundle change on disk.

Bundles are immutable while served (DESIGN.md); a worker runs the bytes it verified, but a file
changed afterwards means the next worker start would load something else, and `/health` should
say so. `BundleWatch.check()` is cheap enough to call every few seconds: it compares each file's
stat identity (device, inode, size, mtime_ns, ctime_ns) with the one recorded when it was hashed
and re-verifies the whole bundle only when one differs, and in full every `full_every`-th call
anyway (a write that keeps size and both timestamps, e.g. within one coarse clock tick, or a
clock set back, is then still found within `full_every` calls).
"""

from __future__ import annotations

import os
import threading

from omnigraph.bundles.errors import BundleError
from omnigraph.bundles.hashing import FileIdentity
from omnigraph.bundles.paths import MANIFEST_NAME
from omnigraph.bundles.verify import VerifiedBundle, verify_bundle

# Why: at a 30 s interval, a full re-hash every 20th check is one every 10 minutes: about 2 s of
# one core for the 850 MB Laya bundle, well under 1% of a core, while a stat-only check is ~10 us.
FULL_CHECK_EVERY = 20


class BundleWatch:
    """Re-verifies one VerifiedBundle on demand; see check()."""

    def __init__(self, bundle: VerifiedBundle, *, full_every: int = FULL_CHECK_EVERY) -> None:
        if type(full_every) is not int or full_every < 1:
            raise ValueError(f"full_every must be a positive integer, got {full_every!r}")
        self.bundle = bundle
        self._full_every = full_every
        self._identities = dict(bundle.identities)
        self._checks = 0
        self._lock = threading.Lock()

    def check(self) -> str | None:
        """None while the bundle on disk is still the verified one; else one line naming the
        changed, missing or added file (or the manifest) and how it differs.

        Thread-safe (calls are serialized). Cost: one stat per file, plus a full verify_bundle
        (hashing every byte) when a stat differs or on every `full_every`-th call: run it off any
        event loop. A full check that finds the same bytes (a file touched or copied over with
        identical content) adopts the new stat identities and returns None.
        """
        with self._lock:
            self._checks += 1
            if self._checks % self._full_every and self._stats_unchanged():
                return None
            return self._verify_again()

    def _stats_unchanged(self) -> bool:
        if set(self._identities) != {MANIFEST_NAME, *self.bundle.manifest.files}:
            return False  # a bundle verified before identities were recorded: check in full
        for name, identity in self._identities.items():
            try:
                if FileIdentity.of(os.stat(self.bundle.root / name)) != identity:
                    return False
            except OSError:
                return False
        return True

    def _verify_again(self) -> str | None:
        try:
            again = verify_bundle(self.bundle.manifest_path)
        except BundleError as exc:
            return f"bundle changed after verification: {exc}"
        except OSError as exc:
            return f"bundle changed after verification: {exc.filename or self.bundle.root}: {exc.strerror}"
        if again.manifest_sha256 != self.bundle.manifest_sha256:
            return (f"bundle changed after verification: {self.bundle.manifest_path}: sha256 is "
                    f"{again.manifest_sha256}, the served bundle's is {self.bundle.manifest_sha256}")
        self._identities = dict(again.identities)
        return None
