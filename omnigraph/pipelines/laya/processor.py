"""The Laya processor: decision requests in, decision-graph tensors out, and back again.

``prepare`` validates the whole request (``request.py``), tokenizes the state once, builds each
question's row (``sequence.py``) and groups the rows into forward batches of this one request:
each holds its real rows, padded in length and marker slots to their buckets. The stage's batch
adapter (``batching.py``) pads the rows of each call, which may merge work of several requests,
and gives each work item back its own rows. ``finish`` takes one ``{"logits", "act_logits"}``
per work item, drops the padding slots, and decodes each question on its own options
(``decoding.py``) into the response the reference's ``system_one`` / ``laya-serve`` return.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from omnigraph.pipelines.laya.decoding import Calibration, act_probabilities, decode_answer
from omnigraph.pipelines.laya.sequence import (
    OPTION_TOKEN_LIMIT,
    PROMPT_TEMPLATE,
    BatchLayout,
    Head,
    LayaTokenizer,
    Row,
    build_head,
    collate,
    head_row,
    pack_batches,
)
from omnigraph.pipelines.processor import PreparedRequest, ProcessorOutputInvalid, RequestInvalid
from omnigraph.pipelines.system_one.decoding import decision_response
from omnigraph.pipelines.system_one.request import DecisionRequest, Question, RequestLimits, parse_request

if TYPE_CHECKING:
    from omnigraph.bundles import VerifiedBundle

__all__ = ["COMPONENT", "DEFAULT_MODEL_NAME", "WARMUP_REQUEST", "LayaContext", "LayaProcessor"]

#: The bundle component this processor feeds.
COMPONENT = "laya.decision"

#: The response's ``model`` when the request names none.
DEFAULT_MODEL_NAME = "laya"

#: The Decision API's own example: a real one-question request that exercises every stage.
WARMUP_REQUEST: dict[str, Any] = {
    "state": "Please refund the duplicate charge.",
    "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}},
}

#: Question heads the processor remembers (keyed by what a head depends on: type, instructions,
#: options, slot order), at most this many, each of questions of at most this many characters;
#: once full it starts over.
_HEAD_MEMO_ENTRIES = 4096
_HEAD_MEMO_MAX_CHARS = 2048


@dataclass(frozen=True)
class LayaContext:
    """What ``finish`` needs: the validated request and which question fills each batch row."""

    request: DecisionRequest
    batches: tuple[tuple[int, ...], ...]   # question indices of each work item's real rows
    row_tokens: tuple[int, ...]            # each question's row length, padding excluded


def _batch_layout(layout: Mapping[str, Any], tokenizer: LayaTokenizer, bundle: VerifiedBundle, *,
                  max_rows: int, max_marker_slots: int) -> BatchLayout:
    """The manifest's ``layout``, checked against the tokenizer and the rows this module builds."""
    where = bundle.manifest_path
    expected = {"rows": "pow2", "marker_bucket": "pow2", "option_layout": "sequential",
                "option_tokens": OPTION_TOKEN_LIMIT, "cls_id": tokenizer.cls_id,
                "sep_id": tokenizer.sep_id, "pad_id": tokenizer.pad_id, "mask_id": tokenizer.mask_id}
    for key, value in expected.items():
        if key in layout and layout[key] != value:
            raise ValueError(f"{where}: layout {key} is {layout[key]!r}; this processor needs {value!r}")
    try:
        return BatchLayout(
            max_len=layout.get("max_len", BatchLayout.max_len),
            head_max_len=layout.get("head_max_len", BatchLayout.head_max_len),
            pad_id=tokenizer.pad_id,
            length_multiple=layout.get("length_multiple", BatchLayout.length_multiple),
            length_multiple_above_256=layout.get("length_multiple_above_256",
                                                 BatchLayout.length_multiple_above_256),
            max_rows=max_rows,
            max_marker_slots=max_marker_slots,
        )
    except ValueError as exc:
        raise ValueError(f"{where}: layout: {exc}") from None


