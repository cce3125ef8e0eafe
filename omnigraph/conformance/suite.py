"""The fixture format: a suite is a folder of JSON files, one per group, each a list of cases.

A case is data only: what to send and what must come back. The runner turns it into bytes,
bundles or HTTP requests, so the same files can qualify any implementation of the surfaces they
describe. Files are read strictly (duplicate keys, unknown keys, NaN and repeated ids are refused)
so a typo in a fixture cannot silently turn a check into a no-op.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnigraph.bundles.strict_json import loads_strict

SUITES_ROOT = Path(__file__).resolve().parent
GROUP_NAMES = ("wire", "manifest", "ledger", "placement", "decision")
_CASE_ID = re.compile(r"[a-z0-9_]+(\.[a-z0-9_]+)+")
_SUITE_NAME = re.compile(r"v[0-9]+")


class FixtureInvalid(ValueError):
    """A fixture file does not follow the case format; the message names the file and the case."""


@dataclass(frozen=True)
class Case:
    """One check: `send` says what the runner sends, `expect` what must come back."""

    id: str
    description: str
    send: dict[str, Any]
    expect: dict[str, Any]


@dataclass(frozen=True)
class Group:
    """The cases of one fixture file; `setup` holds data every case of the group shares."""

    name: str
    description: str
    setup: dict[str, Any]
    cases: tuple[Case, ...]


@dataclass(frozen=True)
class Suite:
    name: str
    root: Path
    groups: tuple[Group, ...]

    def group(self, name: str) -> Group:
        for group in self.groups:
            if group.name == name:
                return group
        raise KeyError(f"suite {self.name} has no group {name!r} (groups: {', '.join(g.name for g in self.groups)})")

    @property
    def case_count(self) -> int:
        return sum(len(group.cases) for group in self.groups)


def load_suite(name: str = "v1") -> Suite:
    """Read and check every group file of a suite shipped with omnigraph (`v1`: omnigraph/conformance/v1)."""
    if not _SUITE_NAME.fullmatch(name):
        raise FixtureInvalid(f"suite name must look like 'v1', got {name!r}")
    root = SUITES_ROOT / name
    if not root.is_dir():
        raise FixtureInvalid(f"no suite {name!r} (expected a folder {root})")
    present = sorted(path.stem for path in root.glob("*.json"))
    unknown = sorted(set(present) - set(GROUP_NAMES))
    if unknown:
        raise FixtureInvalid(f"{root}: unknown group files {unknown} (groups are {', '.join(GROUP_NAMES)})")
    groups = tuple(load_group(root / f"{group}.json") for group in GROUP_NAMES if group in present)
    seen: set[str] = set()
    for group in groups:
        for case in group.cases:
            if case.id in seen:
                raise FixtureInvalid(f"{root}: case id {case.id!r} appears twice")
            seen.add(case.id)
    return Suite(name=name, root=root, groups=groups)


def load_group(path: Path) -> Group:
    """Read one group file: {"group", "description", "setup"?, "cases": [{"id", "description", "send", "expect"}]}."""
    try:
        data = loads_strict(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise FixtureInvalid(f"{path}: {exc}") from None
    top = _exact(data, f"{path}", required=("group", "description", "cases"), optional=("setup",))
    if top["group"] != path.stem:
        raise FixtureInvalid(f"{path}: 'group' is {top['group']!r} but the file is named for {path.stem!r}")
    if not isinstance(top["cases"], list) or not top["cases"]:
        raise FixtureInvalid(f"{path}: 'cases' must be a non-empty list")
    cases = []
    for index, raw in enumerate(top["cases"]):
        fields = _exact(raw, f"{path} case #{index}", required=("id", "description", "send", "expect"))
        case_id = fields["id"]
        if not isinstance(case_id, str) or not _CASE_ID.fullmatch(case_id) or not case_id.startswith(f"{path.stem}."):
            raise FixtureInvalid(f"{path} case #{index}: id must look like '{path.stem}.<words>', got {case_id!r}")
        for key in ("send", "expect"):
            if not isinstance(fields[key], dict):
                raise FixtureInvalid(f"{path} case {case_id}: {key!r} must be an object")
        if not isinstance(fields["description"], str) or not fields["description"].strip():
            raise FixtureInvalid(f"{path} case {case_id}: 'description' must be a non-empty string")
        cases.append(Case(id=case_id, description=fields["description"], send=fields["send"], expect=fields["expect"]))
    setup = top.get("setup", {})
    if not isinstance(setup, dict):
        raise FixtureInvalid(f"{path}: 'setup' must be an object")
    return Group(name=path.stem, description=top["description"], setup=setup, cases=tuple(cases))


def _exact(data: object, where: str, *, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise FixtureInvalid(f"{where}: expected an object, got {type(data).__name__}")
    missing = [key for key in required if key not in data]
    unknown = sorted(set(data) - set(required) - set(optional))
    if missing or unknown:
        raise FixtureInvalid(f"{where}: missing keys {missing}, unknown keys {unknown}")
    return data
