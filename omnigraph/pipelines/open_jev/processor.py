"""The Open-Jev processor: decision requests in, candidate prompts out, and back again.

``prepare`` validates the whole request (the Decision API's rules, ``system_one/request.py``, plus
Open-Jev's own: no noul ``labels``, every prompt within the backbone's ``max_model_len``), renders
one prompt per candidate (noul: the yes-question) with the bundle's prompt template
(``prompt.py``) and tokenizes them with the bundle's backbone tokenizer. Each question becomes one
work item holding all its prompts (``prompt_token_ids`` [T], ``prompt_lengths`` [P]), so the
backbone stage batches a question's candidates together and its scores come back together.
Structured request values are shown as sorted JSON (``prompt.content_text``). ``finish`` takes
one ``{"scores": float64 [P]}`` per question and normalises each question over its own complete
candidate set only (``decoding.py``). ``option_order`` is accepted and has no effect: every
candidate is scored in its own prompt, so there is no order to show.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer

from omnigraph.pipelines.open_jev.decoding import Calibration, decode_answer
from omnigraph.pipelines.open_jev.prompt import PromptTemplate, content_text, question_prompts
from omnigraph.pipelines.processor import PreparedRequest, ProcessorOutputInvalid, RequestInvalid, RequestTooLarge
from omnigraph.pipelines.system_one.decoding import decision_response
from omnigraph.pipelines.system_one.request import (
    NOUL_DEFAULT_TEXTS,
    DecisionRequest,
    Question,
    RequestLimits,
    parse_request,
)

if TYPE_CHECKING:
    from omnigraph.bundles import VerifiedBundle

__all__ = [
    "COMPONENT",
    "DEFAULT_MODEL_NAME",
    "HEAD_OUTPUT",
    "PROMPT_TEMPLATE_FILE",
    "WARMUP_REQUEST",
    "OpenJevContext",
    "OpenJevProcessor",
]

#: The bundle component this processor reads (the head stage's bundle).
COMPONENT = "open_jev.head"
#: The head graph's output: one float64 score per prompt.
HEAD_OUTPUT = "scores"
#: The bundle member holding the prompt template.
PROMPT_TEMPLATE_FILE = "prompt_template.json"
#: The response's ``model`` when the request names none.
DEFAULT_MODEL_NAME = "open_jev"

#: A real request through every stage: a noul (one prompt) and a three-candidate choice.
WARMUP_REQUEST: dict[str, Any] = {
    "state": "Please refund the duplicate charge.",
    "questions": {
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        "priority": {"type": "choice", "instructions": "How urgent is this ticket?",
                     "criteria": {"low": "it can wait", "high": "answer today", "urgent": "answer now"}},
    },
}


@dataclass(frozen=True)
class OpenJevContext:
    """What ``finish`` needs: the validated request and each question's prompt count and tokens."""

    request: DecisionRequest
    prompt_counts: tuple[int, ...]   # P of each question's work item
    prompt_tokens: tuple[int, ...]   # each question's prompt tokens, summed over its prompts


def _layout(bundle: VerifiedBundle) -> tuple[str, int]:
    """``backbone_dir`` and ``max_model_len`` of the manifest's layout, checked."""
    layout = bundle.manifest.metadata.layout or {}
    where = bundle.manifest_path
    backbone_dir, max_model_len = layout.get("backbone_dir"), layout.get("max_model_len")
    if not isinstance(backbone_dir, str) or not backbone_dir:
        raise ValueError(f"{where}: layout backbone_dir must name the backbone folder, got {backbone_dir!r}")
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
        raise ValueError(f"{where}: layout max_model_len must be a positive integer, got {max_model_len!r}")
    if layout.get("head_outputs") != [HEAD_OUTPUT]:
        raise ValueError(f"{where}: layout head_outputs is {layout.get('head_outputs')!r}; "
                         f"this processor reads [{HEAD_OUTPUT!r}]")
    return backbone_dir, max_model_len