class LayaProcessor:
    """Validates, tokenizes and batches Laya decisions, and decodes the graph's outputs."""

    def __init__(self, bundles: Mapping[int, VerifiedBundle], *,
                 limits: RequestLimits = RequestLimits(),
                 max_rows: int = BatchLayout.max_rows,
                 max_marker_slots: int = BatchLayout.max_marker_slots) -> None:
        if len(bundles) != 1:
            raise ValueError(f"the Laya pipeline has one graph stage, so it takes one bundle; "
                             f"got stages {sorted(bundles)}")
        (self._bundle,) = bundles.values()
        if self._bundle.manifest.component != COMPONENT:
            raise ValueError(f"{self._bundle.manifest_path}: component "
                             f"{self._bundle.manifest.component!r} is not a {COMPONENT} bundle")
        metadata = self._bundle.manifest.metadata
        self._tokenizer = LayaTokenizer(self._bundle.file("tokenizer.json"),
                                        self._bundle.file("tokenizer_config.json"))
        self._layout = _batch_layout(metadata.layout or {}, self._tokenizer, self._bundle,
                                     max_rows=max_rows, max_marker_slots=max_marker_slots)
        self._calibration = Calibration.from_metadata(metadata.calibration or {})
        self._limits = limits
        self._heads: dict[tuple, Head] = {}
        self._head_memo_limits = (_HEAD_MEMO_ENTRIES, _HEAD_MEMO_MAX_CHARS)
        self._audit = {
            "model_hash": self._bundle.manifest_sha256,
            "adapter_hash": None,  # a Laya checkpoint has no adapter
            "calibration_version": self._calibration.version,
            "prompt_template_sha256": hashlib.sha256(PROMPT_TEMPLATE.encode("utf-8")).hexdigest(),
            "allowed_token_set_hash": self._tokenizer.vocabulary_sha256(),
            "precision": metadata.precision,
            "component": self._bundle.manifest.component,
            "checkpoint_revision": metadata.checkpoint_revision,
        }

    @property
    def layout(self) -> BatchLayout:
        return self._layout

    def prepare(self, request: Mapping[str, Any]) -> PreparedRequest:
        """Validate the whole request, then build its forward batches (real rows only)."""
        decision = parse_request(request, self._limits)
        if not decision.questions:
            context = LayaContext(request=decision, batches=(), row_tokens=())
            return PreparedRequest(calls=(), context=context)
        state_ids = self._tokenizer.encode(decision.state_text)
        rows = [self._row(question, state_ids, decision.truncate_left) for question in decision.questions]
        batches = tuple(pack_batches(rows, self._layout))
        work = tuple(collate([rows[i] for i in batch], self._layout) for batch in batches)
        context = LayaContext(request=decision, batches=batches,
                              row_tokens=tuple(len(row.ids) for row in rows))
        return PreparedRequest(calls=work, context=context)

    def _row(self, question: Question, state_ids: list[int], truncate_left: bool) -> Row:
        row = head_row(self._head(question), state_ids, sep_id=self._tokenizer.sep_id,
                       truncate_left=truncate_left, max_len=self._layout.max_len)
        if len(row.markers) != len(question.options):
            raise RequestInvalid(
                f"questions.{question.qid}.criteria",
                f"only {len(row.markers)} of its {len(question.options)} option markers fit in "
                f"max_len={self._layout.max_len} with head_max_len={self._layout.head_max_len}; "
                f"use fewer or shorter options")
        return row

    def _head(self, question: Question) -> Head:
        """The question's head, remembered (the same questions come again and again); reads and
        writes of one dict need no lock."""
        key = (question.qtype, question.instructions, question.options, question.slot_order)
        head = self._heads.get(key)
        if head is None:
            head = build_head(self._tokenizer, question, head_max_len=self._layout.head_max_len)
            entries, max_chars = self._head_memo_limits
            if len(self._heads) >= entries:
                self._heads.clear()
            if len(question.instructions) + sum(map(len, question.options)) <= max_chars:
                self._heads[key] = head
        return head

    def finish(self, prepared: PreparedRequest, outputs: Sequence[Mapping[str, np.ndarray]]) -> dict:
        """The response: each question decoded on its own row and options, padding dropped."""
        context: LayaContext = prepared.context
        if len(outputs) != len(prepared.calls):
            raise ProcessorOutputInvalid(f"expected {len(prepared.calls)} outputs (one per work "
                                         f"item), got {len(outputs)}")
        questions = context.request.questions
        answers: list[dict] = [{} for _ in questions]
        for item, (work, output, batch) in enumerate(zip(prepared.calls, outputs, context.batches)):
            logits, act_logits = self._checked_outputs(item, work, output)
            acts = act_probabilities(act_logits)
            for row, index in enumerate(batch):
                answers[index] = decode_answer(questions[index], logits[row], acts[row], self._calibration)
        return decision_response(context.request.model or DEFAULT_MODEL_NAME, [q.qid for q in questions], answers,
                                 context.row_tokens, prompt_template_sha256=self._audit["prompt_template_sha256"],
                                 allowed_token_set_hash=self._audit["allowed_token_set_hash"])

    @staticmethod
    def _checked_outputs(item: int, work: Mapping[str, np.ndarray],
                         output: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """``logits`` [B, M] and ``act_logits`` [B, 2] of work item ``item``, shaped as its inputs."""
        rows, markers = work["marker_pos"].shape
        checked = {}
        for name, shape in (("logits", (rows, markers)), ("act_logits", (rows, 2))):
            if name not in output:
                raise ProcessorOutputInvalid(f"output {item} has no {name!r} (got {sorted(output)})")
            checked[name] = np.asarray(output[name])
            if checked[name].shape != shape:
                raise ProcessorOutputInvalid(f"output {item} {name!r} has shape "
                                             f"{checked[name].shape}, expected {shape}")
        return checked["logits"], checked["act_logits"]

    def warmup_request(self) -> dict:
        """The Decision API's refund example (a fresh copy each time)."""
        return copy.deepcopy(WARMUP_REQUEST)

    def audit(self) -> dict:
        """The bundle, calibration, prompt template and token set that produce the answers."""
        return dict(self._audit)

    @property
    def limits(self) -> RequestLimits:
        """The size limits every request is checked against."""
        return self._limits
