"""Parity of LayaProcessor with the reference implementation (``laya`` 0.4.15) on generated requests.

Each seeded request goes through ``LayaProcessor.prepare``; every question's row must carry the
token ids and marker positions ``laya.common.build_sequence`` builds with the reference's own
tokenizer (``laya.load`` on the synthetic checkpoints). Then the reference model is run on the
request, and ``finish`` on those logits must answer exactly what ``Agent.system_one`` answers, while
the reference model run on the processor's padded tensors must give the same logits up to float
noise.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

pytest.importorskip("laya")
torch = pytest.importorskip("torch")
from laya.agent import Agent  # noqa: E402
from laya.common import build_sequence  # noqa: E402

from omnigraph.pipelines.laya.processor import LayaProcessor  # noqa: E402

N_REQUESTS = 200
N_DECODED = {"tiny": 16, "small": 8}  # each costs two forward passes of the reference model

_WORDS = ("refund charge customer billing duplicate invoice ticket urgent shipping delayed order "
          "account password reset the a to for of and please thanks hello yesterday today was "
          "is not never always maybe question answer level choice score noul true false").split()
_UNICODE = ("café", "naïve", "Straße", "日本語のテキスト", "привет", "مرحبا", "emoji 😀🎉", "Ωμέγα",
            "zero\u200bwidth", "tab\tand\nnewline", "  leading spaces", "quote \"inside\"")
_SPECIAL = ("[MASK]", "[SEP]", "[CLS]", "[PAD]", "[UNK]", "[MASK][MASK]", "x[MASK]y")


def _text(rng: random.Random, n_words: int) -> str:
    words = []
    for _ in range(n_words):
        roll = rng.random()
        words.append(rng.choice(_SPECIAL) if roll < 0.04 else rng.choice(_UNICODE) if roll < 0.12
                     else str(rng.randint(0, 9999)) if roll < 0.16 else rng.choice(_WORDS))
    return " ".join(words) + rng.choice(("", ".", "?", "!"))


def _state(rng: random.Random):
    kind = rng.choice(("short", "short", "long", "object", "turns", "long_turns", "empty"))
    if kind == "short":
        return _text(rng, rng.randint(1, 40))
    if kind == "long":
        return _text(rng, rng.randint(300, 1200))
    if kind == "object":
        return {"ticket": _text(rng, rng.randint(3, 60)), "priority": rng.randint(0, 5),
                "tags": [_text(rng, 1) for _ in range(rng.randint(0, 4))],
                "meta": {"vip": rng.random() < 0.5, "score": round(rng.random(), 3), "note": None}}
    if kind in ("turns", "long_turns"):
        turns = rng.randint(1, 4) if kind == "turns" else rng.randint(20, 60)
        return [{"role": rng.choice(("user", "assistant")), "content": _text(rng, rng.randint(2, 30))}
                for _ in range(turns)]
    return ""


def _instructions(rng: random.Random):
    roll = rng.random()
    if roll < 0.08:
        return {"ask": _text(rng, 5), "strict": True}
    if roll < 0.12:
        return [_text(rng, 3), _text(rng, 2)]
    if roll < 0.14:
        return rng.choice((42, 2.5))
    return _text(rng, rng.randint(1, 25))


def _description(rng: random.Random):
    roll = rng.random()
    if roll < 0.1:
        return None
    if roll < 0.15:
        return ""
    if roll < 0.2:
        return {"desc": _text(rng, 3), "weight": rng.randint(1, 3)}
    if roll < 0.23:
        return rng.choice((0, 1.5, False))
    return _text(rng, rng.randint(1, 60 if rng.random() < 0.1 else 8))


def _choice(rng: random.Random, n: int) -> dict:
    if rng.random() < 0.4:
        if rng.random() < 0.2:
            labels = rng.sample(range(1000), n)
        else:
            labels = list(dict.fromkeys(f"{rng.choice(_WORDS + list(_UNICODE))} {i}" for i in range(n)))
        criteria = labels
    else:
        criteria = {f"{rng.choice(_WORDS)}_{i}": _description(rng) for i in range(n)}
    return {"type": "choice", "instructions": _instructions(rng), "criteria": criteria}


def _score(rng: random.Random, n: int) -> dict:
    levels = [_description(rng) or _text(rng, 2) for _ in range(n)]
    return {"type": "score", "instructions": _instructions(rng), "criteria": levels}


def _noul(rng: random.Random) -> dict:
    question = {"type": "noul", "instructions": _instructions(rng)}
    roll = rng.random()
    if roll < 0.25:
        question["criteria"] = {"true": _text(rng, 6)}
    elif roll < 0.5:
        question["criteria"] = {"False": _text(rng, 4), "true": _description(rng)}
    if rng.random() < 0.3:
        question["labels"] = rng.choice(({"false": "no", "true": "yes"},
                                         {"false": " B ", "true": "A"}, None))
    return question


def generate_request(rng: random.Random) -> dict:
    """One random decision request within laya.serve's limits."""
    n_questions = rng.choice((1, 1, 2, 3, 4, 6))
    questions, options_left = {}, 512
    for i in range(n_questions):
        kind = rng.choice(("choice", "choice", "score", "noul"))
        if kind == "choice" and options_left >= 2:
            n = min(options_left, rng.choice((2, rng.randint(3, 5), rng.randint(6, 10),
                                              rng.randint(11, 100), 100)))
            question, options_left = _choice(rng, n), options_left - n
        elif kind == "score" and options_left >= 2:
            n = min(options_left, rng.randint(2, 32))
            question, options_left = _score(rng, n), options_left - n
        else:
            question = _noul(rng)
        if rng.random() < 0.15:
            n_options = len(question.get("criteria") or ()) if question["type"] != "noul" else 2
            question["option_order"] = rng.sample(range(n_options), n_options)
        qid = rng.choice((f"q{i}", f"réponse_{i}", f"{i}", f"question {i}"))
        questions[qid] = question
    return {"state": _state(rng), "questions": questions}


