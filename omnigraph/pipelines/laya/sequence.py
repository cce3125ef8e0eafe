"""Token sequences of a Laya decision and the bucketed forward batches they travel in.

One question becomes one row: ``[CLS] "<type> question: <instructions>" [SEP] [MASK] opt0
[MASK] opt1 ... [SEP] state [SEP]``, with a marker at each option's ``[MASK]``. The layout and
every budget (48 tokens per option, ``head_max_len`` for the option block, ``max_len`` for the
row, the state cut right, or left for a list of turns) reproduce
``laya.common.build_head`` / ``build_sequence`` token for token, using the bundle's
``tokenizer.json`` through the ``tokenizers`` library the way a transformers fast tokenizer
does with ``add_special_tokens=False``.

Rows are then grouped into forward batches and padded to a few fixed shapes (rows to a power of
two, lengths to a multiple of 16, or 64 above 256, markers to a power of two) so a graph runtime
sees a small set of shapes: padding rows repeat the batch's last row and are dropped by
``finish``; padded tokens have ``attention_mask`` 0 and padded markers ``marker_mask`` False.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from tokenizers import AddedToken, Tokenizer

from omnigraph.pipelines.laya.request import NOUL_DEFAULT_TEXTS, QUESTION_TYPES, Question

__all__ = [
    "OPTION_TOKEN_LIMIT",
    "PROMPT_TEMPLATE",
    "BatchLayout",
    "LayaTokenizer",
    "Row",
    "build_row",
    "pack_batches",
    "collate",
]

#: Tokens kept of one rendered option (the reference's tokenizer-side ``max_length=48``).
OPTION_TOKEN_LIMIT = 48
#: Below this many tokens of head budget left for the instructions, options are cut evenly.
_MIN_INSTRUCTION_BUDGET = 16
#: The fewest tokens an option keeps (its marker included) when options are cut evenly.
_MIN_OPTION_TOKENS = 4
#: The fewest instruction tokens kept however many options there are.
_MIN_INSTRUCTION_TOKENS = 8
#: Question heads and option texts remembered by ``LayaTokenizer`` (at most this many, each at
#: most this long): a few MiB, far more than the distinct questions a deployment asks.
_MEMO_ENTRIES = 8192
_MEMO_MAX_CHARS = 2048

#: What a row is made of; its sha256 is the audit's ``prompt_template_sha256``.
PROMPT_TEMPLATE = json.dumps({
    "sequence": "[CLS] {type} question: {instructions} [SEP] ([MASK] {option})* [SEP] {state} [SEP]",
    "option": "' ' + text, first %d tokens; choice 'label: description' or 'label'; "
              "score 'level i: description'; noul '{false}: ...', '{true}: ...'" % OPTION_TOKEN_LIMIT,
    "noul_defaults": list(NOUL_DEFAULT_TEXTS),
    "option_slots": "in the question's option_order when it gives one",
    "mask_token_in_text": "replaced by ' '",
    "head_budget": "options cut to max(%d, (head_max_len - %d) // n) tokens when fewer than %d "
                   "are left; instructions cut to max(%d, head_max_len - option tokens)"
                   % (_MIN_OPTION_TOKENS, _MIN_INSTRUCTION_BUDGET, _MIN_INSTRUCTION_BUDGET,
                      _MIN_INSTRUCTION_TOKENS),
    "state": "JSON (ensure_ascii=False) unless a string; cut to max_len - head - 1 tokens, "
             "from the left for a list",
    "question_types": QUESTION_TYPES,
}, sort_keys=True)


def _token_content(value: Any) -> str | None:
    """A special token's text, in either form tokenizer_config.json may hold it."""
    if isinstance(value, dict):  # the older serialisation: {"content": "[MASK]", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class LayaTokenizer:
    """The checkpoint's tokenizer, encoding exactly as the reference's fast tokenizer does.

    transformers registers every special token that ``tokenizer_config.json`` names as a special
    added token, and never truncates or pads unless asked; both are reproduced here so text that
    contains e.g. ``[SEP]`` is split the same way.
    """

    def __init__(self, tokenizer_file: Path, config_file: Path) -> None:
        config = json.loads(Path(config_file).read_text(encoding="utf-8"))
        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        named = [_token_content(config.get(key)) for key in
                 ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")]
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        named += [_token_content(token) for token in (extra.values() if isinstance(extra, dict) else extra)]
        known = {token.content for token in self._tokenizer.get_added_tokens_decoder().values()}
        missing = [token for token in dict.fromkeys(named) if token and token not in known]
        if missing:
            self._tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                                for token in missing])
        self._tokenizer.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self.truncation_side = config.get("truncation_side", "right")
        if self.truncation_side not in ("right", "left"):
            raise ValueError(f"{config_file}: truncation_side must be 'right' or 'left', "
                             f"got {self.truncation_side!r}")
        ids = {}
        for role in ("cls_token", "sep_token", "pad_token", "mask_token"):
            token = _token_content(config.get(role))
            token_id = self._tokenizer.token_to_id(token) if token else None
            if token_id is None:
                raise ValueError(f"{config_file}: {role} {token!r} is not in the vocabulary")
            ids[role] = token_id
        self.mask_token = _token_content(config.get("mask_token"))
        self.cls_id, self.sep_id = ids["cls_token"], ids["sep_token"]
        self.pad_id, self.mask_id = ids["pad_token"], ids["mask_token"]
        self._memo: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens; the mask token becomes a space.

        ``encode_batch_fast``, not ``encode``: the same ids, without the character offsets nobody
        reads, and it releases the GIL while it works (the replica threads run meanwhile).
        """
        return self._tokenizer.encode_batch_fast([text.replace(self.mask_token, " ")],
                                                 add_special_tokens=False)[0].ids

    def encode_head(self, text: str) -> tuple[int, ...]:
        """Token ids of a question's head text, memoised (the same questions come again and again)."""
        return self._memoised([text.replace(self.mask_token, " ")])[0]

    def encode_options(self, texts: Sequence[str]) -> list[tuple[int, ...]]:
        """Token ids of each option text (after a leading space), cut to 48 tokens; memoised."""
        encoded = self._memoised([" " + text.replace(self.mask_token, " ") for text in texts])
        if self.truncation_side == "right":
            return [ids[:OPTION_TOKEN_LIMIT] for ids in encoded]
        return [ids[-OPTION_TOKEN_LIMIT:] for ids in encoded]

    def _memoised(self, texts: Sequence[str]) -> list[tuple[int, ...]]:
        """Token ids of each text (mask tokens already replaced): remembered ones from the memo,
        the rest in one tokenizer call.

        Only short texts are kept, and the memo starts over once full, so it stays bounded under
        any traffic; reads and writes of one dict need no lock.
        """
        memo = self._memo
        found = [memo.get(text) for text in texts]
        missing = [text for text, ids in zip(texts, found) if ids is None]
        if missing:
            encodings = self._tokenizer.encode_batch_fast(missing, add_special_tokens=False)
            if len(memo) + len(missing) > _MEMO_ENTRIES:
                memo.clear()
            fresh = {}
            for text, encoding in zip(missing, encodings):
                fresh[text] = tuple(encoding.ids)
                if len(text) <= _MEMO_MAX_CHARS:
                    memo[text] = fresh[text]
            found = [fresh[text] if ids is None else ids for text, ids in zip(texts, found)]
        return found  # type: ignore[return-value]

    def vocabulary_sha256(self) -> str:
        """sha256 of the token set (every token and its id, added tokens included)."""
        vocab = sorted(self._tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Row:
    """One question's token sequence and the position of each slot's marker."""

    ids: tuple[int, ...]
    markers: tuple[int, ...]
    qtype: int


def build_row(tok: LayaTokenizer, question: Question, state_ids: Sequence[int], *,
              truncate_left: bool, max_len: int, head_max_len: int) -> Row:
    """The question's row, as ``laya.common.build_sequence`` lays it out.

    Markers that fall past ``max_len`` are dropped, as the reference drops them; the caller
    refuses a question that lost any.
    """
    head = tok.encode_head(f"{question.qtype} question: {question.instructions}")
    slots = [question.options[i] for i in question.slot_order]
    options = [(tok.mask_id, *ids) for ids in tok.encode_options(slots)]
    budget = head_max_len - sum(map(len, options))
    if budget < _MIN_INSTRUCTION_BUDGET:
        per_option = max(_MIN_OPTION_TOKENS, (head_max_len - _MIN_INSTRUCTION_BUDGET) // len(options))
        options = [o[:per_option] for o in options]
        budget = head_max_len - sum(map(len, options))
    ids = [tok.cls_id, *head[:max(_MIN_INSTRUCTION_TOKENS, budget)], tok.sep_id]
    markers = []
    for option in options:
        markers.append(len(ids))
        ids.extend(option)
    ids.append(tok.sep_id)
    room = max(0, max_len - len(ids) - 1)
    state = state_ids[max(0, len(state_ids) - room):] if truncate_left else state_ids[:room]
    ids.extend(state)
    ids.append(tok.sep_id)
    return Row(ids=tuple(ids[:max_len]), markers=tuple(m for m in markers if m < max_len),
               qtype=QUESTION_TYPES[question.qtype])


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class BatchLayout:
    """Token budgets and the padded shapes of a forward batch."""

    max_len: int = 512                   # tokens per row
    head_max_len: int = 192              # tokens of the option block
    pad_id: int = 0
    length_multiple: int = 16            # lengths round up to this ...
    length_multiple_above_256: int = 64  # ... or to this above 256 tokens, at most max_len
    max_rows: int = 16                   # rows per forward batch (a power of two)
    max_marker_slots: int = 2048         # padded rows x padded markers per forward batch
    min_markers: int = 2                 # the decision head ranks at least two slots

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            minimum = 0 if name == "pad_id" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"BatchLayout.{name} must be an integer >= {minimum}, got {value!r}")
        if _next_power_of_two(self.max_rows) != self.max_rows:
            raise ValueError(f"BatchLayout.max_rows must be a power of two, got {self.max_rows}")

    def rows_bucket(self, rows: int) -> int:
        return _next_power_of_two(rows)

    def length_bucket(self, length: int) -> int:
        step = self.length_multiple if length <= 256 else self.length_multiple_above_256
        return min(self.max_len, -(-length // step) * step)

    def markers_bucket(self, markers: int) -> int:
        return _next_power_of_two(max(markers, self.min_markers))


def pack_batches(rows: Sequence[Row], layout: BatchLayout) -> list[tuple[int, ...]]:
    """Row indices of each forward batch, in request order, within the layout's limits."""
    batches: list[tuple[int, ...]] = []
    current: list[int] = []
    widest = 0
    for index, row in enumerate(rows):
        markers = max(widest, len(row.markers))
        slots = layout.rows_bucket(len(current) + 1) * layout.markers_bucket(markers)
        if current and (len(current) == layout.max_rows or slots > layout.max_marker_slots):
            batches.append(tuple(current))
            current, markers = [], len(row.markers)
        current.append(index)
        widest = markers
    if current:
        batches.append(tuple(current))
    return batches


def collate(rows: Sequence[Row], layout: BatchLayout) -> dict[str, np.ndarray]:
    """The decision graph's inputs for ``rows``, padded to the layout's buckets."""
    n = layout.rows_bucket(len(rows))
    padded = [*rows, *[rows[-1]] * (n - len(rows))]
    length = layout.length_bucket(max(len(r.ids) for r in rows))
    width = layout.markers_bucket(max(len(r.markers) for r in rows))
    input_ids = np.full((n, length), layout.pad_id, dtype=np.int64)
    attention_mask = np.zeros((n, length), dtype=np.int64)
    marker_pos = np.zeros((n, width), dtype=np.int64)
    marker_mask = np.zeros((n, width), dtype=bool)
    for i, row in enumerate(padded):
        input_ids[i, :len(row.ids)] = row.ids
        attention_mask[i, :len(row.ids)] = 1
        marker_pos[i, :len(row.markers)] = row.markers
        marker_mask[i, :len(row.markers)] = True
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "marker_pos": marker_pos,
        "marker_mask": marker_mask,
        "qtype": np.array([row.qtype for row in padded], dtype=np.int64),
    }
