"""Cua-S1's prompt as data: the template, its chat rendering and its tokenization.

One question is one prompt: a fixed system message, then a user message

    Goal: <instructions>

    App: Cua Driver
    Task family: closed-candidate decision

    Accessibility tree:
    <state>

    Options:
    A. Decision "<label>" -> select
    B. ...

    Answer with a single letter.

rendered through the checkpoint's chat template with the generation prompt (Qwen's ends in
``<think>\\n``) and tokenized with no extra special tokens. The strings are upstream's
(``cua_s1.four_b.build_prompt`` / ``_describe_option`` and the Cua Driver decision model, which
fills role ``Decision`` and action ``select``); they are the documented defaults, and a checkpoint
may carry its own. Everything that shapes the prompt, the chat template included, travels in the
bundle's ``prompt_template.json``, whose sha256 the audit reports.

The chat template is rendered the way ``transformers`` renders it (``render_jinja_template``): a
sandboxed Jinja environment with ``trim_blocks`` / ``lstrip_blocks``, ``raise_exception``, a
``tojson`` that does not HTML-escape, and the tokenizer's special tokens as template variables. So
the ids equal ``AutoTokenizer.apply_chat_template(..., add_generation_prompt=True)``'s without
importing transformers in the serving path. As there, request text that spells a special token
(``<|im_end|>``) is tokenized as that token: upstream passes such text through unchanged too.
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

__all__ = [
    "LETTERS",
    "PROMPT_TEMPLATE_FORMAT",
    "DEFAULT_SYSTEM_MESSAGE",
    "DEFAULT_USER_MESSAGE",
    "DEFAULT_OPTION_LINE",
    "SPECIAL_TOKEN_KEYS",
    "PromptTemplateInvalid",
    "PromptTemplate",
    "ChatPrompter",
    "compile_chat_template",
    "letter_token_ids",
]

#: The answer letters: option i is shown as LETTERS[i]; at most 26 options.
LETTERS = string.ascii_uppercase
#: The ``format`` of prompt_template.json this module reads and writes.
PROMPT_TEMPLATE_FORMAT = "omnigraph.cua_s1.prompt_template/1"

DEFAULT_SYSTEM_MESSAGE = (
    "You are a one-pass computer-use decision model. You are shown the current state of a screen "
    "and a fixed, closed list of candidate (element, action) options, each given a single letter. "
    "Choose exactly one option: the single best next action to take. Answer with ONLY that "
    "option's letter -- no words, no punctuation, no explanation."
)
DEFAULT_USER_MESSAGE = (
    "Goal: {goal}\n\n"
    "App: Cua Driver\n"
    "Task family: closed-candidate decision\n\n"
    "Accessibility tree:\n{state}\n\n"
    "Options:\n{options}\n\n"
    "Answer with a single letter."
)
DEFAULT_OPTION_LINE = '{letter}. Decision "{label}" -> select'

# The str.format fields each message template must use, each exactly as a bare name.
_USER_FIELDS = frozenset({"goal", "state", "options"})
_OPTION_FIELDS = frozenset({"letter", "label"})
# The special tokens transformers passes to a chat template (its special_tokens_map), when set.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_TEMPLATE_KEYS = ("format", "system_message", "user_message", "option_line", "chat_template", "special_tokens")


class PromptTemplateInvalid(ValueError):
    """A prompt template (file or checkpoint data) is malformed; the message names the key."""


def _check_format_fields(text: str, fields: frozenset[str], key: str) -> None:
    """`text` must be a str.format template using exactly `fields`, each a bare name (no index,
    attribute, conversion or spec), so rendering can only substitute the request's text."""
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise PromptTemplateInvalid(f"{key}: not a valid format string ({exc})") from None
    used = []
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in fields or spec or conversion:
            raise PromptTemplateInvalid(f"{key}: field {{{name}}} is not one of "
                                        f"{', '.join('{%s}' % f for f in sorted(fields))} (bare names only)")
        used.append(name)
    if sorted(used) != sorted(fields):
        raise PromptTemplateInvalid(f"{key}: must use each of {', '.join('{%s}' % f for f in sorted(fields))} "
                                    f"exactly once, uses {used}")


