"""The Cua-S1 processor: choice requests in, one prompt per question out, letter logits back.

``prepare`` validates the whole request (``request.py``), renders and tokenizes each question's
prompt (``prompt.py``) and refuses any prompt longer than the backbone's ``max_model_len``; each
question becomes one work item ``{"prompt_token_ids": int64 [T], "prompt_lengths": int64 [1]}``
for the native backbone stage. ``finish`` takes each item's ``letter_logits`` [1, 26] from the
head stage, keeps the first n letters, and answers: ``p = softmax(logits / T)`` over the question's
own options (T = 1 unless the bundle's calibration says otherwise), ties to the first option,
``confidence = 1 - H / ln n``, ``answer_confidence = max p``, everything rounded to 4 decimals.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer

from omnigraph.pipelines.cua_s1.prompt import LETTERS, ChatPrompter, PromptTemplate, letter_token_ids
from omnigraph.pipelines.cua_s1.request import CUA_S1_LIMITS, ChoiceQuestion, ChoiceRequest, parse_choice_request
from omnigraph.pipelines.processor import PreparedRequest, ProcessorOutputInvalid, RequestTooLarge
from omnigraph.pipelines.system_one.decoding import choice_answer, decision_response, softmax, to_option_order
from omnigraph.pipelines.system_one.request import RequestLimits

if TYPE_CHECKING:
    from omnigraph.bundles import VerifiedBundle

__all__ = ["COMPONENT", "INPUT_NAME", "OUTPUT_NAME", "DEFAULT_MODEL_NAME", "WARMUP_REQUEST", "CuaS1Context",
           "CuaS1Processor", "allowed_token_set_hash", "letter_answer"]

#: The bundle component this processor feeds, and its head's input and output.
COMPONENT = "cua_s1.head"
INPUT_NAME = "hidden_states"
OUTPUT_NAME = "letter_logits"

#: The response's ``model`` when the request names none.
DEFAULT_MODEL_NAME = "cua_s1"
# What the processor reads from the manifest's layout.
_LAYOUT_KEYS = ("backbone_dir", "max_model_len", "letter_token_ids", "prompt_template_file", "head_outputs")

#: A real one-question request over a small accessibility tree.
WARMUP_REQUEST: dict[str, Any] = {
    "state": '- Edit "Email" value="" required=True\n- CheckBox "I agree to the terms" checked=False required=True\n'
             '- Button "Create account"',
    "questions": {"next": {"type": "choice", "instructions": "Create the account for jane@example.com.",
                           "criteria": {"fill": 'Fill "Email" with jane@example.com',
                                        "tick": 'Tick "I agree to the terms"',
                                        "submit": 'Click "Create account"'}}},
}


@dataclass(frozen=True)
class CuaS1Context:
    """What ``finish`` needs: the validated request and each question's prompt length."""

    request: ChoiceRequest
    prompt_tokens: tuple[int, ...]   # one per question (= work item), in request order


def letter_answer(question: ChoiceQuestion, logits: np.ndarray, temperature: float) -> dict[str, Any]:
    """The answer from the letter logits of one prompt (slot order, at least n of them)."""
    slot_logits = np.asarray(logits, dtype=np.float32)[:len(question.keys)]
    p = to_option_order(softmax(slot_logits / np.float32(temperature)), question.slot_order)
    return choice_answer(question.keys, p)


def allowed_token_set_hash(token_ids: Sequence[int]) -> str:
    """sha256 of the answer-letter token ids a question may answer with, as the JSON list
    ``[id, ...]`` in letter order (compact separators)."""
    return hashlib.sha256(json.dumps(list(token_ids), separators=(",", ":")).encode("ascii")).hexdigest()


def _checked_layout(bundle: VerifiedBundle) -> Mapping[str, Any]:
    """The manifest's ``layout``, holding what this processor reads, in the forms it needs."""
    where = bundle.manifest_path
    if bundle.manifest.component != COMPONENT:
        raise ValueError(f"{where}: component {bundle.manifest.component!r} is not a {COMPONENT} bundle")
    layout = bundle.manifest.metadata.layout or {}
    missing = [key for key in _LAYOUT_KEYS if key not in layout]
    if missing:
        raise ValueError(f"{where}: layout has no {missing[0]!r}")
    if layout["head_outputs"] != [OUTPUT_NAME]:
        raise ValueError(f"{where}: layout head_outputs {layout['head_outputs']!r} is not [{OUTPUT_NAME!r}]")
    max_model_len = layout["max_model_len"]
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
        raise ValueError(f"{where}: layout max_model_len must be a positive integer, got {max_model_len!r}")
    return layout


def _checked_temperature(bundle: VerifiedBundle) -> float:
    """The calibration's softmax temperature (1.0 when the bundle names none)."""
    temperature = (bundle.manifest.metadata.calibration or {}).get("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"{bundle.manifest_path}: calibration temperature must be a positive number, "
                         f"got {temperature!r}")
    return float(temperature)


