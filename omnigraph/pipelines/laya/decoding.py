"""From a question's option logits to its typed answer.

Every number is computed as ``laya.agent.Agent._decode_answers`` computes it, in float32 from the
graph's float32 logits, so an answer rounds to the same 4 decimals as the reference's:
temperature by question type and option-count bucket (clamped to [0.5, 5.0]), a softmax over the
question's own options only, ties to the first option, ``confidence = 1 - H / ln k`` (noul:
``max(p_true, 1 - p_true)``), ``answer_confidence = max(p)``, ``score = sum(i * p_i)`` (the
Decision API's answer, ``omnigraph.pipelines.system_one.decoding``) and
``act_probability = softmax(act_logits)[0]``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnigraph.pipelines.system_one.decoding import DECIMALS, question_answer, softmax, to_option_order
from omnigraph.pipelines.system_one.request import QUESTION_TYPES, Question

__all__ = ["TEMPERATURE_MIN", "TEMPERATURE_MAX", "Calibration", "temperature_bucket", "act_probabilities",
           "decode_answer"]

#: Fitted temperatures are confined to this range (``laya.common.clamp_temperature``).
TEMPERATURE_MIN = 0.5
TEMPERATURE_MAX = 5.0


def temperature_bucket(qtype: str, k: int) -> str:
    """The calibration key of a question type and option count, e.g. ``choice:3-5``."""
    size = "2" if k <= 2 else "3-5" if k <= 5 else "6-10" if k <= 10 else "11+"
    return f"{qtype}:{size}"


def _clamped(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"calibration {where} must be a finite number, got {value!r}")
    return min(TEMPERATURE_MAX, max(TEMPERATURE_MIN, float(value)))


@dataclass(frozen=True)
class Calibration:
    """Temperatures per question type and per option-count bucket, clamped once at load."""

    temperature: tuple[float, float, float]           # choice, score, noul
    temperature_by_options: Mapping[str, float] = field(default_factory=dict)
    version: str = ""

    @classmethod
    def from_metadata(cls, calibration: Mapping[str, Any]) -> Calibration:
        """Read a bundle manifest's ``calibration`` entry."""
        raw = calibration.get("temperature", [1.0, 1.0, 1.0])
        if not isinstance(raw, (list, tuple)) or len(raw) != len(QUESTION_TYPES):
            raise ValueError(f"calibration temperature must be a list of {len(QUESTION_TYPES)} "
                             f"numbers (choice, score, noul), got {raw!r}")
        by_options = calibration.get("temperature_by_options") or {}
        if not isinstance(by_options, Mapping):
            raise ValueError(f"calibration temperature_by_options must be an object of bucket -> "
                             f"number, got {by_options!r}")
        version = calibration.get("version", "")
        if not isinstance(version, str):
            raise ValueError(f"calibration version must be a string, got {version!r}")
        choice, score, noul = (_clamped(t, f"temperature[{i}]") for i, t in enumerate(raw))
        return cls(
            temperature=(choice, score, noul),
            temperature_by_options={key: _clamped(t, f"temperature_by_options[{key!r}]")
                                    for key, t in by_options.items()},
            version=version,
        )

    def temperature_for(self, qtype: str, k: int) -> float:
        """The bucket's temperature, else the question type's."""
        return self.temperature_by_options.get(temperature_bucket(qtype, k),
                                               self.temperature[QUESTION_TYPES[qtype]])


def act_probabilities(act_logits: np.ndarray) -> np.ndarray:
    """Each row's ``act_probability``, ``softmax(act_logits)[:, 0]`` over ``[rows, 2]`` logits, in
    float32: the reference's softmax over its batch, once for all rows of a work item."""
    return softmax(np.asarray(act_logits, dtype=np.float32))[..., 0]


def decode_answer(question: Question, logits: np.ndarray, act_probability: float,
                  calibration: Calibration) -> dict[str, Any]:
    """The answer to ``question`` from its ``k`` slot logits and its row's ``act_probabilities``.

    The logits come in slot order; the probabilities are put back in option order first, so
    every field (and a tie's winner) is per option.
    """
    k = len(question.options)
    row = np.asarray(logits, dtype=np.float32)[:k]
    p = to_option_order(softmax(row / calibration.temperature_for(question.qtype, k)), question.slot_order)
    answer = question_answer(question, p)
    answer["action"] = {"act_probability": round(float(act_probability), DECIMALS)}
    return answer