REQUESTS = [generate_request(random.Random(seed)) for seed in range(N_REQUESTS)]


@pytest.fixture(scope="module")
def pair(request):
    """(size, reference agent, processor) on the same synthetic checkpoint."""
    agent = request.getfixturevalue(f"laya_reference_{request.param}")
    bundle = request.getfixturevalue(f"laya_{request.param}_bundle")
    return request.param, agent, LayaProcessor({0: bundle})


def _rows(prepared) -> list[tuple[list[int], list[int]]]:
    """Each question's (ids, markers), read back out of the padded work tensors."""
    rows = {}
    for work, batch in zip(prepared.calls, prepared.context.batches):
        for row, index in enumerate(batch):
            length = int(work["attention_mask"][row].sum())
            ids = work["input_ids"][row, :length].tolist()
            markers = work["marker_pos"][row][work["marker_mask"][row]].tolist()
            rows[index] = (ids, markers)
    return [rows[i] for i in range(len(rows))]


def _reference_rows(agent, request) -> list[tuple[list[int], list[int]]]:
    state = request["state"]
    out = []
    for qid, qdef in request["questions"].items():
        internal = Agent._to_internal(qdef)
        ids, markers = build_sequence(agent.tok, state, internal,
                                      agent.cfg.get("max_len", 512), agent.cfg.get("head_max_len", 192),
                                      option_order=internal.get("option_order"),
                                      truncate_left=isinstance(state, list))
        out.append((ids, markers))
    return out


def _run_reference_model(agent, prepared) -> list[dict[str, np.ndarray]]:
    """The reference model on the processor's padded work tensors."""
    outputs = []
    with torch.no_grad():
        for work in prepared.calls:
            logits, act_logits = agent.model(*(torch.from_numpy(work[name]) for name in
                                               ("input_ids", "attention_mask", "marker_pos",
                                                "marker_mask", "qtype")))
            outputs.append({"logits": logits.numpy(), "act_logits": act_logits.numpy()})
    return outputs


def _system_one_and_its_logits(agent, request) -> tuple[dict, np.ndarray, np.ndarray]:
    """``system_one``'s response and the logits it decoded (its one forward pass, recorded)."""
    passes = []
    hook = agent.model.register_forward_hook(
        lambda module, args, output: passes.append([t.detach().float().numpy() for t in output]))
    try:
        response = agent.system_one(request["state"], request["questions"])
    finally:
        hook.remove()
    ((logits, act_logits),) = passes
    return response, logits, act_logits


