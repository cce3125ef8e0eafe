"""sha256 of bundle files, streamed in 1 MiB chunks, with an optional progress line for big ones."""

from __future__ import annotations

import hashlib
import os
import re
import sys
import time
from pathlib import Path

CHUNK_BYTES = 1 << 20
# Files at least this big get a progress line when the caller asks for one.
PROGRESS_MIN_BYTES = 64 << 20
_PROGRESS_INTERVAL_S = 0.25
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def is_sha256_hex(value: object) -> bool:
    """True for a sha256 digest written as 64 lowercase hexadecimal digits."""
    return isinstance(value, str) and _SHA256_HEX.fullmatch(value) is not None


def sha256_file(path: str | os.PathLike[str], *, progress: bool = False) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks so memory stays flat for any size.

    With `progress=True`, files of at least PROGRESS_MIN_BYTES report on stderr (a line updated in
    place on a terminal, one summary line otherwise).
    """
    path = Path(path)
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb") as handle:
        total = os.fstat(handle.fileno()).st_size
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
    return digest.hexdigest()


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f}"
