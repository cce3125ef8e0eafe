"""Validation of System One decision requests (the shared parser every model uses): what is refused,
where, and that it mirrors the reference.

Every refusal names the dotted path of the offending field. The first table holds requests the
reference (``laya`` 0.4.15: ``laya.serve``'s request checks and ``Agent._check_question``) also
refuses; the second, requests both accept; the third, the few places this server is stricter.
"""

from __future__ import annotations

import copy

import pytest

from omnigraph.pipelines.processor import RequestInvalid, RequestTooLarge
from omnigraph.pipelines.system_one.request import RequestLimits, parse_request

STATE = "Please refund the duplicate charge."


def _one(question: dict, qid: str = "q") -> dict:
    return {"state": STATE, "questions": {qid: question}}


def _choice(criteria) -> dict:
    return _one({"type": "choice", "instructions": "Which team?", "criteria": criteria})


def _score(criteria) -> dict:
    return _one({"type": "score", "instructions": "How urgent?", "criteria": criteria})


def _noul(**fields) -> dict:
    return _one({"type": "noul", "instructions": "Is it a refund?", **fields})


REFUSED = [
    # (case, request, field, too large)
    ("no state", {"questions": {}}, "state", False),
    ("null state", {"state": None, "questions": {}}, "state", False),
    ("questions not an object", {"state": STATE, "questions": ["q"]}, "questions", False),
    ("too many questions", {"state": STATE, "questions": {
        f"q{i}": {"type": "noul", "instructions": "x"} for i in range(65)}}, "questions", True),
    ("blank question id", _one({"type": "noul", "instructions": "x"}, qid="  "), "questions", False),
    ("question not an object", _one("Is it a refund?"), "questions.q", False),
    ("no type", _one({"instructions": "x"}), "questions.q.type", False),
    ("unknown type", _one({"type": "multi", "instructions": "x"}), "questions.q.type", False),
    ("type not a string", _one({"type": 2, "instructions": "x"}), "questions.q.type", False),
    ("no instructions", _one({"type": "noul"}), "questions.q.instructions", False),
    ("null instructions", _one({"type": "noul", "instructions": None}), "questions.q.instructions", False),
    ("blank instructions", _one({"type": "noul", "instructions": " \n"}), "questions.q.instructions", False),
    ("empty list instructions", _one({"type": "noul", "instructions": []}), "questions.q.instructions", False),
    ("empty object instructions", _one({"type": "noul", "instructions": {}}), "questions.q.instructions", False),
    ("tuple instructions", _one({"type": "noul", "instructions": ("a",)}), "questions.q.instructions", False),
    ("choice without criteria", _one({"type": "choice", "instructions": "x"}), "questions.q.criteria", False),
    ("choice criteria a string", _choice("a, b"), "questions.q.criteria", False),
    ("choice criteria empty list", _choice([]), "questions.q.criteria", False),
    ("choice criteria empty object", _choice({}), "questions.q.criteria", False),
    ("choice label null", _choice(["a", None]), "questions.q.criteria.1", False),
    ("choice label an object", _choice([{"a": 1}]), "questions.q.criteria.0", False),
    ("choice label repeated", _choice(["a", "b", "a"]), "questions.q.criteria.2", False),
    ("choice labels 1 and 1.0", _choice([1, 1.0]), "questions.q.criteria.1", False),
    ("choice labels true and 1", _choice([True, 1]), "questions.q.criteria.1", False),
    ("choice over 100 options", _choice([f"o{i}" for i in range(101)]), "questions.q.criteria", True),
    ("choice with labels", _one({"type": "choice", "instructions": "x", "criteria": ["a", "b"],
                                 "labels": {"false": "n", "true": "y"}}), "questions.q.labels", False),
    ("score criteria an object", _score({"0": "low"}), "questions.q.criteria", False),
    ("score criteria empty", _score([]), "questions.q.criteria", False),
    ("score level null", _score(["low", None]), "questions.q.criteria.1", False),
    ("score over 32 levels", _score([f"l{i}" for i in range(33)]), "questions.q.criteria", True),
    ("score with labels", _one({"type": "score", "instructions": "x", "criteria": ["a", "b"],
                                "labels": None}), "questions.q.labels", False),
    ("noul criteria a string", _noul(criteria="yes"), "questions.q.criteria", False),
    ("noul criteria a list", _noul(criteria=["no", "yes"]), "questions.q.criteria", False),
    ("noul criteria other key", _noul(criteria={"true": "y", "maybe": "m"}), "questions.q.criteria.maybe", False),
    ("noul labels a string", _noul(labels="yes"), "questions.q.labels", False),
    ("noul labels one side", _noul(labels={"true": "y"}), "questions.q.labels", False),
    ("noul labels equal", _noul(labels={"false": "x", "true": " x "}), "questions.q.labels", False),
    ("noul labels blank", _noul(labels={"false": " ", "true": "y"}), "questions.q.labels", False),
    ("noul labels not strings", _noul(labels={"false": 0, "true": 1}), "questions.q.labels", False),
    ("option order repeats a slot", _one({"type": "choice", "instructions": "x", "criteria": ["a", "b"],
                                          "option_order": [0, 0]}), "questions.q.option_order", False),
    ("option order too short", _one({"type": "score", "instructions": "x", "criteria": ["a", "b", "c"],
                                     "option_order": [2, 1]}), "questions.q.option_order", False),
    ("option order of floats", _noul(option_order=[1.0, 0]), "questions.q.option_order", False),
    ("option order of bools", _noul(option_order=[True, False]), "questions.q.option_order", False),
    ("option order a string", _noul(option_order="10"), "questions.q.option_order", False),
    ("over 512 options in all", {"state": STATE, "questions": {
        f"q{i}": {"type": "choice", "instructions": "x", "criteria": [f"o{j}" for j in range(90)]}
        for i in range(6)}}, "questions", True),
    ("state over 50000 chars", {"state": "x" * 50_001, "questions": {}}, "state", True),
    ("object state over 50000 chars", {"state": {"t": "x" * 50_000}, "questions": {}}, "state", True),
    ("lone surrogate in state", {"state": "bad \ud800", "questions": {}}, "state", False),
    ("lone surrogate in instructions", _one({"type": "noul", "instructions": "\udc00"}),
     "questions.q.instructions", False),
    ("lone surrogate in a label", _choice(["ok", "\ud83d"]), "questions.q.criteria.1", False),
    ("lone surrogate in a description", _choice({"ok": "\ud83d"}), "questions.q.criteria.ok", False),
]

