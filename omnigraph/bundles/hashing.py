"""sha256 of bundle files, streamed in 1 MiB chunks, with an optional progress bar for big ones."""

from __future__ import annotations

import hashlib
import os
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHUNK_BYTES = 1 << 20
# Files at least this big get a progress bar when the caller asks for one.
PROGRESS_MIN_BYTES = 64 << 20
_PROGRESS_INTERVAL_S = 0.25
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def is_sha256_hex(value: object) -> bool:
    """True for a sha256 digest written as 64 lowercase hexadecimal digits."""
    return isinstance(value, str) and _SHA256_HEX.fullmatch(value) is not None


@dataclass(frozen=True)
class FileIdentity:
    """What stat says about a file: any write, truncation or replacement changes at least one field."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, status: os.stat_result) -> FileIdentity:
        return cls(status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)


def read_file(path: str | os.PathLike[str]) -> tuple[bytes, FileIdentity]:
    """A regular file's whole content and its identity when it was opened (one read, one copy)."""
    with open(path, "rb") as handle:
        status = os.fstat(handle.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise OSError(f"{path}: not a regular file")
        return handle.read(), FileIdentity.of(status)


def sha256_file(path: str | os.PathLike[str], *, progress: bool = False) -> str:
    """Hex sha256 of a file's bytes (see sha256_file_identity)."""
    return sha256_file_identity(path, progress=progress)[0]


def sha256_file_identity(path: str | os.PathLike[str], *, progress: bool = False) -> tuple[str, FileIdentity]:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks so memory stays flat for any size, and
    the file's identity when it was opened (what bundles/watch.py compares cheaply later).

    With `progress=True`, files of at least PROGRESS_MIN_BYTES show a tqdm bar on stderr (tqdm is
    imported only then: a worker's interpreter never needs it).
    """
    path = Path(path)
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb") as handle:
        status = os.fstat(handle.fileno())
        bar = _progress_bar(path, status.st_size) if progress and status.st_size >= PROGRESS_MIN_BYTES else None
        try:
            while count := handle.readinto(buffer):
                digest.update(view[:count])
                if bar is not None:
                    bar.update(count)
        finally:
            if bar is not None:
                bar.close()
    return digest.hexdigest(), FileIdentity.of(status)


def _progress_bar(path: Path, total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=f"hashing {path.name}", unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, mininterval=_PROGRESS_INTERVAL_S)
