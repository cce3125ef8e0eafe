"""Member formats: each bundle file must parse as what its name says, so a truncated or damaged
file is refused when the bundle is packed or verified, naming the file, rather than failing
vaguely once a server reads it (a truncated tokenizer.json used to surface as `EOF while parsing a
value at line 1556 column 3`).

Checked here by suffix: `.npz` (a zip of intact `.npy` arrays) and `.json` (strict JSON).
`.onnx` members are parsed by verification itself (it reads their external-data references);
other suffixes (weights, libraries) are opaque bytes: their hash is all there is to check.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

from numpy.lib import format as npy_format

from omnigraph.bundles.errors import MemberInvalid
from omnigraph.bundles.strict_json import loads_strict

# Why: configs and tokenizers nest a handful of levels; this bounds the parser's recursion.
MAX_MEMBER_JSON_DEPTH = 64


def check_member_format(path: Path, content: bytes | None = None) -> None:
    """Refuse `path` (or `content`, its bytes already read) unless it parses as its suffix says."""
    data = path.read_bytes() if content is None and path.suffix in (".npz", ".json") else content
    if path.suffix == ".npz":
        _check_npz(path, data or b"")
    elif path.suffix == ".json":
        try:
            loads_strict((data or b"").decode("utf-8"), max_depth=MAX_MEMBER_JSON_DEPTH)
        except ValueError as exc:  # also UnicodeDecodeError and JSONDecodeError
            raise MemberInvalid(f"{path}: not valid JSON (truncated or damaged?): {exc}") from None


def _check_npz(path: Path, data: bytes) -> None:
    """Every entry of the archive is an intact `.npy` array of plain data (CRC checked, read whole:
    example inputs are small)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            damaged = archive.testzip()
            if damaged is not None:
                raise MemberInvalid(f"{path}: entry {damaged!r} of the .npz archive fails its CRC check")
            for entry in archive.namelist():
                if not entry.endswith(".npy"):
                    raise MemberInvalid(f"{path}: entry {entry!r} of the .npz archive is not a .npy array")
                with archive.open(entry) as stream:
                    npy_format.read_array(stream, allow_pickle=False)
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as exc:
        raise MemberInvalid(f"{path}: not a readable .npz archive (truncated or damaged?): {exc}") from None