def _question_texts(question: Question, raw: Mapping[str, Any]
                    ) -> tuple[str, tuple[str, ...] | None, tuple[str, str] | None]:
    """A validated question's instructions, candidate texts (None: noul) and noul criteria texts.

    Read from the request's own values (``parse_request`` has checked them) so that structured
    ones are shown as ``content_text`` renders them; choice labels without a description are shown
    as ``parse_request`` renders them.
    """
    instructions = content_text(raw["instructions"])
    criteria: Any = raw.get("criteria")  # parse_request has checked its shape for the question's type
    if question.qtype == "score":
        return instructions, tuple(content_text(level) for level in criteria), None
    if question.qtype == "choice":
        if isinstance(criteria, list):
            return instructions, question.options, None
        return instructions, tuple(label if desc is None or desc == "" else f"{label}: {content_text(desc)}"
                                   for label, desc in criteria.items()), None
    if "labels" in raw:
        raise RequestInvalid(f"questions.{question.qid}.labels",
                             "Open-Jev asks a noul question as one yes-question, so its answers "
                             "cannot be relabelled; word the criteria instead")
    if not criteria:
        return instructions, None, None
    sides = {str(side).lower(): text for side, text in criteria.items()}
    false_text, true_text = (default if sides.get(side) in (None, "") else content_text(sides[side])
                             for side, default in zip(("false", "true"), NOUL_DEFAULT_TEXTS))
    return instructions, None, (false_text, true_text)


