"""Decoding a question's logits into its answer, checked against the reference's own decoder.

``laya.agent.Agent._decode_answers`` is called directly on the same random logits (no model
needed), so every field, every rounding and every tie is compared exactly.
"""

from __future__ import annotations

import math
import random
import types

import numpy as np
import pytest

from omnigraph.pipelines.laya.decoding import Calibration, act_probabilities, decode_answer, temperature_bucket
from omnigraph.pipelines.system_one.request import RequestLimits, parse_request

TEMPERATURE = [1.2, 0.9, 1.5]
BY_OPTIONS = {"choice:2": 1.1, "choice:3-5": 1.35, "choice:11+": 0.1006, "score:3-5": 7.0}
CALIBRATION = Calibration.from_metadata({"temperature": TEMPERATURE,
                                         "temperature_by_options": BY_OPTIONS, "version": "v1"})


@pytest.mark.parametrize("qtype, k, bucket", [
    ("choice", 1, "choice:2"), ("choice", 2, "choice:2"), ("choice", 3, "choice:3-5"),
    ("score", 5, "score:3-5"), ("score", 6, "score:6-10"), ("noul", 2, "noul:2"),
    ("choice", 10, "choice:6-10"), ("choice", 11, "choice:11+"), ("choice", 100, "choice:11+"),
])
def test_temperature_buckets(qtype, k, bucket):
    assert temperature_bucket(qtype, k) == bucket


def test_temperatures_are_clamped_and_fall_back_to_the_type():
    assert CALIBRATION.temperature_for("choice", 40) == 0.5       # 0.1006 clamped up
    assert CALIBRATION.temperature_for("score", 4) == 5.0         # 7.0 clamped down
    assert CALIBRATION.temperature_for("choice", 2) == 1.1
    assert CALIBRATION.temperature_for("score", 8) == 0.9         # no score:6-10: the type's
    assert CALIBRATION.temperature_for("noul", 2) == 1.5
    assert CALIBRATION.version == "v1"


@pytest.mark.parametrize("calibration, message", [
    ({"temperature": [1.0, 1.0]}, "list of 3"),
    ({"temperature": [1.0, True, 1.0]}, r"temperature\[1\]"),
    ({"temperature": [1.0, 1.0, float("nan")]}, r"temperature\[2\]"),
    ({"temperature_by_options": {"choice:2": "1.0"}}, "choice:2"),
    ({"temperature_by_options": [1.0]}, "temperature_by_options"),
    ({"version": 3}, "version"),
])
def test_a_malformed_calibration_is_refused(calibration, message):
    with pytest.raises(ValueError, match=message):
        Calibration.from_metadata(calibration)


def _questions(rng: random.Random) -> dict:
    questions = {}
    for i in range(60):
        kind = ("choice", "score", "noul")[i % 3]
        k = rng.choice((1, 2, 3, 5, 6, 10, 11, 40, 100)) if kind == "choice" else rng.randint(2, 32)
        if kind == "choice":
            criteria = ([f"label {j}" for j in range(k)] if i % 2 else
                        {f"l{j}": rng.choice((None, "desc", {"w": j})) for j in range(k)})
            questions[f"c{i}"] = {"type": "choice", "instructions": "x", "criteria": criteria}
        elif kind == "score":
            questions[f"s{i}"] = {"type": "score", "instructions": "x",
                                  "criteria": [rng.choice(("lvl", {"d": j}, j)) for j in range(k)]}
        else:
            questions[f"n{i}"] = {"type": "noul", "instructions": "x"}
            k = 2
        if i % 4 == 0:  # shown in a shuffled slot order: the probabilities come back per option
            questions[list(questions)[-1]]["option_order"] = rng.sample(range(k), k)
    return questions


def _logits(rng: np.random.Generator, k: int, row: int) -> np.ndarray:
    style = row % 4
    if style == 0:
        return rng.normal(0, 3, k).astype(np.float32)
    if style == 1:
        return np.full(k, 0.25, dtype=np.float32)                   # all tied: the first wins
    if style == 2:
        return (rng.integers(-2, 3, k) * 40).astype(np.float32)     # large, with ties
    return rng.normal(0, 1e-3, k).astype(np.float32)


