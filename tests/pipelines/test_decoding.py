"""The Decision API's answers from probabilities, shared by Laya, Cua-S1 and Open-Jev.

Each model's own tests check its answers against its reference implementation; these pin the
shared rules themselves on hand-computed probabilities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from omnigraph.pipelines.system_one.decoding import (
    choice_answer,
    decision_response,
    entropy_confidence,
    noul_answer,
    question_answer,
    score_answer,
    softmax,
    to_option_order,
)


@dataclass(frozen=True)
class Q:
    qtype: str
    keys: tuple[Any, ...] = ()
    legend: tuple[str, ...] = ()


def test_softmax_keeps_the_dtype_and_normalises_the_last_axis():
    z = np.array([[0.0, math.log(3.0)], [1000.0, 1000.0]], dtype=np.float32)
    p = softmax(z)
    assert p.dtype == np.float32
    np.testing.assert_allclose(p, [[0.25, 0.75], [0.5, 0.5]], rtol=1e-6)


def test_slot_values_go_back_to_option_order():
    # slot 0 shows option 2, slot 1 option 0, slot 2 option 1
    assert to_option_order(np.array([0.5, 0.2, 0.3]), (2, 0, 1)).tolist() == [0.2, 0.3, 0.5]


def test_entropy_confidence_is_one_for_certainty_and_zero_for_uniform():
    assert entropy_confidence(np.array([1.0, 0.0, 0.0])) == 1.0
    assert entropy_confidence(np.full(4, 0.25)) == pytest.approx(0.0, abs=1e-12)
    assert entropy_confidence(np.array([1.0])) == 1.0
    p = np.array([0.7, 0.3])
    assert entropy_confidence(p) == pytest.approx(1 + (0.7 * math.log(0.7) + 0.3 * math.log(0.3)) / math.log(2))


def test_a_choice_names_the_first_of_equal_maxima():
    answer = choice_answer(("yes", "no", "maybe"), np.array([0.4, 0.4, 0.2]))
    assert answer == {"type": "choice", "choice": "yes",
                      "probabilities": {"yes": 0.4, "no": 0.4, "maybe": 0.2},
                      "confidence": round(entropy_confidence(np.array([0.4, 0.4, 0.2])), 4),
                      "answer_confidence": 0.4}


def test_a_score_is_the_expected_level_with_its_legend():
    answer = score_answer(("low", "mid", "high"), np.array([0.2, 0.3, 0.5]))
    assert answer["score"] == 1.3
    assert answer["legend"] == {"0": "low", "1": "mid", "2": "high"}
    assert answer["probabilities"] == {"0": 0.2, "1": 0.3, "2": 0.5}
    assert answer["answer_confidence"] == 0.5


def test_a_noul_answer_is_p_true_with_its_side_s_confidence():
    assert noul_answer(np.array([0.8, 0.2])) == {"type": "noul", "noul": 0.2, "confidence": 0.8,
                                                 "answer_confidence": 0.8}


def test_answers_round_to_four_decimals_and_never_exceed_one():
    p = np.array([1.0000001, 0.0], dtype=np.float64)
    answer = choice_answer(("a", "b"), p)
    assert answer["answer_confidence"] == 1.0 and answer["probabilities"] == {"a": 1.0, "b": 0.0}
    assert choice_answer(("a", "b"), np.array([0.123456, 0.876544]))["probabilities"] == {"a": 0.1235, "b": 0.8765}


def test_question_answer_dispatches_on_the_question_type():
    p = np.array([0.25, 0.75])
    assert question_answer(Q("choice", keys=("x", "y")), p) == choice_answer(("x", "y"), p)
    assert question_answer(Q("score", legend=("lo", "hi")), p) == score_answer(("lo", "hi"), p)
    assert question_answer(Q("noul"), p) == noul_answer(p)
    with pytest.raises(ValueError, match="unknown question type 'rank'"):
        question_answer(Q("rank"), p)


def test_the_response_counts_prompt_tokens_only_and_audits_them_per_question():
    answers = [noul_answer(np.array([0.5, 0.5])), choice_answer(("x", "y"), np.array([0.9, 0.1]))]
    assert decision_response("demo", ["first", 7], answers, [12, 30]) == {
        "model": "demo",
        "answers": {"first": answers[0], 7: answers[1]},
        "usage": {"input_tokens": 42, "output_tokens": 0},
        "audit": {"input_tokens": [12, 30]},
    }
    audited = decision_response("demo", ["first", 7], answers, [12, 30], prompt_template_sha256="t",
                                allowed_token_set_hash=["a", "b"])["audit"]
    assert audited == {"prompt_template_sha256": ["t", "t"], "allowed_token_set_hash": ["a", "b"],
                       "input_tokens": [12, 30]}
    with pytest.raises(ValueError, match="allowed_token_set_hash"):
        decision_response("demo", ["first", 7], answers, [12, 30], allowed_token_set_hash=["a"])
    with pytest.raises(ValueError):
        decision_response("demo", ["first", 7], answers[:1], [12, 30])
