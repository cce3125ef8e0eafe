"""Validation of a System One decision request into typed questions, for every decision model.

The request is the body of ``POST /v1/systemone``: ``{"model"?, "state", "questions"}``. It is
checked whole, before anything is tokenized, and refused with ``RequestInvalid`` naming the dotted
path of the first offending field. What is accepted, and how questions are rendered into option
texts, follows the reference implementation (``laya`` 0.4.15: ``Agent._check_question``,
``Agent._to_internal``, ``common.render_options`` and the limits of ``laya.serve``) so the same
request reaches the model as the same tokens.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnigraph.pipelines.processor import RequestInvalid, RequestTooLarge

__all__ = [
    "QUESTION_TYPES",
    "NOUL_DEFAULT_TEXTS",
    "RequestLimits",
    "Question",
    "DecisionRequest",
    "parse_request",
]

#: Question type -> the ``qtype`` index the decision graph takes (``laya.common.QTYPES``).
QUESTION_TYPES: dict[str, int] = {"choice": 0, "score": 1, "noul": 2}

#: The option texts a noul question shows when its criteria omit a side: (false, true).
NOUL_DEFAULT_TEXTS = ("no, the statement does not hold", "yes, the statement holds")

_REQUEST_KEYS = ("model", "state", "questions")
_QUESTION_KEYS = ("type", "instructions", "criteria", "labels", "option_order")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class RequestLimits:
    """Size limits of one request; the defaults are ``laya.serve``'s."""

    max_questions: int = 64
    max_state_chars: int = 50_000
    max_choice_options: int = 100
    max_score_levels: int = 32
    max_total_options: int = 512  # choice options plus score levels, as laya.serve counts them

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RequestLimits.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Question:
    """One validated question, rendered the way the model reads it."""

    qid: str | int
    qtype: str                 # "choice" | "score" | "noul"
    instructions: str          # the text after "<type> question: "
    options: tuple[str, ...]   # rendered option texts, in answer order
    keys: tuple[Any, ...]      # choice: the labels as given; score: level indices; noul: ()
    legend: tuple[str, ...]    # score: the rendered level texts; otherwise ()
    slot_order: tuple[int, ...]  # the sequence shows option slot_order[s] in slot s


@dataclass(frozen=True)
class DecisionRequest:
    """A validated request: the state text, how to cut it, and its questions in request order."""

    model: str | None
    state_text: str
    truncate_left: bool        # a conversation list keeps its newest turns
    questions: tuple[Question, ...]


def parse_request(request: Mapping[str, Any], limits: RequestLimits = RequestLimits()) -> DecisionRequest:
    """Validate the whole request and render its questions; raises ``RequestInvalid``."""
    if not isinstance(request, Mapping):
        raise RequestInvalid("request", f"must be an object, got {type(request).__name__}")
    for key in request:
        if key not in _REQUEST_KEYS:
            raise RequestInvalid(str(key), f"is not a field of a decision request (fields: "
                                           f"{', '.join(_REQUEST_KEYS)})")
    model = request.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestInvalid("model", f"must be a string, got {type(model).__name__}")
    state_text, truncate_left = _parse_state(request.get("state"), limits)
    if "questions" not in request:
        raise RequestInvalid("questions", "is required")
    questions = request["questions"]
    if not isinstance(questions, Mapping):
        raise RequestInvalid("questions", f"must be an object of question id -> question, "
                                          f"got {type(questions).__name__}")
    if len(questions) > limits.max_questions:
        raise RequestTooLarge("questions", f"too many questions ({len(questions)} > "
                                           f"{limits.max_questions})")
    parsed = tuple(_parse_question(qid, qdef, limits) for qid, qdef in questions.items())
    total = sum(len(q.options) for q in parsed if q.qtype != "noul")
    if total > limits.max_total_options:
        raise RequestTooLarge("questions", f"too many answer options across questions ({total} > "
                                           f"{limits.max_total_options})")
    return DecisionRequest(model=model, state_text=state_text, truncate_left=truncate_left,
                           questions=parsed)


