"""YAML as a deploy plan may be written: bounded, no aliases, no key twice in one mapping.

PyYAML's safe loader expands aliases (a "billion laughs" document of a few hundred bytes grew to
4.5 GB in a minute), recurses once per nesting level, and keeps the last of two equal keys
silently, so a plan could say two things and run one of them.

PyYAML also reads YAML 1.1, where some plain scalars mean something else than in YAML 1.2, JSON
or vllm-omni's own configs: `yes`/`no`/`on`/`off` are booleans, `4.0e9` and `1e6` are strings (a
1.1 float needs a dot and a signed exponent), `1:30` is the sexagesimal 90 and `0755` the octal
493. `read_yaml_file(..., surprises=[])` reports each such scalar (`YamlSurprise`) with its YAML
path; `omnigraph deploy check` refuses them, serving reads them as PyYAML does.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
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


def read_yaml_file(path: Path, *, surprises: list[YamlSurprise] | None = None) -> Any:
    """Parse the YAML file at `path`: a regular file of at most MAX_YAML_BYTES (checked before
    reading), UTF-8, strict as _StrictLoader. OSError when it cannot be read. With `surprises`,
    every plain scalar that YAML 1.1 reads differently from YAML 1.2 is appended to it."""
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
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StrictYamlError(f"not UTF-8 text: {exc}") from None
    loader = _StrictLoader(text)  # a SafeLoader subclass
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if surprises is not None:
            surprises.extend(_surprises(node, "", str(path)))
        return loader.construct_document(node)
    finally:
        loader.dispose()


_BOOL_TAG, _STR_TAG = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:str"
_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
# A number in YAML 1.2's core schema (and JSON) that YAML 1.1 leaves a string: an exponent without
# a sign or a dot (4.0e9, 1e6), or a 0o octal.
_NUMBER_12 = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|0o[0-7]+")


@dataclass(frozen=True)
class YamlSurprise:
    """A plain scalar that YAML 1.1 (PyYAML) reads differently from YAML 1.2 and JSON."""

    file: str
    path: str        # its YAML path in `file`, e.g. stages[0].backend.route.enable_cuda_graph
    line: int
    text: str        # the scalar as written
    value: Any       # what YAML 1.1 made of it

    def explain(self) -> str:
        """What YAML 1.1 did, and how to write what was meant."""
        shown = f"{self.value!r}" if isinstance(self.value, str) else f"{self.value}"
        if isinstance(self.value, bool):
            word = "true" if self.value else "false"
            return (f"YAML 1.1 reads the unquoted {self.text!r} as the boolean {word} (YAML 1.2 and JSON read a "
                    f"string): write {word} where a boolean is meant, or quote it ('{self.text}') where a string is")
        if isinstance(self.value, str):
            number = float(self.text) if "o" not in self.text else int(self.text, 8)
            written = str(int(number)) if float(number).is_integer() else repr(number)
            why = ("0o octals are YAML 1.2's" if "o" in self.text else
                   "a 1.1 float needs a dot and a signed exponent, e.g. 4.0e+9")
            return (f"YAML 1.1 reads {self.text!r} as the string {shown}, not a number ({why}): write {written}, "
                    "or quote it where a string is meant")
        return (f"YAML 1.1 reads {self.text!r} as the number {shown} (sexagesimal or octal): quote it where a "
                "string is meant, or write the number in plain decimal")


def _surprises(node: yaml.Node, path: str, file: str) -> list[YamlSurprise]:
    found: list[YamlSurprise] = []
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
            inner = f"{path}.{key}" if path else str(key)
            found += _surprises(key_node, inner, file) if isinstance(key_node, yaml.ScalarNode) else []
            found += _surprises(value_node, inner, file)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            found += _surprises(item, f"{path}[{index}]", file)
    elif isinstance(node, yaml.ScalarNode) and node.style is None:  # only plain scalars: quoting says what is meant
        text, tag = node.value, node.tag
        surprising = (
            (tag == _BOOL_TAG and text.lower() not in ("true", "false"))
            or (tag == _STR_TAG and _NUMBER_12.fullmatch(text) is not None)
            or (tag in (_INT_TAG, _FLOAT_TAG) and ":" in text)
            or (tag == _INT_TAG and re.fullmatch(r"[-+]?0[0-7_]+", text) is not None)
        )
        if surprising:
            value = yaml.safe_load(text)
            found.append(YamlSurprise(file, path or "<top level>", node.start_mark.line + 1, text, value))
    return found
