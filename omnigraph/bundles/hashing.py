"""sha256 of bundle files, streamed in 1 MiB chunks, reporting progress on big ones to the caller's bar."""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

CHUNK_BYTES = 1 << 20
# Files at least this big report progress when the caller asks for it (smaller ones hash in well
# under a second).
PROGRESS_MIN_BYTES = 64 << 20
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class ByteProgress(Protocol):
    """A progress display for one file: told each chunk's size, then closed (tqdm's bar is one)."""

    def update(self, count: int) -> object: ...

    def close(self) -> object: ...


# Opens the display for one big file, given its path and size. The caller's room chooses the display
# (the CLI's is a tqdm bar on stderr), so this room stays on the worker interpreter's imports.
ProgressFactory = Callable[[Path, int], ByteProgress]


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


def sha256_file(path: str | os.PathLike[str], *, progress: ProgressFactory | None = None) -> str:
    """Hex sha256 of a file's bytes (see sha256_file_identity)."""
    return sha256_file_identity(path, progress=progress)[0]


def sha256_file_identity(
    path: str | os.PathLike[str], *, progress: ProgressFactory | None = None
) -> tuple[str, FileIdentity]:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks so memory stays flat for any size, and
    the file's identity when it was opened (what bundles/watch.py compares cheaply later).

    With `progress`, a file of at least PROGRESS_MIN_BYTES opens a display through it and reports
    every chunk hashed.
    """
    path = Path(path)
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb") as handle:
        status = os.fstat(handle.fileno())
        bar = progress(path, status.st_size) if progress is not None and status.st_size >= PROGRESS_MIN_BYTES else None
        try:
            while count := handle.readinto(buffer):
                digest.update(view[:count])
                if bar is not None:
                    bar.update(count)
        finally:
            if bar is not None:
                bar.close()
    return digest.hexdigest(), FileIdentity.of(status)

