"""Open-Jev's prompt template, as data: one prompt per candidate, and the noul yes-question.

Every candidate of a question is scored in its own prompt, so the model never sees the other
candidates or their order::

    Context:\\n{state}\\n\\nQuestion: {instructions}\\n   (the question's prefix)
    + the candidate line (choice: ``label`` or ``label: description``; score: the level's text)
    or, for noul, the one yes-question.

The prefix is DESIGN.md's; the candidate line and the yes-question follow the public Open-Jev
prompt contract (``Proposed answer: ...`` / ``Is this proposed answer correct? Answer Yes or No.``
and ``Is the answer to this question yes? Answer Yes or No.``), and a noul question that gives
criteria states them after its instructions (``Yes means: ...`` / ``No means: ...``). Request
values that are not strings (a state object, structured instructions or criteria) are shown as
JSON with sorted keys (``content_text``), as that contract renders them. The real
checkpoints keep this wording in their loader's code, not in a file, so it is the documented
default here; a checkpoint that carries a ``prompt_template.json`` overrides it, and the bundle
always carries the template it was built with (its sha256 is the audit's
``prompt_template_sha256``).
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_PROMPT_TEMPLATE",
    "PROMPT_TEMPLATE_FORMAT",
    "PromptTemplate",
    "PromptTemplateInvalid",
    "content_text",
    "question_prompts",
]

#: The template schema this module reads and writes.
PROMPT_TEMPLATE_FORMAT = "open_jev.prompt_template.v1"

#: Template field -> the placeholders it must use, each exactly as named.
_PLACEHOLDERS: dict[str, frozenset[str]] = {
    "prefix": frozenset({"state", "instructions"}),
    "candidate": frozenset({"candidate"}),
    "noul": frozenset(),
    "noul_criteria": frozenset({"true", "false"}),
}


class PromptTemplateInvalid(ValueError):
    """A prompt template that cannot render the prompts; the message names the field."""


@dataclass(frozen=True)
class PromptTemplate:
    """The four strings every Open-Jev prompt is made of, checked once for their placeholders."""

    prefix: str          # "Context:\n{state}\n\nQuestion: {instructions}\n"
    candidate: str       # appended to the prefix once per choice / score candidate
    noul: str            # appended to the prefix of a noul question (the yes-question)
    noul_criteria: str   # appended to a noul question's instructions when it gives criteria

    def __post_init__(self) -> None:
        for name, expected in _PLACEHOLDERS.items():
            value = getattr(self, name)
            if not isinstance(value, str):
                raise PromptTemplateInvalid(f"{name} must be a string, got {type(value).__name__}")
            try:
                used = [field for _, field, _, _ in string.Formatter().parse(value) if field is not None]
            except ValueError as exc:
                raise PromptTemplateInvalid(f"{name}: {exc}") from None
            if set(used) != expected or len(used) != len(expected):
                raise PromptTemplateInvalid(
                    f"{name} must use the placeholders {sorted(expected)} once each, got {used}")
        if not self.candidate.strip() or not self.noul.strip():
            raise PromptTemplateInvalid("candidate and noul must not be blank: every prompt needs its own ending")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "prompt template") -> PromptTemplate:
        """Read the JSON form written by ``to_json``; unknown or missing keys are refused."""
        if not isinstance(data, Mapping):
            raise PromptTemplateInvalid(f"{where}: must be a JSON object")
        if data.get("format") != PROMPT_TEMPLATE_FORMAT:
            raise PromptTemplateInvalid(f"{where}: format must be {PROMPT_TEMPLATE_FORMAT!r}, "
                                        f"got {data.get('format')!r}")
        fields = set(data) - {"format"}
        if fields != set(_PLACEHOLDERS):
            raise PromptTemplateInvalid(f"{where}: needs exactly the keys {sorted(_PLACEHOLDERS)} "
                                        f"besides 'format', got {sorted(fields)}")
        try:
            return cls(**{name: data[name] for name in _PLACEHOLDERS})
        except PromptTemplateInvalid as exc:
            raise PromptTemplateInvalid(f"{where}: {exc}") from None

    @classmethod
    def from_file(cls, path: Path) -> PromptTemplate:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PromptTemplateInvalid(f"{path}: cannot read a prompt template: {exc}") from None
        return cls.from_dict(data, where=str(path))

    def to_json(self) -> str:
        """The canonical file text (sorted keys), so equal templates hash the same."""
        return json.dumps({"format": PROMPT_TEMPLATE_FORMAT, **asdict(self)}, indent=2, sort_keys=True,
                          ensure_ascii=False) + "\n"


DEFAULT_PROMPT_TEMPLATE = PromptTemplate(
    prefix="Context:\n{state}\n\nQuestion: {instructions}\n",
    candidate="Proposed answer: {candidate}\nIs this proposed answer correct? Answer Yes or No.",
    noul="Is the answer to this question yes? Answer Yes or No.",
    noul_criteria="\nYes means: {true}\nNo means: {false}",
)


def content_text(value: Any) -> str:
    """A request value as the prompt shows it: a string as it is, anything else as sorted JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)


def question_prompts(template: PromptTemplate, state_text: str, instructions: str,
                     candidates: Sequence[str] | None, noul_sides: tuple[str, str] | None = None) -> tuple[str, ...]:
    """The prompts of one question, in answer order: one per candidate, or (candidates None) the
    noul yes-question, with its (false, true) criteria texts when it gives criteria."""
    if noul_sides is not None:
        instructions += template.noul_criteria.format(false=noul_sides[0], true=noul_sides[1])
    prefix = template.prefix.format(state=state_text, instructions=instructions)
    if candidates is None:
        return (prefix + template.noul,)
    return tuple(prefix + template.candidate.format(candidate=candidate) for candidate in candidates)