class OpenJevProcessor:
    """Validates requests into per-question candidate prompts and decodes the head's scores."""

    def __init__(self, bundles: Mapping[int, VerifiedBundle], *,
                 limits: RequestLimits = RequestLimits()) -> None:
        if len(bundles) != 1:
            raise ValueError(f"the Open-Jev pipeline has one graph stage (the head), so it takes one "
                             f"bundle; got stages {sorted(bundles)}")
        (self._bundle,) = bundles.values()
        if self._bundle.manifest.component != COMPONENT:
            raise ValueError(f"{self._bundle.manifest_path}: component "
                             f"{self._bundle.manifest.component!r} is not an {COMPONENT} bundle")
        backbone_dir, self._max_model_len = _layout(self._bundle)
        self._tokenizer = Tokenizer.from_file(str(self._bundle.file(f"{backbone_dir}/tokenizer.json")))
        self._template = PromptTemplate.from_file(self._bundle.file(PROMPT_TEMPLATE_FILE))
        metadata = self._bundle.manifest.metadata
        try:
            self._calibration = Calibration.from_metadata(metadata.calibration or {})
        except ValueError as exc:
            raise ValueError(f"{self._bundle.manifest_path}: {exc}") from None
        self._limits = limits
        tokenizer_sha256 = self._bundle.manifest.files[f"{backbone_dir}/tokenizer.json"]
        self._template_sha256 = self._bundle.manifest.files[PROMPT_TEMPLATE_FILE]
        self._tokenizer_sha256 = tokenizer_sha256
        self._audit = {
            "model_hash": self._bundle.manifest_sha256,
            "adapter_hash": None,  # an Open-Jev checkpoint has no adapter
            "calibration_version": self._calibration.version,
            "temperature": self._calibration.temperature,
            "prompt_template_sha256": self._template_sha256,
            "tokenizer_sha256": tokenizer_sha256,
            # The head scores whole candidate prompts, so a prompt may hold any token of the tokenizer.
            "allowed_token_set_hash": self._tokenizer_sha256,
            "precision": metadata.precision,
            "component": self._bundle.manifest.component,
            "checkpoint_revision": metadata.checkpoint_revision,
        }

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def prepare(self, request: Mapping[str, Any]) -> PreparedRequest:
        """Validate the whole request, then build one work item per question."""
        decision = parse_request(request, self._limits)
        state_text = content_text(request["state"])
        prompts = [question_prompts(self._template, state_text,
                                    *_question_texts(question, request["questions"][question.qid]))
                   for question in decision.questions]
        encoded = self._tokenizer.encode_batch([prompt for group in prompts for prompt in group])
        work, counts, tokens, start = [], [], [], 0
        for question, group in zip(decision.questions, prompts):
            ids = [encoded[start + i].ids for i in range(len(group))]
            start += len(group)
            self._check_budget(question, ids)
            lengths = [len(prompt_ids) for prompt_ids in ids]
            work.append({
                "prompt_token_ids": np.fromiter((t for prompt_ids in ids for t in prompt_ids), dtype=np.int64),
                "prompt_lengths": np.asarray(lengths, dtype=np.int64),
            })
            counts.append(len(group))
            tokens.append(sum(lengths))
        context = OpenJevContext(request=decision, prompt_counts=tuple(counts), prompt_tokens=tuple(tokens))
        return PreparedRequest(calls=tuple(work), context=context)

    def _check_budget(self, question: Question, ids: Sequence[Sequence[int]]) -> None:
        """Refuse a question whose longest prompt exceeds ``max_model_len`` (never truncated)."""
        longest = max(range(len(ids)), key=lambda i: len(ids[i]))
        if len(ids[longest]) <= self._max_model_len:
            return
        if question.qtype == "noul":
            field = f"questions.{question.qid}"
        elif question.qtype == "choice":
            field = f"questions.{question.qid}.criteria.{question.keys[longest]}"
        else:
            field = f"questions.{question.qid}.criteria.{longest}"
        raise RequestTooLarge(field, f"its prompt (state, instructions and candidate) has {len(ids[longest])} "
                                     f"tokens, over the backbone's max_model_len={self._max_model_len}; Open-Jev "
                                     f"refuses rather than truncates")

    def finish(self, prepared: PreparedRequest, outputs: Sequence[Mapping[str, np.ndarray]]) -> dict:
        """The response: each question decoded over its own candidates' scores only."""
        context: OpenJevContext = prepared.context
        if len(outputs) != len(prepared.calls):
            raise ProcessorOutputInvalid(f"expected {len(prepared.calls)} outputs (one per question), "
                                         f"got {len(outputs)}")
        questions = context.request.questions
        answers = [decode_answer(question, self._checked_scores(item, output, count), self._calibration)
                   for item, (question, output, count) in enumerate(zip(questions, outputs, context.prompt_counts))]
        return decision_response(context.request.model or DEFAULT_MODEL_NAME, [q.qid for q in questions], answers,
                                 context.prompt_tokens, prompt_template_sha256=self._template_sha256,
                                 allowed_token_set_hash=self._tokenizer_sha256)

    @staticmethod
    def _checked_scores(item: int, output: Mapping[str, np.ndarray], count: int) -> np.ndarray:
        """Work item ``item``'s ``scores``: float64, one finite value per prompt."""
        if HEAD_OUTPUT not in output:
            raise ProcessorOutputInvalid(f"output {item} has no {HEAD_OUTPUT!r} (got {sorted(output)})")
        scores = np.asarray(output[HEAD_OUTPUT])
        if scores.dtype != np.float64 or scores.shape != (count,):
            raise ProcessorOutputInvalid(f"output {item} {HEAD_OUTPUT!r} is {scores.dtype} {scores.shape}, "
                                         f"expected float64 ({count},)")
        if not np.isfinite(scores).all():
            raise ProcessorOutputInvalid(f"output {item} {HEAD_OUTPUT!r} holds non-finite scores")
        return scores

    def warmup_request(self) -> dict:
        """A noul and a choice question (a fresh copy each time)."""
        return copy.deepcopy(WARMUP_REQUEST)

    def audit(self) -> dict:
        """The bundle, calibration, prompt template and tokenizer that produce the answers."""
        return dict(self._audit)

    @property
    def limits(self) -> RequestLimits:
        """The size limits every request is checked against."""
        return self._limits
