"""YAML as a deploy plan may be written: bounded, no aliases, no key twice in one mapping.

PyYAML's safe loader expands aliases (a "billion laughs" document of a few hundred bytes grew to
4.5 GB in a minute), recurses once per nesting level, and keeps the last of two equal keys
silently, so a plan could say two things and run one of them.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

# Why: a deploy plan is a few KB (one block per stage); 1 MiB bounds the parser's memory and time
# while leaving room for hundreds of stages and their comments.
MAX_YAML_BYTES = 1 << 20
# Why: a plan nests about six levels (stages -> backend -> route -> provider_options); this bounds
# the composer's recursion long before Python's own limit.
MAX_YAML_DEPTH = 32


class StrictYamlError(ValueError):
    """The YAML is too large, not a regular file, uses an alias, nests too deep or repeats a key."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader refusing aliases, deep nesting and duplicate keys, each naming its line."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise StrictYamlError(f"line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not "
                                  "allowed; write the value out, or share settings through base_config")
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            mark = self.peek_event().start_mark
            raise StrictYamlError(f"line {mark.line + 1}: nested deeper than {MAX_YAML_DEPTH} levels")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                first = seen.setdefault(key, line)
            except TypeError:  # an unhashable key: the base class says so
                break
            if first != line:
                raise StrictYamlError(f"line {line}: duplicate key {key!r} (first at line {first})")
        return super().construct_mapping(node, deep=deep)


def read_yaml_file(path: Path) -> Any:
    """Parse the YAML file at `path`: a regular file of at most MAX_YAML_BYTES (checked before
    reading), UTF-8, strict as _StrictLoader. OSError when it cannot be read."""
    with open(path, "rb") as handle:
        status = os.fstat(handle.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise StrictYamlError("not a regular file")
        if status.st_size > MAX_YAML_BYTES:
            raise StrictYamlError(f"{status.st_size} bytes, more than a deploy YAML may hold ({MAX_YAML_BYTES})")
        data = handle.read(MAX_YAML_BYTES + 1)
    if len(data) > MAX_YAML_BYTES:  # it grew while being read
        raise StrictYamlError(f"more than a deploy YAML may hold ({MAX_YAML_BYTES} bytes)")
    try:
        return yaml.load(data.decode("utf-8"), Loader=_StrictLoader)  # _StrictLoader is a SafeLoader subclass
    except UnicodeDecodeError as exc:
        raise StrictYamlError(f"not UTF-8 text: {exc}") from None