ACCEPTED = [
    ("no questions", {"state": STATE, "questions": {}}),
    ("empty string state", {"state": "", "questions": {}}),
    ("object state", {"state": {"ticket": "refund", "n": 2}, "questions": {}}),
    ("turns state", {"state": [{"role": "user", "content": "refund"}], "questions": {}}),
    ("state of exactly 50000 chars", {"state": "x" * 50_000, "questions": {}}),
    ("64 questions", {"state": STATE, "questions": {
        f"q{i}": {"type": "noul", "instructions": "x"} for i in range(64)}}),
    ("exactly 512 options in all", {"state": STATE, "questions": {
        **{f"c{i}": {"type": "choice", "instructions": "x", "criteria": [f"o{j}" for j in range(100)]}
           for i in range(5)},
        "s": {"type": "score", "instructions": "x", "criteria": [f"l{j}" for j in range(12)]}}}),
    ("one-option choice", _choice(["only"])),
    ("100 options", _choice([f"o{i}" for i in range(100)])),
    ("32 levels", _score([f"l{i}" for i in range(32)])),
    ("number and bool labels", _choice([7, 2.5, True, "", "x"])),
    ("descriptions of every kind", _choice({"a": "text", "b": None, "c": "", "d": 0, "e": {"w": 1},
                                            "f": [1, 2], "g": False})),
    ("structured levels", _score(["low", {"desc": "mid", "w": 2}, 3])),
    ("object instructions", _one({"type": "noul", "instructions": {"ask": "refund?"}})),
    ("list instructions", _one({"type": "noul", "instructions": ["refund", "?"]})),
    ("number instructions", _one({"type": "noul", "instructions": 3.5})),
    ("noul without criteria", _noul()),
    ("noul null criteria", _noul(criteria=None)),
    ("noul one side", _noul(criteria={"true": "asks for money back"})),
    ("noul keys in any case", _noul(criteria={"TRUE": "y", "False": "n"})),
    ("noul null labels", _noul(labels=None)),
    ("noul labels", _noul(labels={"false": " B", "true": "A "})),
    ("option order", _one({"type": "choice", "instructions": "x", "criteria": ["a", "b", "c"],
                           "option_order": [2, 0, 1]})),
    ("noul option order", _noul(option_order=[1, 0])),
    ("surrogate pair", {"state": "emoji \U0001F600", "questions": {}}),
]