class CuaS1Processor:
    """Validates and tokenizes Cua-S1 choices and decodes the letter head's logits."""

    def __init__(self, bundles: Mapping[int, VerifiedBundle], *, limits: RequestLimits = CUA_S1_LIMITS) -> None:
        if len(bundles) != 1:
            raise ValueError(f"the Cua-S1 pipeline has one graph stage (the letter head), so it takes one bundle; "
                             f"got stages {sorted(bundles)}")
        if limits.max_choice_options > len(LETTERS):
            raise ValueError(f"max_choice_options {limits.max_choice_options} exceeds the "
                             f"{len(LETTERS)} answer letters")
        (bundle,) = bundles.values()
        layout = _checked_layout(bundle)
        tokenizer = Tokenizer.from_file(str(bundle.file(f"{layout['backbone_dir']}/tokenizer.json")))
        if letter_token_ids(tokenizer) != layout["letter_token_ids"]:
            raise ValueError(f"{bundle.manifest_path}: layout letter_token_ids {layout['letter_token_ids']} are "
                             f"not the tokenizer's ids of A..Z")
        template = PromptTemplate.load(bundle.file(layout["prompt_template_file"]))
        self._prompter = ChatPrompter(template, tokenizer)
        self._max_model_len: int = layout["max_model_len"]
        self._temperature = _checked_temperature(bundle)
        self._limits = limits
        metadata = bundle.manifest.metadata
        self._letter_ids: list[int] = list(layout["letter_token_ids"])
        lora = layout.get("lora")
        self._audit = {
            "model_hash": bundle.manifest_sha256,
            # The LoRA is merged into the backbone's weights; its own file's sha256 names it.
            "adapter_hash": lora.get("adapter_sha256") if isinstance(lora, Mapping) else None,
            "checkpoint_revision": metadata.checkpoint_revision,
            "calibration_version": (metadata.calibration or {}).get("version", ""),
            "prompt_template_sha256": bundle.manifest.files[layout["prompt_template_file"]],
            "allowed_token_set_hash": allowed_token_set_hash(self._letter_ids),
            "precision": metadata.precision,
            "component": bundle.manifest.component,
        }

    def prepare(self, request: Mapping[str, Any]) -> PreparedRequest:
        """Validate the whole request, then tokenize one prompt per question."""
        choice = parse_choice_request(request, self._limits)
        work, lengths = [], []
        for question in choice.questions:
            labels = [question.labels[i] for i in question.slot_order]
            ids = self._prompter.encode(question.goal, choice.state_text, labels)
            if len(ids) > self._max_model_len:
                raise RequestTooLarge(f"questions.{question.qid}",
                                      f"its prompt is {len(ids)} tokens, over the backbone's max_model_len "
                                      f"{self._max_model_len}; shorten the state, instructions or options")
            work.append({"prompt_token_ids": np.asarray(ids, dtype=np.int64),
                         "prompt_lengths": np.asarray([len(ids)], dtype=np.int64)})
            lengths.append(len(ids))
        return PreparedRequest(calls=tuple(work), context=CuaS1Context(request=choice, prompt_tokens=tuple(lengths)))

    def finish(self, prepared: PreparedRequest, outputs: Sequence[Mapping[str, np.ndarray]]) -> dict:
        """The response: each question answered on its own prompt's letter logits."""
        context: CuaS1Context = prepared.context
        if len(outputs) != len(prepared.calls):
            raise ProcessorOutputInvalid(f"expected {len(prepared.calls)} outputs (one per question), "
                                         f"got {len(outputs)}")
        questions = context.request.questions
        answers = []
        for item, (question, output) in enumerate(zip(questions, outputs)):
            if OUTPUT_NAME not in output:
                raise ProcessorOutputInvalid(f"output {item} has no {OUTPUT_NAME!r} (got {sorted(output)})")
            logits = np.asarray(output[OUTPUT_NAME])
            if logits.shape != (1, len(LETTERS)):
                raise ProcessorOutputInvalid(f"output {item} {OUTPUT_NAME!r} has shape {logits.shape}, "
                                             f"expected (1, {len(LETTERS)})")
            answers.append(letter_answer(question, logits[0], self._temperature))
        return decision_response(
            context.request.model or DEFAULT_MODEL_NAME, [q.qid for q in questions], answers, context.prompt_tokens,
            prompt_template_sha256=self._audit["prompt_template_sha256"],
            allowed_token_set_hash=[allowed_token_set_hash(self._letter_ids[:len(q.keys)]) for q in questions])

    def warmup_request(self) -> dict:
        """A three-option sign-up decision (a fresh copy each time)."""
        return copy.deepcopy(WARMUP_REQUEST)

    def audit(self) -> dict:
        """The bundle, adapter, checkpoint, calibration, prompt template, answer letters and precision
        that produce the answers (``allowed_token_set_hash``: all 26 letters; a response names each
        question's own first n)."""
        return dict(self._audit)

    @property
    def limits(self) -> RequestLimits:
        """The size limits every request is checked against."""
        return self._limits
