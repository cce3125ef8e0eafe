"""From one question's candidate scores to its typed answer.

The head scores every prompt on its own (``head_w . h + b``, float64); only here are a question's
scores brought together, and only that question's: ``p = softmax((v - max(v)) / T)`` over its
complete candidate set with the checkpoint's temperature T, where a noul question's single score
``s`` becomes the two logits ``[0, s]`` (false, true). The answer is then the Decision API's
(``omnigraph.pipelines.system_one.decoding``: ties to the first candidate, entropy confidence, 4 decimals).
Open-Jev has no action head, so its answers carry no ``action``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from omnigraph.pipelines.system_one.decoding import question_answer, softmax
from omnigraph.pipelines.system_one.request import Question

__all__ = ["Calibration", "decode_answer", "question_probabilities"]


@dataclass(frozen=True)
class Calibration:
    """The checkpoint's one temperature (all question types) and the version naming it."""

    temperature: float
    version: str

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"calibration temperature must be a finite number > 0, got {t!r}")
        if not isinstance(self.version, str) or not self.version:
            raise ValueError(f"calibration version must be a non-empty string, got {self.version!r}")
        object.__setattr__(self, "temperature", float(t))

    @classmethod
    def from_metadata(cls, calibration: Mapping[str, Any]) -> Calibration:
        """Read a head bundle manifest's ``calibration`` entry."""
        temperature: Any = calibration.get("temperature")  # unchecked here: __post_init__ checks both
        version: Any = calibration.get("version")
        return cls(temperature=temperature, version=version)


def question_probabilities(qtype: str, scores: np.ndarray, temperature: float) -> np.ndarray:
    """The question's probabilities in answer order (noul: [p_false, p_true]), float64."""
    values = np.asarray(scores, dtype=np.float64)
    if qtype == "noul":
        values = np.array([0.0, values[0]])
    return softmax((values - values.max()) / temperature)


def decode_answer(question: Question, scores: np.ndarray, calibration: Calibration) -> dict[str, Any]:
    """The answer to ``question`` from its candidates' scores (its noul score), in answer order."""
    return question_answer(question, question_probabilities(question.qtype, scores, calibration.temperature))
