"""JSON as RFC 8259 writes it: no NaN or Infinity, no key twice in one object.

Python's `json` accepts both by default, and a repeated key silently keeps the last value, so two
readers of one document can disagree about what it says. Manifests, fixtures and request bodies
are all read through this one parser (the wire keeps its own: it stands alone by design).
"""

from __future__ import annotations

import json
from typing import Any


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r} in one object")
        result[key] = value
    return result


def loads_strict(text: str) -> Any:
    """Parse `text`; ValueError (json.JSONDecodeError for syntax) on anything RFC 8259 refuses."""
    return json.loads(text, object_pairs_hook=_refuse_duplicate_keys, parse_constant=_refuse_constant)
