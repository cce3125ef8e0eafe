"""sha256 of bundle files, streamed in 1 MiB chunks, with an optional progress line for big ones."""

from __future__ import annotations

import hashlib
import os
import re
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CHUNK_BYTES = 1 << 20
# Files at least this big get a progress line when the caller asks for one.
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

    With `progress=True`, files of at least PROGRESS_MIN_BYTES report on stderr (a line updated in
    place on a terminal, one summary line otherwise).
    """
    path = Path(path)
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb") as handle:
        status = os.fstat(handle.fileno())
        total = status.st_size
        show = progress and total >= PROGRESS_MIN_BYTES
        live = show and sys.stderr.isatty()
        done = 0
        last_report = time.monotonic()
        line = ""
        while count := handle.readinto(buffer):
            digest.update(view[:count])
            done += count
            if live and time.monotonic() - last_report >= _PROGRESS_INTERVAL_S:
                last_report = time.monotonic()
                line = f"hashing {path.name}: {_mib(done)}/{_mib(total)} MiB ({100 * done // total}%)"
                print(f"\r{line}", end="", file=sys.stderr, flush=True)
    if show:
        summary = f"hashed {path.name}: {_mib(done)} MiB"
        print(f"\r{summary.ljust(len(line))}" if live else summary, file=sys.stderr, flush=True)
    return digest.hexdigest(), FileIdentity.of(status)


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f}"
