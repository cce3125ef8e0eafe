"""JSON as RFC 8259 writes it: no NaN or Infinity, no key twice in one object.

Python's `json` accepts both by default, and a repeated key silently keeps the last value, so two
readers of one document can disagree about what it says. Manifests, fixtures and request bodies
are all read through this one parser (the wire keeps its own: it stands alone by design).
"""

from __future__ import annotations

import json
import re
from typing import Any

# A JSON string literal (escapes included), so brackets inside strings are not counted as nesting.
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r} in one object")
        result[key] = value
    return result


def loads_strict(text: str, *, max_depth: int | None = None) -> Any:
    """Parse `text`; ValueError (json.JSONDecodeError for syntax) on anything RFC 8259 refuses.

    With `max_depth`, text nesting arrays and objects deeper than that is refused before parsing
    (RFC 8259 section 9 lets a parser limit depth; Python's recursive one would hit RecursionError).
    """
    if max_depth is not None:
        _check_depth(text, max_depth)
    return json.loads(text, object_pairs_hook=_refuse_duplicate_keys, parse_constant=_refuse_constant)


def _check_depth(text: str, max_depth: int) -> None:
    depth = 0
    for bracket in _NOT_BRACKET.sub("", _STRING.sub('""', text)):
        depth += 1 if bracket in "[{" else -1
        if depth > max_depth:
            raise ValueError(f"nested deeper than {max_depth} arrays / objects")
