"""A deliberately broken worker for the conformance tests: it trusts a descriptor's shape and
ignores its `nbytes`, so a byte-length mismatch is accepted instead of refused.

Run as a script it is a worker command (`python lenient_worker.py --connect ...`); imported, its
`install()` breaks the codec of the current process.
"""

from __future__ import annotations

import json
import math
import sys

from omnigraph.workers import wire

# The codec's header parser (private: this file breaks the codec on purpose, from the inside).
_strict_parse_header = wire._parse_header


def lenient_parse_header(header_bytes: bytes | bytearray, *options: object) -> wire.Frame:
    """Rewrite every descriptor's nbytes to what its shape and dtype imply, then parse strictly."""
    try:
        header = json.loads(bytes(header_bytes))
        for descriptor in header["tensors"]:
            itemsize = wire.WIRE_DTYPES[descriptor["dtype"]].itemsize
            descriptor["nbytes"] = math.prod(descriptor["shape"]) * itemsize
        header_bytes = json.dumps(header).encode()
    except Exception:  # anything else is left for the strict parser to refuse
        pass
    return _strict_parse_header(header_bytes, *options)


def install() -> None:
    wire._parse_header = lenient_parse_header


if __name__ == "__main__":
    from omnigraph.workers import worker

    install()
    sys.exit(worker.main())
