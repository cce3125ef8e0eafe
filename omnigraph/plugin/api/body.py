"""Strict JSON request bodies: bounded reads and a parser that refuses what JSON should not carry.

Python's `json` module accepts `NaN` / `Infinity`, silently keeps the last of duplicate keys and
builds strings holding lone surrogates that cannot be encoded back to UTF-8. Each of those would
reach a model as something other than what the client meant, so each is a 400 here. The body is
counted while it is read: `Content-Length` is only a claim (and absent under chunked transfer).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

from omnigraph.bundles.strict_json import loads_strict

MAX_BODY_BYTES = 4 * 1024 * 1024

_JSON_MEDIA_TYPE = re.compile(r"^application/(?:[\w.+-]+\+)?json$")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class BodyError(Exception):
    """A request body that cannot be used: `status` is the HTTP status (400, 413 or 415)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def check_content_type(content_type: str | None) -> None:
    """Accept `application/json` (or `application/<x>+json`) with an optional utf-8 charset; else 415."""
    if not content_type:
        raise BodyError(415, "content-type must be application/json (none was sent)", "unsupported_media_type")
    media_type, _, params = content_type.partition(";")
    if not _JSON_MEDIA_TYPE.match(media_type.strip().lower()):
        raise BodyError(415, f"content-type must be application/json, not {media_type.strip()!r}",
                        "unsupported_media_type")
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise BodyError(415, f"charset must be utf-8, not {value.strip()!r}", "unsupported_media_type")


async def read_capped(chunks: AsyncIterator[bytes], content_length: str | None,
                      max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """Read the whole body, refusing (413) as soon as the claimed or the counted size passes `max_bytes`."""
    if content_length is not None:
        try:
            claimed = int(content_length)
        except ValueError:
            raise BodyError(400, f"content-length is not a number: {content_length!r}",
                            "invalid_content_length") from None
        if claimed > max_bytes:
            raise BodyError(413, f"request body too large ({claimed} > {max_bytes} bytes)", "request_too_large")
    received = bytearray()
    async for chunk in chunks:
        received += chunk
        if len(received) > max_bytes:
            raise BodyError(413, f"request body too large (more than {max_bytes} bytes)", "request_too_large")
    return bytes(received)


async def drain(chunks: AsyncIterator[bytes], limit: int) -> bool:
    """Read and discard the rest of a refused body: True when it ended within `limit` more bytes
    (the connection can then carry the client's next request), False past it."""
    discarded = 0
    async for chunk in chunks:
        discarded += len(chunk)
        if discarded > limit:
            return False
    return True


def _find_lone_surrogate(value: Any) -> bool:
    """Walk the parsed value with an explicit stack (JSON nests deeper than Python recursion)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def parse_strict_json(raw: bytes) -> Any:
    """Decode UTF-8 strictly and parse JSON, refusing NaN/Infinity, duplicate keys and lone surrogates (400)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(400, f"request body is not valid UTF-8 (byte {exc.start})", "invalid_utf8") from None
    try:
        value = loads_strict(text)
    except RecursionError:
        raise BodyError(400, "request body nests too deeply", "invalid_json") from None
    except ValueError as exc:
        raise BodyError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    if _find_lone_surrogate(value):
        raise BodyError(400, "request body contains an unpaired surrogate escape, which cannot be encoded as UTF-8",
                        "invalid_json")
    return value
