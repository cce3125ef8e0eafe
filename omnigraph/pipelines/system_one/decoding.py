"""A question's typed answer from its probabilities, the same for every decision model.

Each model turns its own outputs into one probability per option (Laya: tempered option logits,
Cua-S1: letter logits, Open-Jev: tempered candidate scores); the answer built from them is the
Decision API's, computed as ``laya.agent.Agent._decode_answers`` computes it: ties to the first
option, ``confidence = 1 - H / ln k`` (noul: ``max(p_true, 1 - p_true)``),
``answer_confidence = max(p)``, ``score = sum(i * p_i)``, every value rounded to 4 decimals.
Arithmetic stays in the probabilities' own dtype (Laya's float32, Open-Jev's float64), so each
model rounds to the same digits as its reference. ``decision_response`` puts a request's answers
into the Decision API's response.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = [
    "DECIMALS",
    "AnsweredQuestion",
    "choice_answer",
    "decision_response",
    "entropy_confidence",
    "noul_answer",
    "question_answer",
    "score_answer",
    "softmax",
    "to_option_order",
]

#: Answers are rounded to this many decimals, as Laya's are.
DECIMALS = 4


class AnsweredQuestion(Protocol):
    """What an answer needs of a validated question (``laya.request.Question`` has it)."""

    @property
    def qtype(self) -> str: ...               # "choice" | "score" | "noul"

    @property
    def keys(self) -> tuple[Any, ...]: ...    # choice: the labels as given

    @property
    def legend(self) -> tuple[str, ...]: ...  # score: the rendered level texts


def softmax(z: np.ndarray) -> np.ndarray:
    """Probabilities along the last axis, in `z`'s dtype."""
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return p


def to_option_order(slot_values: np.ndarray, slot_order: Sequence[int]) -> np.ndarray:
    """Values given per slot (slot s shows option ``slot_order[s]``) put back in option order."""
    values = np.empty_like(slot_values)
    values[list(slot_order)] = slot_values
    return values


def entropy_confidence(p: np.ndarray) -> float:
    """``1 - H(p) / ln k`` in [0, 1] for k = len(p) options (1 for a single option)."""
    k = len(p)
    if k < 2:
        return 1.0
    entropy = -float((p * np.log(np.clip(p, 1e-12, 1.0))).sum())
    return min(1.0, max(0.0, 1.0 - entropy / math.log(k)))


def _answer_confidence(p: np.ndarray) -> float:
    return round(min(1.0, max(0.0, float(p.max()))), DECIMALS)


def choice_answer(keys: Sequence[Any], p: np.ndarray) -> dict[str, Any]:
    """A choice answer from one probability per key, in key order."""
    return {
        "type": "choice",
        "choice": keys[int(p.argmax())],
        "probabilities": {key: round(float(v), DECIMALS) for key, v in zip(keys, p)},
        "confidence": round(entropy_confidence(p), DECIMALS),
        "answer_confidence": _answer_confidence(p),
    }


def score_answer(legend: Sequence[str], p: np.ndarray) -> dict[str, Any]:
    """A score answer from one probability per level 0..k-1: the expected level and the legend."""
    return {
        "type": "score",
        "score": round(float((np.arange(len(p)) * p).sum()), DECIMALS),
        "legend": {str(i): text for i, text in enumerate(legend)},
        "probabilities": {str(i): round(float(v), DECIMALS) for i, v in enumerate(p)},
        "confidence": round(entropy_confidence(p), DECIMALS),
        "answer_confidence": _answer_confidence(p),
    }


def noul_answer(p: np.ndarray) -> dict[str, Any]:
    """A noul answer from ``[p_false, p_true]``."""
    p_true = float(p[1])
    return {
        "type": "noul",
        "noul": round(p_true, DECIMALS),
        "confidence": round(max(p_true, 1.0 - p_true), DECIMALS),
        "answer_confidence": _answer_confidence(p),
    }


def question_answer(question: AnsweredQuestion, p: np.ndarray) -> dict[str, Any]:
    """The answer of `question`'s type from its probabilities in answer order."""
    if question.qtype == "choice":
        return choice_answer(question.keys, p)
    if question.qtype == "score":
        return score_answer(question.legend, p)
    if question.qtype == "noul":
        return noul_answer(p)
    raise ValueError(f"unknown question type {question.qtype!r}; expected choice, score or noul")


def decision_response(model: str, qids: Sequence[str | int], answers: Sequence[dict[str, Any]],
                      input_tokens: Sequence[int], *, prompt_template_sha256: str | Sequence[str] | None = None,
                      allowed_token_set_hash: str | Sequence[str] | None = None) -> dict[str, Any]:
    """The Decision API's response: each question's answer, usage counting prompt tokens only (a
    decision generates none), and the request's audit as the System One schema has it: lists in
    question order, ``prompt_template_sha256`` and ``allowed_token_set_hash`` (one hash given for
    every question, or one per question; left out when None) and ``input_tokens``."""
    answered = dict(zip(qids, answers, strict=True))
    tokens = [int(count) for count in input_tokens]
    if len(tokens) != len(answered):
        raise ValueError(f"{len(tokens)} input token counts for {len(answered)} questions")
    audit: dict[str, list] = {}
    for key, value in (("prompt_template_sha256", prompt_template_sha256),
                       ("allowed_token_set_hash", allowed_token_set_hash)):
        if value is not None:
            audit[key] = _per_question(key, value, len(answered))
    audit["input_tokens"] = tokens
    return {
        "model": model,
        "answers": answered,
        "usage": {"input_tokens": sum(tokens), "output_tokens": 0},
        "audit": audit,
    }


def _per_question(key: str, value: str | Sequence[str], count: int) -> list[str]:
    """`value` for each of `count` questions: one hash repeated, or one per question already."""
    if isinstance(value, str):
        return [value] * count
    hashes = list(value)
    if len(hashes) != count:
        raise ValueError(f"{len(hashes)} {key} values for {count} questions")
    return hashes
