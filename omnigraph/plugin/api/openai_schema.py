"""Map an OpenAI structured-output chat request onto decisions, and decisions back onto a completion.

The documented subset (the one `laya.structured` accepts): `response_format` is a `json_schema`
whose top level is an object of properties, each one decision, in schema order:

- a `string` enum (or `const`)          -> `choice` over the enum values;
- a `boolean` (or a `[true, false]` enum) -> `noul`;
- an `integer` with `minimum` and `maximum` (at most 10 levels) -> `score` over those integers.

The property's `description` is the question's instructions. `Optional[...]` (`anyOf` with one
non-null branch, or a `[T, "null"]` type list) and local `$ref`s (pydantic's enums) are unwrapped.
Free text, numbers without bounds, arrays and nested objects have no fixed option set: 400 naming
the property. The conversation becomes the state (see `conversation_state`).

The answer is the JSON object in the assistant message: the chosen enum value, the most probable
integer level, or `true` when p(true) >= 0.5. With `logprobs: true`, `choices[0].logprobs.content`
has one entry per property in schema order: `token` is the chosen value as JSON text, `logprob`
its log probability, and `top_logprobs` (up to `top_logprobs` of them) every option as JSON text
with its log probability, most probable first. A probability of 0 (after rounding to 4 decimals)
is reported as -9999.0, OpenAI's own floor.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from pydantic import ValidationError

from omnigraph.plugin.api.errors import ApiError
from omnigraph.plugin.api.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChoiceLogprobs,
    TokenLogprob,
    TopLogprob,
)

MAX_PROPERTIES = 32
MAX_CHOICE_OPTIONS = 32
MAX_SCORE_LEVELS = 10
#: $ref expansions plus Optional unwraps per property: pydantic's deepest real shape needs 3 (an
#: Optional of a $ref'd enum); the bound keeps a hostile chain of refs from costing unbounded work.
MAX_SCHEMA_NESTING = 16
LOGPROB_FLOOR = -9999.0

SCHEMA_PARAM = "response_format.json_schema.schema"


def _unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, message, code="unsupported_schema", field=param)


@dataclass(frozen=True)
class PropertyDecision:
    """One schema property as one question: `values` are the JSON values in option order."""

    name: str
    kind: str  # "choice" | "noul" | "score"
    question: dict
    values: tuple[Any, ...]


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """Validate the request envelope (400 naming the first bad field, as OpenAI does)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, not {type(body).__name__}", code="invalid_request")
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(part) for part in error["loc"])
        raise ApiError(400, f"{param}: {error['msg']}", code="invalid_request", field=param) from None
    if request.n != 1:
        raise ApiError(400, "n must be 1: a decision has one answer", code="unsupported_parameter", field="n")
    if request.tools:
        raise ApiError(400, "tools are not supported by a decision model", code="unsupported_parameter",
                       field="tools")
    return request


def _resolve_ref(param: str, prop: dict, root: dict, seen: set[str]) -> dict:
    """`prop` with its local `$ref` replaced by the named definition (the referrer's own keys win)."""
    ref = prop["$ref"]
    if not isinstance(ref, str):
        raise _unsupported(param, f"{param}: $ref must be a string")
    for prefix, key in (("#/$defs/", "$defs"), ("#/definitions/", "definitions")):
        defs = root.get(key)
        if ref.startswith(prefix) and isinstance(defs, dict) and ref[len(prefix):] in defs:
            if ref in seen:
                raise _unsupported(param, f"{param}: $ref {ref[:200]!r} is recursive")
            seen.add(ref)
            target = defs[ref[len(prefix):]]
            if not isinstance(target, dict):
                break
            merged = {k: v for k, v in target.items() if k != "description"}
            merged.update((k, v) for k, v in prop.items() if k != "$ref")
            return merged
    raise _unsupported(param, f"{param}: $ref {ref[:200]!r} does not name an entry of this schema's $defs")


def _choice(param: str, name: str, values: Any, description: str | None) -> PropertyDecision:
    if not isinstance(values, list) or not values:
        raise _unsupported(param, f"{param}: enum must be a non-empty array")
    if len(values) == 2 and all(isinstance(v, bool) for v in values) and values[0] != values[1]:
        return _noul(name, description)
    if not all(isinstance(v, str) for v in values):
        raise _unsupported(param, f"{param}: enum values must all be strings to become a choice")
    if len(set(values)) != len(values):
        raise _unsupported(param, f"{param}: enum repeats a value")
    if len(values) > MAX_CHOICE_OPTIONS:
        raise _unsupported(param, f"{param}: {len(values)} enum values exceed {MAX_CHOICE_OPTIONS}")
    question = {"type": "choice", "instructions": description or f"What is `{name}`?",
                "criteria": {value: None for value in values}}
    return PropertyDecision(name, "choice", question, tuple(values))