def _parse_state(state: Any, limits: RequestLimits) -> tuple[str, bool]:
    if state is None:
        raise RequestInvalid("state", "is required: a string, an object or a list of turns")
    if isinstance(state, str):
        text = state
    elif isinstance(state, (dict, list)):
        try:
            text = json.dumps(state, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise RequestInvalid("state", f"must be JSON-serialisable: {exc}") from None
    else:
        raise RequestInvalid("state", f"must be a string, an object or a list, "
                                      f"got {type(state).__name__}")
    if len(text) > limits.max_state_chars:
        raise RequestTooLarge("state", f"state too large ({len(text)} > "
                                       f"{limits.max_state_chars} chars)")
    _refuse_surrogates(text, "state")
    return text, isinstance(state, list)


def _parse_question(qid: Any, qdef: Any, limits: RequestLimits) -> Question:
    if isinstance(qid, bool) or not isinstance(qid, (str, int)) or (
            isinstance(qid, str) and not qid.strip()):
        raise RequestInvalid("questions", f"question id must be a non-empty string, got {qid!r}")
    path = f"questions.{qid}"
    _refuse_surrogates(qid, "questions")
    if not isinstance(qdef, Mapping):
        raise RequestInvalid(path, f"must be an object, got {type(qdef).__name__}")
    for key in qdef:
        if key not in _QUESTION_KEYS:
            raise RequestInvalid(f"{path}.{key}", f"is not a field of a question (fields: "
                                                  f"{', '.join(_QUESTION_KEYS)})")
    qtype = qdef.get("type")
    if not isinstance(qtype, str) or qtype not in QUESTION_TYPES:
        raise RequestInvalid(f"{path}.type", f"unknown type {qtype!r}; use one of "
                                             f"{', '.join(sorted(QUESTION_TYPES))}")
    instructions = _parse_instructions(qdef, f"{path}.instructions")
    if "labels" in qdef and qtype != "noul":
        raise RequestInvalid(f"{path}.labels", "is only supported for noul questions")
    crit_path = f"{path}.criteria"
    crit = qdef.get("criteria")
    keys: tuple[Any, ...] = ()
    legend: tuple[str, ...] = ()
    if qtype == "choice":
        keys, options = _parse_choice(crit, crit_path, limits)
    elif qtype == "score":
        legend = _parse_score(crit, crit_path, limits)
        keys, options = tuple(range(len(legend))), tuple(f"level {i}: {text}"
                                                         for i, text in enumerate(legend))
    else:
        options = _parse_noul(crit, crit_path, qdef.get("labels"), f"{path}.labels")
    slot_order = _parse_option_order(qdef.get("option_order"), len(options), f"{path}.option_order")
    return Question(qid, qtype, instructions, options, keys, legend, slot_order)


def _parse_option_order(order: Any, n: int, path: str) -> tuple[int, ...]:
    """The slot order: a permutation of the option indices, or the options' own order."""
    if order is None:
        return tuple(range(n))
    if (not isinstance(order, (list, tuple)) or len(order) != n
            or any(isinstance(i, bool) or not isinstance(i, int) for i in order)
            or sorted(order) != list(range(n))):
        raise RequestInvalid(path, f"must be a permutation of range({n}) -- one slot per option, "
                                   f"each option once -- got {order!r}")
    return tuple(order)


def _parse_instructions(qdef: Mapping[str, Any], path: str) -> str:
    if "instructions" not in qdef or qdef["instructions"] is None:
        raise RequestInvalid(path, "is required: the text the model should answer")
    ins = qdef["instructions"]
    if isinstance(ins, str):
        if not ins.strip():
            raise RequestInvalid(path, "must not be empty")
        _refuse_surrogates(ins, path)
        return ins
    if isinstance(ins, (dict, list)) and not ins:
        raise RequestInvalid(path, "must not be empty")
    if not isinstance(ins, (dict, list, int, float)):
        raise RequestInvalid(path, f"must be a string, object or list, got {type(ins).__name__}")
    return _json_text(ins, path, separators=None)


def _parse_choice(crit: Any, path: str, limits: RequestLimits) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    if not isinstance(crit, (dict, list)):
        raise RequestInvalid(path, "a choice question takes 'criteria' as an object of label -> "
                                   "description, or a list of labels")
    _check_count(crit, path, "choice", "option", limits.max_choice_options)
    labels = list(crit) if isinstance(crit, list) else list(crit.keys())
    # A label is an answer key twice over: as a Python value (1, 1.0 and True are one dict key)
    # and as the JSON object key it is printed as (1 and "1", true and "true" are one key there).
    first_index: dict[Any, int] = {}
    for i, label in enumerate(labels):
        where = f"{path}.{i}" if isinstance(crit, list) else f"{path}.{label}"
        if label is None or isinstance(label, float) and not math.isfinite(label) or not isinstance(
                label, (str, int, float, bool)):
            raise RequestInvalid(where, f"a choice label is option text and the answer key, so it "
                                        f"must be a string, number or bool, got {label!r}")
        _refuse_surrogates(label, where)
        printed = _printed_key(label)
        for key in (label, printed):
            if key in first_index:
                raise RequestInvalid(where, f"label {label!r} repeats label {first_index[key]} as an answer "
                                            f"key (printed {printed!r}); every option needs its own key "
                                            f"(1, 1.0, true, \"1\" and \"true\" collide)")
        first_index[label] = first_index[printed] = i
    if isinstance(crit, list):
        return tuple(labels), tuple(str(label) for label in labels)
    options = []
    for label, desc in crit.items():
        if desc is None or desc == "":
            options.append(str(label))
        else:
            options.append(f"{label}: {_criterion_text(desc, f'{path}.{label}')}")
    return tuple(labels), tuple(options)


def _check_count(criteria: dict | list, path: str, kind: str, unit: str, limit: int) -> None:
    """A `kind` question lists at least one and at most `limit` of its `unit`s."""
    if not criteria:
        raise RequestInvalid(path, f"a {kind} question needs at least one {unit}")
    if len(criteria) > limit:
        raise RequestTooLarge(path, f"too many {kind} {unit}s ({len(criteria)} > {limit})")


def _printed_key(label: str | float) -> str:
    """The JSON object key `label` becomes in `probabilities` (json.dumps writes non-string keys so)."""
    return label if isinstance(label, str) else json.dumps(label)


def _parse_score(crit: Any, path: str, limits: RequestLimits) -> tuple[str, ...]:
    if not isinstance(crit, list):
        raise RequestInvalid(path, "a score question takes 'criteria' as a list of level "
                                   "descriptions, index 0 first")
    _check_count(crit, path, "score", "level", limits.max_score_levels)
    for i, level in enumerate(crit):
        if level is None:
            raise RequestInvalid(f"{path}.{i}", "score level is null; give every level a "
                                                "description")
    return tuple(_criterion_text(level, f"{path}.{i}") for i, level in enumerate(crit))


def _parse_noul(crit: Any, path: str, labels: Any, labels_path: str) -> tuple[str, str]:
    if crit is not None and not isinstance(crit, dict):
        raise RequestInvalid(path, "a noul question takes 'criteria' as an object with optional "
                                   "'true'/'false' descriptions, or omits it")
    sides: dict[str, Any] = {}
    for key, value in (crit or {}).items():
        side = str(key).lower()
        if side not in ("true", "false"):
            raise RequestInvalid(f"{path}.{key}", "a noul question's criteria are keyed only "
                                                  "'true'/'false'; set 'labels' to word the "
                                                  "answers differently")
        sides[side] = value
    false_label, true_label = _noul_labels(labels, labels_path)
    texts = []
    for side, label, default in (("false", false_label, NOUL_DEFAULT_TEXTS[0]),
                                 ("true", true_label, NOUL_DEFAULT_TEXTS[1])):
        desc = sides.get(side)
        text = default if desc is None or desc == "" else _criterion_text(desc, f"{path}.{side}")
        texts.append(f"{label}: {text}")
    return texts[0], texts[1]


def _noul_labels(labels: Any, path: str) -> tuple[str, str]:
    if labels is None:
        return "false", "true"
    message = "must map exactly 'false' and 'true' to distinct non-empty strings"
    if not isinstance(labels, dict) or set(labels) != {"false", "true"}:
        raise RequestInvalid(path, message)
    false_label, true_label = labels["false"], labels["true"]
    if not isinstance(false_label, str) or not isinstance(true_label, str):
        raise RequestInvalid(path, message)
    false_label, true_label = false_label.strip(), true_label.strip()
    if not false_label or not true_label or false_label == true_label:
        raise RequestInvalid(path, message)
    _refuse_surrogates(false_label + true_label, path)
    return false_label, true_label


def _criterion_text(value: Any, path: str) -> str:
    if isinstance(value, str):
        _refuse_surrogates(value, path)
        return value
    return _json_text(value, path, separators=(", ", ": "))


def _json_text(value: Any, path: str, separators: tuple[str, str] | None) -> str:
    """``value`` as the JSON text the reference renders (``ensure_ascii=False``)."""
    try:
        text = json.dumps(value, ensure_ascii=False, separators=separators, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise RequestInvalid(path, f"must be JSON-serialisable: {exc}") from None
    _refuse_surrogates(text, path)
    return text


def _refuse_surrogates(value: Any, path: str) -> None:
    # str.isascii() reads a flag CPython keeps on every string: most texts need no search.
    if isinstance(value, str) and not value.isascii() and _LONE_SURROGATE.search(value):
        raise RequestInvalid(path, "contains an unpaired surrogate, which cannot be encoded as UTF-8")