def _in_work_layout(prepared, logits: np.ndarray, act_logits: np.ndarray) -> list[dict[str, np.ndarray]]:
    """Per-question rows placed where the processor's work puts them, as a graph would return them."""
    outputs = []
    for work, batch in zip(prepared.calls, prepared.context.batches):
        rows = [*batch, *[batch[-1]] * (len(work["qtype"]) - len(batch))]
        out_logits = np.full(work["marker_pos"].shape, -1e4, dtype=np.float32)
        for row, index in enumerate(rows):
            k = int(work["marker_mask"][row].sum())
            out_logits[row, :k] = logits[index, :k]
        outputs.append({"logits": out_logits, "act_logits": act_logits[rows]})
    return outputs


def _assert_parity(agent, processor, request) -> None:
    """finish() on the reference's logits answers as system_one; the padded work gives the same logits."""
    prepared = processor.prepare(request)
    reference, logits, act_logits = _system_one_and_its_logits(agent, request)
    response = processor.finish(prepared, _in_work_layout(prepared, logits, act_logits))
    assert response["answers"] == reference["answers"], request
    assert list(response["answers"]) == list(reference["answers"])
    assert response["usage"] == {"input_tokens": reference["usage"]["input_tokens"], "output_tokens": 0}
    # Bucket padding (rows, lengths, marker slots) moves the reference model's logits by float noise only.
    padded = _run_reference_model(agent, prepared)
    for output, expected in zip(padded, _in_work_layout(prepared, logits, act_logits)):
        mask = expected["logits"] > -1e4
        np.testing.assert_allclose(output["logits"][mask], expected["logits"][mask], atol=1e-4)
        np.testing.assert_allclose(output["act_logits"], expected["act_logits"], atol=1e-4)


def test_generated_requests_cover_the_cases_they_claim():
    questions = [q for r in REQUESTS for q in r["questions"].values()]
    choices = [len(q["criteria"]) for q in questions if q["type"] == "choice"]
    levels = [len(q["criteria"]) for q in questions if q["type"] == "score"]
    assert len(REQUESTS) >= 200
    assert min(choices) == 2 and max(choices) == 100
    assert min(levels) == 2 and max(levels) >= 30
    assert any("labels" in q for q in questions) and any("criteria" in q for q in questions
                                                         if q["type"] == "noul")
    assert any(isinstance(r["state"], dict) for r in REQUESTS)
    assert any(isinstance(r["state"], list) for r in REQUESTS)
    assert any(len(r["questions"]) > 1 for r in REQUESTS)
    assert any("[MASK]" in str(r) for r in REQUESTS) and any("日本語" in str(r) for r in REQUESTS)
    assert sum("option_order" in q for q in questions) > 20


@pytest.mark.parametrize("pair", ["tiny", "small"], indirect=True)
def test_token_ids_and_markers_match_build_sequence(pair):
    _, agent, processor = pair
    truncated = 0
    for request in REQUESTS:
        prepared = processor.prepare(request)
        rows = _rows(prepared)
        expected = _reference_rows(agent, request)
        assert rows == expected, request
        truncated += any(len(ids) == processor.layout.max_len for ids, _ in rows)
    assert truncated > 10  # long states reached the max_len cut


@pytest.mark.parametrize("pair", ["tiny", pytest.param("small", marks=pytest.mark.slow)], indirect=True)
def test_answers_match_system_one_given_the_reference_models_logits(pair):
    size, agent, processor = pair
    for request in REQUESTS[:N_DECODED[size]]:
        _assert_parity(agent, processor, request)


def _many_questions_request(n: int) -> dict:
    rng = random.Random(n)
    return {"state": _text(rng, 80),
            "questions": {f"q{i}": (_choice(rng, 60) if i % 3 == 0 else _noul(rng) if i % 3 == 1
                                    else _score(rng, 9)) for i in range(n)}}


@pytest.mark.parametrize("limits, n_questions, n_batches", [
    ({}, 20, 2),                               # over 16 rows per forward batch
    ({}, 16, 1),
    ({"max_marker_slots": 128}, 8, 4),         # over the marker slots of one batch
])
def test_split_batches_answer_as_the_unsplit_reference(laya_reference_tiny, laya_tiny_bundle,
                                                       limits, n_questions, n_batches):
    agent = laya_reference_tiny
    processor = LayaProcessor({0: laya_tiny_bundle}, **limits)
    request = _many_questions_request(n_questions)
    prepared = processor.prepare(request)
    assert len(prepared.calls) == n_batches
    for work in prepared.calls:
        rows, slots = work["marker_pos"].shape
        assert rows <= processor.layout.max_rows and rows * slots <= processor.layout.max_marker_slots
    _assert_parity(agent, processor, request)  # the reference answers all of them in one pass