def _noul(name: str, description: str | None) -> PropertyDecision:
    question = {"type": "noul", "instructions": description or f"Is `{name}` true?"}
    return PropertyDecision(name, "noul", question, (False, True))


def _integer(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _score(param: str, name: str, prop: dict, description: str | None) -> PropertyDecision:
    low, high = prop.get("minimum"), prop.get("maximum")
    if not (_integer(low) and _integer(high)):
        raise _unsupported(param, f"{param}: an integer needs integer minimum and maximum to become a score "
                                  f"(unbounded integers have no fixed option set)")
    if high < low:
        raise _unsupported(param, f"{param}: maximum {high} is below minimum {low}")
    if high - low + 1 > MAX_SCORE_LEVELS:
        raise _unsupported(param, f"{param}: {high - low + 1} levels exceed {MAX_SCORE_LEVELS}; narrow the range "
                                  f"or use a string enum")
    levels = tuple(range(low, high + 1))
    question = {"type": "score", "instructions": description or f"Score `{name}` from {low} to {high}",
                "criteria": [str(level) for level in levels]}
    return PropertyDecision(name, "score", question, levels)


def _property(param: str, name: str, prop: Any, root: dict) -> PropertyDecision:
    """Unwrap `$ref`s and Optional unions (at most `MAX_SCHEMA_NESTING` of them), then map the leaf."""
    seen: set[str] = set()
    for _ in range(MAX_SCHEMA_NESTING + 1):
        if not isinstance(prop, dict):
            raise _unsupported(param, f"{param}: must be a schema object")
        if "$ref" in prop:
            prop = _resolve_ref(param, prop, root, seen)
            continue
        description = prop.get("description")
        if description is not None and not isinstance(description, str):
            raise _unsupported(param, f"{param}: description must be a string")
        branches = prop.get("anyOf") or prop.get("oneOf")
        if branches is None or {"type", "enum", "const"} & prop.keys():
            return _leaf(param, name, prop, description)
        real = [b for b in branches if not (isinstance(b, dict) and b.get("type") == "null")] \
            if isinstance(branches, list) else []
        if len(real) != 1 or not isinstance(real[0], dict):
            raise _unsupported(param, f"{param}: only Optional unions (one non-null branch) are supported")
        prop = {"description": description, **real[0]}
    raise ApiError(400, f"{param}: more than {MAX_SCHEMA_NESTING} nested $ref / anyOf levels "
                        f"(the limit is MAX_SCHEMA_NESTING = {MAX_SCHEMA_NESTING})",
                   code="schema_too_deep", field=param)


def _leaf(param: str, name: str, prop: dict, description: str | None) -> PropertyDecision:
    if "const" in prop:
        return _choice(param, name, [prop["const"]], description)
    if "enum" in prop:
        return _choice(param, name, prop["enum"], description)
    kind = prop.get("type")
    if isinstance(kind, list):
        real_types = [t for t in kind if t != "null"]
        if len(real_types) != 1:
            raise _unsupported(param, f"{param}: a union of {len(real_types)} types has no single option set")
        kind = real_types[0]
    if kind == "boolean":
        return _noul(name, description)
    if kind == "integer":
        return _score(param, name, prop, description)
    if kind == "string":
        raise _unsupported(param, f"{param}: free text cannot be decided; give the string an enum")
    if kind == "number":
        raise _unsupported(param, f"{param}: a number has no fixed option set; use a bounded integer")
    if kind == "object":
        raise _unsupported(param, f"{param}: nested objects are not supported; flatten the schema")
    if kind == "array":
        raise _unsupported(param, f"{param}: arrays are not supported; ask one property per element")
    shown = repr(kind[:100]) if isinstance(kind, str) else f"a {type(kind).__name__}"
    raise _unsupported(param, f"{param}: unsupported schema (type {shown})")


def plan_decisions(request: ChatCompletionRequest) -> tuple[PropertyDecision, ...]:
    """One decision per property of the request's json_schema, in schema order (400 otherwise)."""
    response_format = request.response_format
    if response_format is None or response_format.type != "json_schema":
        given = "none" if response_format is None else response_format.type
        raise ApiError(400, f"response_format must be a json_schema (got {given}): a decision model answers "
                            f"only structured questions", code="unsupported_response_format", field="response_format")
    schema = response_format.json_schema.json_schema if response_format.json_schema else None
    if not isinstance(schema, dict):
        raise _unsupported(SCHEMA_PARAM, f"{SCHEMA_PARAM} is required")
    if schema.get("type", "object") != "object" or not isinstance(schema.get("properties"), dict):
        raise _unsupported(SCHEMA_PARAM, f"{SCHEMA_PARAM}: the top level must be an object with properties")
    properties = schema["properties"]
    if not properties:
        raise _unsupported(f"{SCHEMA_PARAM}.properties", f"{SCHEMA_PARAM}.properties must not be empty")
    if len(properties) > MAX_PROPERTIES:
        raise _unsupported(f"{SCHEMA_PARAM}.properties",
                           f"{len(properties)} properties exceed {MAX_PROPERTIES}")
    return tuple(_property(f"{SCHEMA_PARAM}.properties.{name}", name, prop, schema)
                 for name, prop in properties.items())


def _message_text(index: int, message: ChatMessage) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part_index, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"messages.{index}.content.{part_index}: only text parts can be read",
                           code="unsupported_content", field=f"messages.{index}.content.{part_index}")
        texts.append(part["text"])
    return "\n".join(texts)


