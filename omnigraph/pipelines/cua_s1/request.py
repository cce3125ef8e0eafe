"""Validation of a decision request for Cua-S1, which answers ``choice`` questions only.

The body is the Decision API's (``{"model"?, "state", "questions"}``). It is checked whole by the
shared strict parser (``omnigraph.pipelines.system_one.request.parse_request``: fields, types, lone
surrogates, duplicate labels, ``option_order``, size limits), then against Cua-S1's contract:
every question a ``choice`` with 2 to 26 options. Each option is shown to the model by its
description when the criteria give one, else by its label, as the Cua Driver's decision model
does; ``instructions`` (required, as everywhere in the Decision API) become the ``Goal:`` line
and ``state`` the accessibility tree.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnigraph.pipelines.cua_s1.prompt import LETTERS
from omnigraph.pipelines.processor import RequestInvalid
from omnigraph.pipelines.system_one.request import RequestLimits, parse_request

__all__ = ["MIN_OPTIONS", "CUA_S1_LIMITS", "ChoiceQuestion", "ChoiceRequest", "parse_choice_request"]

MIN_OPTIONS = 2
#: The Decision API's limits with Cua-S1's letter budget: one letter per option.
CUA_S1_LIMITS = RequestLimits(max_choice_options=len(LETTERS))


@dataclass(frozen=True)
class ChoiceQuestion:
    """One validated choice question, in the terms of the prompt."""

    qid: str | int
    goal: str                    # the instructions as prompt text
    keys: tuple[Any, ...]        # answer keys (the labels as given), in option order
    labels: tuple[str, ...]      # what the prompt shows for each option, in option order
    slot_order: tuple[int, ...]  # letter s shows option slot_order[s]


@dataclass(frozen=True)
class ChoiceRequest:
    """A validated Cua-S1 request: the state text and its questions in request order."""

    model: str | None
    state_text: str
    questions: tuple[ChoiceQuestion, ...]


def parse_choice_request(request: Mapping[str, Any], limits: RequestLimits = CUA_S1_LIMITS) -> ChoiceRequest:
    """Validate the whole request; raises ``RequestInvalid`` naming the first offending field."""
    decision = parse_request(request, limits)
    questions = []
    for question in decision.questions:
        path = f"questions.{question.qid}"
        if question.qtype != "choice":
            raise RequestInvalid(f"{path}.type", f"Cua-S1 answers choice questions only, got {question.qtype!r}")
        if len(question.keys) < MIN_OPTIONS:
            raise RequestInvalid(f"{path}.criteria", f"a Cua-S1 choice needs at least {MIN_OPTIONS} options, "
                                                     f"got {len(question.keys)}")
        criteria = request["questions"][question.qid]["criteria"]
        labels = tuple(_option_text(key, criteria) for key in question.keys)
        questions.append(ChoiceQuestion(question.qid, question.instructions, question.keys, labels,
                                        question.slot_order))
    return ChoiceRequest(decision.model, decision.state_text, tuple(questions))


def _option_text(key: Any, criteria: Any) -> str:
    """The option's description (JSON text unless a string) when one is given, else its label."""
    description = criteria.get(key) if isinstance(criteria, Mapping) else None
    if description is None or description == "":
        return str(key)
    if isinstance(description, str):
        return description
    return json.dumps(description, ensure_ascii=False)
