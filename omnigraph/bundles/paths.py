"""Where bundle files may live: member-name rules and the scan of a bundle folder.

A member name is a relative POSIX path inside the bundle. The rules are strict on purpose: the same
bundle is read by workers on other machines and operating systems, and a name that is absolute,
climbs with `..`, uses backslashes or unusual characters could point somewhere else there.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Collection
from pathlib import Path

from omnigraph.bundles.errors import BundleFileMissing, BundlePathUnsafe, BundleUnlistedFile

MANIFEST_NAME = "manifest.json"

# One path component: letters, digits and `._+-`; `.` and `..` are refused separately.
_COMPONENT = re.compile(r"[A-Za-z0-9._+-]{1,255}")


def check_member_name(name: object, *, what: str = "bundle member") -> str:
    """Return `name` if it is a safe relative POSIX path inside a bundle, else raise BundlePathUnsafe."""
    if not isinstance(name, str) or not name:
        raise BundlePathUnsafe(f"{what} name must be a non-empty string, got {name!r}")
    if "\\" in name:
        raise BundlePathUnsafe(f"{what} {name!r}: backslashes are not allowed (use '/')")
    if name.startswith("/"):
        raise BundlePathUnsafe(f"{what} {name!r}: absolute paths are not allowed")
    for component in name.split("/"):
        if component in (".", ".."):
            raise BundlePathUnsafe(f"{what} {name!r}: '.' and '..' components are not allowed")
        if not _COMPONENT.fullmatch(component):
            raise BundlePathUnsafe(
                f"{what} {name!r}: each path component must be 1-255 of the characters A-Z a-z 0-9 . _ + -"
            )
    return name


def scan_bundle_tree(root: Path) -> list[str]:
    """Every file under `root` except the root manifest.json, as sorted member names.

    Symbolic links are not followed while walking; each one must resolve to a regular file inside
    `root` (a link to a directory, or out of the bundle, is refused), and anything that is not a
    regular file (FIFO, socket, device) is refused, so hashing can never block or escape.
    """
    members: list[str] = []
    pending = [""]
    while pending:
        folder = pending.pop()
        with os.scandir(root / folder) as entries:
            for entry in entries:
                name = f"{folder}/{entry.name}" if folder else entry.name
                if entry.is_dir(follow_symlinks=False):
                    pending.append(name)
                elif name != MANIFEST_NAME:
                    check_regular_file_inside(root, name)
                    members.append(name)
    return sorted(members)


def check_regular_file_inside(root: Path, name: str) -> Path:
    """Return root/name after checking it resolves to a regular file inside `root`."""
    path = root / name
    real_root = os.path.realpath(root)
    target = os.path.realpath(path)
    if os.path.commonpath([real_root, target]) != real_root:
        raise BundlePathUnsafe(f"{path}: a symbolic link leads outside the bundle (to {target})")
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        raise BundleFileMissing(f"{path}: a broken symbolic link (to {target})") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a special file"
        raise BundlePathUnsafe(f"{path}: {kind} where a regular file belongs (links may only name files)")
    return path


def check_bundle_tree(root: Path, listed: Collection[str]) -> None:
    """Refuse a bundle folder whose files are not exactly the `listed` member names."""
    present = set(scan_bundle_tree(root))
    missing = sorted(set(listed) - present)
    if missing:
        raise BundleFileMissing(f"{root / missing[0]}: listed in {MANIFEST_NAME} but not in the bundle")
    unlisted = sorted(present - set(listed))
    if unlisted:
        raise BundleUnlistedFile(f"{root / unlisted[0]}: in the bundle but not listed in {MANIFEST_NAME}")