def conversation_state(messages: list[ChatMessage]) -> str:
    """The state a decision reads: one message is its text; several are `role: text` lines in order."""
    texts = [_message_text(index, message) for index, message in enumerate(messages)]
    if len(messages) == 1:
        return texts[0]
    return "\n".join(f"{message.role}: {text}" for message, text in zip(messages, texts))


def openai_invalid(error: ApiError) -> ApiError:
    """A decision request the processor refused (422), as OpenAI reports it: 400 naming the chat field."""
    field = error.field or ""
    param: str | None
    if field.startswith("questions."):
        name = field.split(".")[1]
        param = f"{SCHEMA_PARAM}.properties.{name}"
    elif field == "state":
        param = "messages"
    else:
        param = field or None
    return ApiError(400, error.message, code=error.code, field=param)


def decision_prompt(request: ChatCompletionRequest, plan: tuple[PropertyDecision, ...]) -> dict:
    return {"state": conversation_state(request.messages),
            "questions": {decision.name: decision.question for decision in plan}}


def _option_probabilities(decision: PropertyDecision, answer: Mapping[str, Any]) -> list[float]:
    """p of each of `decision.values`, in their order, read from the processor's answer."""
    if decision.kind == "noul":
        p_true = float(answer["noul"])
        return [1.0 - p_true, p_true]
    probabilities = answer["probabilities"]
    if decision.kind == "choice":
        return [float(probabilities[value]) for value in decision.values]
    return [float(probabilities[str(level)]) for level in range(len(decision.values))]


def _chosen_index(decision: PropertyDecision, answer: Mapping[str, Any], probabilities: list[float]) -> int:
    if decision.kind == "noul":
        return 1 if float(answer["noul"]) >= 0.5 else 0
    if decision.kind == "choice":
        return decision.values.index(answer["choice"])
    return max(range(len(probabilities)), key=probabilities.__getitem__)  # ties go to the first level


def _logprob(p: float) -> float:
    return math.log(p) if p > 0 else LOGPROB_FLOOR


def _top(token: str, p: float) -> TopLogprob:
    return TopLogprob(token=token, logprob=_logprob(p), bytes=list(token.encode("utf-8")))


def completion_content(plan: tuple[PropertyDecision, ...], answers: Mapping[str, Any],
                       top_logprobs: int) -> tuple[str, ChoiceLogprobs]:
    """The assistant message (the JSON object of chosen values) and its per-property logprobs."""
    values: dict[str, Any] = {}
    entries = []
    for decision in plan:
        answer = answers[decision.name]
        probabilities = _option_probabilities(decision, answer)
        chosen = _chosen_index(decision, answer, probabilities)
        values[decision.name] = decision.values[chosen]
        ranked = sorted(range(len(decision.values)), key=lambda i: -probabilities[i])[:top_logprobs]
        tokens = [json.dumps(value, ensure_ascii=False) for value in decision.values]
        chosen_top = _top(tokens[chosen], probabilities[chosen])
        entries.append(TokenLogprob(**chosen_top.model_dump(),
                                    top_logprobs=[_top(tokens[i], probabilities[i]) for i in ranked]))
    return json.dumps(values, ensure_ascii=False), ChoiceLogprobs(content=entries)
