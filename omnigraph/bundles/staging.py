"""Staged writing of a bundle folder, so an interrupted exporter never leaves half a bundle behind."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def staged_bundle_dir(out: str | os.PathLike[str], *, replace: bool = False) -> Iterator[Path]:
    """Yield an empty folder beside `out`; on success it is renamed onto `out`, on failure removed.

    Pack inside the staged folder, then `verify_bundle(out)` after the block: the rename moves the
    files, so paths inside the staged folder are stale afterwards. An existing `out` is an error
    unless `replace=True`; then the old folder is renamed aside, the new one renamed in, and the
    old one deleted (the old one is put back if the second rename fails).
    """
    out = Path(out)
    if out.exists() and not replace:
        raise FileExistsError(f"{out} already exists (remove it or pass replace=True)")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder; it cannot be replaced by a bundle")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = _sibling(out, "partial")
    staging.mkdir()
    try:
        yield staging
        if not out.exists():
            os.rename(staging, out)
        elif not replace:
            raise FileExistsError(f"{out} appeared while the bundle was being written; it was left untouched")
        else:
            _swap_in(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _swap_in(staging: Path, out: Path) -> None:
    """Replace the folder `out` by `staging` with two renames, restoring `out` if the second fails."""
    aside = _sibling(out, "old")
    os.rename(out, aside)
    try:
        os.rename(staging, out)
    except BaseException:
        os.rename(aside, out)
        raise
    shutil.rmtree(aside)


def _sibling(out: Path, purpose: str) -> Path:
    """A hidden, practically unique name next to `out` (same file system, so renames are atomic)."""
    return out.with_name(f".{out.name}.{purpose}-{secrets.token_hex(8)}")