@dataclass(frozen=True)
class PromptTemplate:
    """Everything that turns a question into prompt text; validated once, immutable."""

    system_message: str
    user_message: str                 # str.format fields {goal}, {state}, {options}
    option_line: str                  # str.format fields {letter}, {label}
    chat_template: str                # Jinja, as in the checkpoint's tokenizer_config.json
    special_tokens: Mapping[str, str] = field(default_factory=dict)  # template variables, e.g. eos_token

    def __post_init__(self) -> None:
        for key in ("system_message", "user_message", "option_line", "chat_template"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise PromptTemplateInvalid(f"{key}: must be a non-empty string")
        _check_format_fields(self.user_message, _USER_FIELDS, "user_message")
        _check_format_fields(self.option_line, _OPTION_FIELDS, "option_line")
        if not isinstance(self.special_tokens, Mapping):
            raise PromptTemplateInvalid("special_tokens: must be an object of name -> token text")
        for name, token in self.special_tokens.items():
            if name not in SPECIAL_TOKEN_KEYS or not isinstance(token, str):
                raise PromptTemplateInvalid(f"special_tokens.{name}: must be one of {', '.join(SPECIAL_TOKEN_KEYS)} "
                                            f"with a string value, got {token!r}")
        object.__setattr__(self, "special_tokens", dict(self.special_tokens))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PromptTemplate:
        """Read the object of prompt_template.json (its ``format`` must be this module's)."""
        if not isinstance(data, Mapping):
            raise PromptTemplateInvalid(f"a prompt template must be a JSON object, got {type(data).__name__}")
        if data.get("format") != PROMPT_TEMPLATE_FORMAT:
            raise PromptTemplateInvalid(f"format: expected {PROMPT_TEMPLATE_FORMAT!r}, got {data.get('format')!r}")
        unknown = sorted(set(data) - set(_TEMPLATE_KEYS))
        if unknown:
            raise PromptTemplateInvalid(f"{unknown[0]}: not a prompt template key ({', '.join(_TEMPLATE_KEYS)})")
        missing = [key for key in _TEMPLATE_KEYS if key not in data]
        if missing:
            raise PromptTemplateInvalid(f"{missing[0]}: missing")
        return cls(**{key: data[key] for key in _TEMPLATE_KEYS if key != "format"})

    @classmethod
    def load(cls, path: Path) -> PromptTemplate:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise PromptTemplateInvalid(f"{path}: not a readable JSON file ({exc})") from None
        try:
            return cls.from_dict(data)
        except PromptTemplateInvalid as exc:
            raise PromptTemplateInvalid(f"{path}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"format": PROMPT_TEMPLATE_FORMAT, "system_message": self.system_message,
                "user_message": self.user_message, "option_line": self.option_line,
                "chat_template": self.chat_template, "special_tokens": dict(self.special_tokens)}

    def to_json(self) -> str:
        """The canonical file text (sorted keys), so equal templates hash equal."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"

    def messages(self, goal: str, state: str, labels: Sequence[str]) -> list[dict[str, str]]:
        """The [system, user] chat of one question; `labels` are the option texts in slot order.

        A label is shown between double quotes, so it is escaped as a JSON string body (a quote
        becomes \\", a newline \\n), as upstream's chooser escapes it.
        """
        if not 1 <= len(labels) <= len(LETTERS):
            raise ValueError(f"a prompt shows 1 to {len(LETTERS)} options, got {len(labels)}")
        options = "\n".join(self.option_line.format(letter=letter, label=json.dumps(label, ensure_ascii=False)[1:-1])
                            for letter, label in zip(LETTERS, labels))
        user = self.user_message.format(goal=goal, state=state, options=options)
        return [{"role": "system", "content": self.system_message}, {"role": "user", "content": user}]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' override: JSON without Jinja's HTML escaping.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


def compile_chat_template(source: str) -> jinja2.Template:
    """The chat template compiled in transformers' sandboxed environment (same options and globals)."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise PromptTemplateInvalid(f"chat_template: line {exc.lineno}: {exc.message}") from None


class ChatPrompter:
    """Renders and tokenizes one question's prompt with a template and the backbone's tokenizer."""

    def __init__(self, template: PromptTemplate, tokenizer: Tokenizer) -> None:
        self.template = template
        self._chat = compile_chat_template(template.chat_template)
        self._tokenizer = tokenizer

    def text(self, goal: str, state: str, labels: Sequence[str]) -> str:
        """The rendered chat, generation prompt included."""
        return self._chat.render(messages=self.template.messages(goal, state, labels), tools=None,
                                 documents=None, add_generation_prompt=True, **self.template.special_tokens)

    def encode(self, goal: str, state: str, labels: Sequence[str]) -> list[int]:
        """The prompt's token ids, with no special tokens added around them."""
        return self._tokenizer.encode(self.text(goal, state, labels), add_special_tokens=False).ids



def letter_token_ids(tokenizer: Tokenizer) -> list[int]:
    """The token id of each answer letter A..Z; every letter must be exactly one token."""
    ids = []
    for letter in LETTERS:
        encoded = tokenizer.encode(letter, add_special_tokens=False).ids
        if len(encoded) != 1:
            raise ValueError(f"answer letter {letter!r} is {len(encoded)} tokens of this tokenizer; "
                             f"Cua-S1 needs every letter A..Z to be one token")
        ids.append(encoded[0])
    return ids