STRICTER = [
    # The reference ignores unknown fields or accepts these; this server names the field instead.
    ("unknown request field", {"state": STATE, "questions": {}, "max_len": 128}, "max_len"),
    ("unknown question field", _one({"type": "noul", "instructions": "x", "description": "d"}),
     "questions.q.description"),
    ("number state", {"state": 5, "questions": {}}, "state"),
    ("NaN inside the state", {"state": {"x": float("nan")}, "questions": {}}, "state"),
    ("model not a string", {"model": 3, "state": STATE, "questions": {}}, "model"),
    ("NaN label", _choice([float("nan"), "a"]), "questions.q.criteria.0"),
]


def reference_refuses(request: dict) -> bool:
    """Whether laya-serve / Agent refuse `request` before running the model."""
    fastapi = pytest.importorskip("fastapi")
    serve = pytest.importorskip("laya.serve")
    from laya.agent import Agent
    try:
        if serve._has_lone_surrogate(request):
            return True
        serve._check_request_limits(request.get("state"), request.get("questions"))
        for qid, qdef in request["questions"].items():
            Agent._check_question(qid, qdef)
    except (fastapi.HTTPException, ValueError):
        return True
    return False


@pytest.mark.parametrize("case, body, field, too_large", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_with_the_field_path(case, body, field, too_large):
    before = copy.deepcopy(body)
    with pytest.raises(RequestInvalid) as raised:
        parse_request(body)
    assert raised.value.field == field
    assert isinstance(raised.value, RequestTooLarge) is too_large
    assert str(raised.value).startswith(f"{field}: ")
    assert body == before  # nothing was changed
    assert reference_refuses(body), f"the reference accepts {case!r}"


@pytest.mark.parametrize("case, body", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_accepted_as_the_reference_accepts(case, body):
    parsed = parse_request(body)
    assert [q.qid for q in parsed.questions] == list(body["questions"])
    assert not reference_refuses(body)


@pytest.mark.parametrize("case, body, field", STRICTER, ids=[c[0] for c in STRICTER])
def test_stricter_than_the_reference(case, body, field):
    with pytest.raises(RequestInvalid) as raised:
        parse_request(body)
    assert raised.value.field == field
    assert not reference_refuses(body)


def test_rendered_options_follow_the_reference_render_options():
    render_options = pytest.importorskip("laya.common").render_options
    from laya.agent import Agent
    questions = {
        "choice": {"type": "choice", "instructions": "x",
                   "criteria": {"a": "text", "b": None, "c": "", "d": 0, "e": {"w": [1, "é"]}}},
        "labels": {"type": "choice", "instructions": "x", "criteria": [7, 2.5, True, ""]},
        "score": {"type": "score", "instructions": "x", "criteria": ["low", {"d": "mid"}, 3]},
        "noul": {"type": "noul", "instructions": "x"},
        "noul_custom": {"type": "noul", "instructions": {"ask": "é"}, "criteria": {"TRUE": "money"},
                        "labels": {"false": " B", "true": "A "}},
    }
    parsed = parse_request({"state": "", "questions": questions})
    for question in parsed.questions:
        internal = Agent._to_internal(questions[question.qid])
        assert list(question.options) == render_options(internal)
        assert question.instructions == internal["ins"]
    choice, labels, score, noul, _ = parsed.questions
    assert choice.keys == ("a", "b", "c", "d", "e") and labels.keys == (7, 2.5, True, "")
    assert score.keys == (0, 1, 2) and score.legend == ("low", '{"d": "mid"}', "3")
    assert noul.options == ("false: no, the statement does not hold", "true: yes, the statement holds")
    assert noul.slot_order == (0, 1)
    ordered = parse_request(_one({"type": "noul", "instructions": "x", "option_order": [1, 0]}))
    assert ordered.questions[0].slot_order == (1, 0)


def test_states_serialise_as_the_reference_and_lists_cut_from_the_left():
    serialize_state = pytest.importorskip("laya.common").serialize_state
    for state in ("plain é", {"ticket": "é", "n": [1, 2.5, None]}, [{"role": "user", "content": "é"}]):
        parsed = parse_request({"state": state, "questions": {}})
        assert parsed.state_text == serialize_state(state)
        assert parsed.truncate_left is isinstance(state, list)


def test_limits_are_configurable_and_validated():
    small = RequestLimits(max_questions=1)
    with pytest.raises(RequestTooLarge):
        parse_request({"state": "", "questions": {"a": {"type": "noul", "instructions": "x"},
                                                  "b": {"type": "noul", "instructions": "y"}}}, small)
    with pytest.raises(ValueError, match="max_questions"):
        RequestLimits(max_questions=0)