def test_answers_equal_the_reference_decoder_on_random_logits():
    torch = pytest.importorskip("torch")
    from laya.agent import Agent
    from laya.common import clamp_temperature

    questions = _questions(random.Random(7))
    parsed = parse_request({"state": "", "questions": questions},
                           RequestLimits(max_total_options=10_000)).questions
    rng = np.random.default_rng(7)
    width = 128
    logits = np.full((len(parsed), width), -1e4, dtype=np.float32)
    for row, question in enumerate(parsed):
        logits[row, :len(question.options)] = _logits(rng, len(question.options), row)
    act_logits = rng.normal(0, 4, (len(parsed), 2)).astype(np.float32)

    reference_self = types.SimpleNamespace(
        temperature=[clamp_temperature(t) for t in TEMPERATURE],
        temperature_by_options={key: clamp_temperature(t) for key, t in BY_OPTIONS.items()},
        lang_temperatures={}, binning_map=None)
    items = [{"markers": list(range(len(q.options)))} for q in parsed]
    internal = {qid: Agent._to_internal(q) for qid, q in questions.items()}
    act = torch.softmax(torch.from_numpy(act_logits), -1).numpy()
    expected = Agent._decode_answers(reference_self, logits, act, items, list(questions), internal, 0)

    acts = act_probabilities(act_logits)
    for row, question in enumerate(parsed):
        answer = decode_answer(question, logits[row], acts[row], CALIBRATION)
        assert answer == expected[question.qid]
        assert list(answer) == list(expected[question.qid])  # field order too


def test_padding_slots_never_reach_the_softmax():
    question = parse_request({"state": "", "questions": {"q": {
        "type": "choice", "instructions": "x", "criteria": ["a", "b", "c"]}}}).questions[0]
    row = np.array([1.0, 2.0, 0.5], dtype=np.float32)
    padded = np.concatenate([row, np.array([50.0, -1e4], dtype=np.float32)])
    act = act_probabilities(np.array([0.3, -0.2], dtype=np.float32))
    assert decode_answer(question, padded, act, CALIBRATION) == decode_answer(question, row, act, CALIBRATION)


def test_choice_score_and_noul_fields():
    parsed = parse_request({"state": "", "questions": {
        "c": {"type": "choice", "instructions": "x", "criteria": {"a": "first", "b": None}},
        "s": {"type": "score", "instructions": "x", "criteria": ["low", "mid", "high"]},
        "n": {"type": "noul", "instructions": "x"},
        "one": {"type": "choice", "instructions": "x", "criteria": ["only"]},
    }}).questions
    act = act_probabilities(np.array([0.0, 0.0], dtype=np.float32))
    choice = decode_answer(parsed[0], np.array([2.0, 2.0], dtype=np.float32), act, CALIBRATION)
    assert choice["choice"] == "a" and choice["probabilities"] == {"a": 0.5, "b": 0.5}
    assert choice["confidence"] == 0.0 and choice["action"] == {"act_probability": 0.5}

    score = decode_answer(parsed[1], np.array([0.0, 0.0, 30.0], dtype=np.float32), act, CALIBRATION)
    p = np.exp(np.array([0.0, 0.0, 30.0]) / 5.0)                  # score:3-5 clamped to 5.0
    p /= p.sum()
    assert score["score"] == round(float(p[1] + 2 * p[2]), 4)
    assert score["legend"] == {"0": "low", "1": "mid", "2": "high"}

    noul = decode_answer(parsed[2], np.array([0.0, 1.5], dtype=np.float32),
                         act_probabilities(np.array([3.0, 0.0], dtype=np.float32)), CALIBRATION)
    p_true = 1.0 / (1.0 + math.exp(-1.0))                         # 1.5 / T(noul) = 1.0
    assert noul == {"type": "noul", "noul": round(p_true, 4), "confidence": round(p_true, 4),
                    "answer_confidence": round(p_true, 4),
                    "action": {"act_probability": round(1.0 / (1.0 + math.exp(-3.0)), 4)}}

    one = decode_answer(parsed[3], np.array([-7.0], dtype=np.float32), act, CALIBRATION)
    assert one["choice"] == "only" and one["probabilities"] == {"only": 1.0}
    assert one["confidence"] == 1.0 and one["answer_confidence"] == 1.0
