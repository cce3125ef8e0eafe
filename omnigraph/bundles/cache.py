"""Build-once folders under `$OMNIGRAPH_CACHE`: synthetic checkpoints and built bundles.

Every model folder caches the same way (DESIGN.md "Caches"): a folder is named by what built it
(`<kind>/<name>-<hash of key>`), written by its builder into a staged folder renamed onto the
name (`staged_bundle_dir`), and never modified after, so a finished folder is complete and a
second caller reuses it. Two processes that build the same folder at once both finish: the
loser's rename fails and it uses the winner's folder.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omnigraph.bundles.defaults import CACHE_ENV, cache_root

logger = logging.getLogger("omnigraph.bundles")

__all__ = ["CACHE_ENV", "CacheUnwritable", "cache_key", "cache_root", "cached_folder"]

# The errors of a cache that cannot take a new folder: read-only, full, over quota, not ours.
_UNWRITABLE = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM})
# Hex digits of the key's sha256 in a folder name: 64 bits, plenty for one machine's cache.
KEY_DIGITS = 16


class CacheUnwritable(OSError):
    """A cache folder could not be built: the cache is read-only, full, or otherwise refused a
    write. The message names the file and the operating system's reason."""


def cache_key(key: Mapping[str, Any]) -> str:
    """The first `KEY_DIGITS` hex digits of the sha256 of `key` as canonical JSON (sorted keys)."""
    try:
        canonical = json.dumps(dict(key), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"a cache key must be JSON of plain values, got {key!r}: {exc}") from None
    return hashlib.sha256(canonical.encode()).hexdigest()[:KEY_DIGITS]


def cached_folder(kind: str, name: str, key: Mapping[str, Any], build: Callable[[Path], object]) -> Path:
    """`$OMNIGRAPH_CACHE/<kind>/<name>-<cache_key(key)>`, built by `build(out)` the first time.

    `key` must hold everything the folder's bytes depend on (inputs, generator or exporter
    versions) and nothing about where files live (content hashes, not paths), since a folder with
    that name is reused as it is, also from a cache copied elsewhere. An existing folder is
    returned without any write, so a read-only cache serves what it holds. `build` writes the new
    folder `out` atomically (through `staged_bundle_dir`), refusing an existing one; when it fails
    because another process finished the same folder first, that folder is returned; the OSError
    of an unwritable cache (read-only, full, over quota, no permission) becomes CacheUnwritable,
    naming the path and the cause.
    """
    for what, value in (("kind", kind), ("name", name)):
        if not isinstance(value, str) or not value or "/" in value or os.sep in value or value in (".", ".."):
            raise ValueError(f"cache {what} must name one folder (no path separators), got {value!r}")
    out = cache_root() / kind / f"{name}-{cache_key(key)}"
    if out.is_dir():
        return out
    started = time.monotonic()
    logger.info("building %s into %s (the first time only)", kind.rstrip("s"), out)
    try:
        build(out)
    except OSError as exc:
        # A concurrent builder's rename onto `out` makes ours fail (FileExistsError, or ENOTEMPTY
        # when both rename at once); anything else is a real failure.
        if out.is_dir():
            return out
        if exc.errno not in _UNWRITABLE:
            raise
        where = exc.filename or out
        raise CacheUnwritable(exc.errno, f"cannot build {out} in the cache (${CACHE_ENV}): {where}: "
                                         f"{exc.strerror or exc}") from exc
    logger.info("built %s in %.1f s", out, time.monotonic() - started)
    return out
