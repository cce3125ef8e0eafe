"""Token sequences of a Laya decision and the bucketed forward batches they travel in.

One question becomes one row: ``[CLS] "<type> question: <instructions>" [SEP] [MASK] opt0
[MASK] opt1 ... [SEP] state [SEP]``, with a marker at each option's ``[MASK]``. The layout and
every budget (48 tokens per option, ``head_max_len`` for the option block, ``max_len`` for the
row, the state cut right, or left for a list of turns) reproduce
``laya.common.build_head`` / ``build_sequence`` token for token, using the bundle's
``tokenizer.json`` through the ``tokenizers`` library the way a transformers fast tokenizer
does with ``add_special_tokens=False``.

Rows are then grouped into forward batches and padded to a few fixed shapes (lengths to a
multiple of 16, or 64 above 256, markers to a power of two; the stage's batch adapter pads a
call's rows to a power of two where the runtime needs fixed shapes) so a graph runtime sees a
small set of shapes: padded tokens have ``attention_mask`` 0 and padded markers ``marker_mask``
False.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from omnigraph.pipelines.system_one.request import NOUL_DEFAULT_TEXTS, QUESTION_TYPES, Question

__all__ = [
    "OPTION_TOKEN_LIMIT",
    "PROMPT_TEMPLATE",
    "BatchLayout",
    "LayaTokenizer",
    "Head",
    "Row",
    "build_head",
    "build_row",
    "head_row",
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
#: Pieces of state text (byte-level BPE's pre-tokens: a word with its leading space, a number, a
#: run of punctuation) remembered by ``LayaTokenizer``: at most this many, each at most this long;
#: about 200 bytes each, so under 16 MiB, more than a language's common words.
_PIECE_MEMO_ENTRIES = 65536
_PIECE_MAX_CHARS = 32
#: A text with more than one new piece in this many is encoded whole in one tokenizer call (which
#: then fills the piece memo): a piece encoded on its own costs the tokenizer about 4 times what it
#: costs inside a text.
_PIECES_PER_NEW_PIECE = 4

# GPT-2's pre-tokenizer pattern, which ``tokenizers``' ByteLevel pre-tokenizer applies with
# use_regex (``'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+``),
# spelled for ASCII text, where letters, digits and white space are these plain classes.
_ASCII_SPACE = "\t\n\x0b\x0c\r "
_ASCII_PIECE = re.compile(rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_ASCII_SPACE}A-Za-z0-9]+"
                          rf"|[{_ASCII_SPACE}]+(?![^{_ASCII_SPACE}])|[{_ASCII_SPACE}]+")

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


class _TokenMemo:
    """Token ids of exact strings, bounded: only strings of at most ``max_chars`` characters are
    kept, and once ``entries`` are held it starts over, so it stays bounded under any traffic.
    Reads and writes of one dict need no lock: a thread that misses an entry encodes it again."""

    def __init__(self, entries: int, max_chars: int) -> None:
        self.entries, self.max_chars = entries, max_chars
        self.ids: dict[str, tuple[int, ...]] = {}

    def lookup(self, texts: Sequence[str]) -> list[tuple[int, ...] | None]:
        return list(map(self.ids.get, texts))

    def remember(self, encoded: dict[str, tuple[int, ...]]) -> None:
        if len(self.ids) + len(encoded) > self.entries:
            self.ids.clear()
        for text, ids in encoded.items():
            if len(self.ids) == self.entries:
                break
            if len(text) <= self.max_chars:
                self.ids[text] = ids


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
        ids, tokens = {}, {}
        for role in ("cls_token", "sep_token", "pad_token", "mask_token"):
            token = _token_content(config.get(role))
            token_id = self._tokenizer.token_to_id(token) if token else None
            if token is None or token_id is None:
                raise ValueError(f"{config_file}: {role} {token!r} is not in the vocabulary")
            ids[role], tokens[role] = token_id, token
        self.mask_token = tokens["mask_token"]
        self.cls_id, self.sep_id = ids["cls_token"], ids["sep_token"]
        self.pad_id, self.mask_id = ids["pad_token"], ids["mask_token"]
        self._texts = _TokenMemo(_MEMO_ENTRIES, _MEMO_MAX_CHARS)
        self._pieces = _TokenMemo(_PIECE_MEMO_ENTRIES, _PIECE_MAX_CHARS)
        added = sorted({token.content for token in self._tokenizer.get_added_tokens_decoder().values()},
                       key=len, reverse=True)
        self._added_token = re.compile("|".join(map(re.escape, added))) if added else None
        pre_tokenizer, model = self._tokenizer.pre_tokenizer, self._tokenizer.model
        # Where the text is split exactly as _ASCII_PIECE splits it, and each piece is encoded on
        # its own: no normalizer, GPT-2's byte-level split without a prefix space, BPE without dropout.
        self._splits_ascii_pieces = (
            self._tokenizer.normalizer is None
            and isinstance(pre_tokenizer, pre_tokenizers.ByteLevel) and pre_tokenizer.use_regex
            and not pre_tokenizer.add_prefix_space
            and isinstance(model, models.BPE) and model.dropout is None
            and not model.continuing_subword_prefix and not model.end_of_word_suffix)
        # Bytes of text each vocabulary token stands for: one per character of byte-level BPE.
        vocabulary = self._tokenizer.get_vocab(with_added_tokens=False)
        self._token_bytes = [0] * (max(vocabulary.values(), default=0) + 1)
        for token, token_id in vocabulary.items():
            self._token_bytes[token_id] = len(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens; the mask token becomes a space.

        Byte-level BPE encodes each piece of the text (its pre-tokens) on its own, so for text
        whose pieces ``_split_pieces`` can find, the ids of pieces seen before come from a memo and only
        new pieces reach the tokenizer; a text with many new pieces is encoded whole and its
        pieces remembered. Elsewhere the tokenizer encodes the text whole. The ids are the same
        either way. ``encode_batch_fast``, not ``encode``: the same ids, without the character
        offsets nobody reads, and it releases the GIL while it works.
        """
        text = text.replace(self.mask_token, " ")
        pieces = self._split_pieces(text)
        if pieces is None:
            return self._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        found = self._pieces.lookup(pieces)
        if None in found:
            new = list(dict.fromkeys(piece for piece, ids in zip(pieces, found) if ids is None))
            if len(new) * _PIECES_PER_NEW_PIECE > len(pieces):
                return self._encode_whole(text, pieces)
            encoded = dict(zip(new, self._encode_each(new)))
            self._pieces.remember(encoded)
            found = [encoded[piece] if ids is None else ids for piece, ids in zip(pieces, found)]
        return list(itertools.chain.from_iterable(found))  # type: ignore[arg-type]  # no None left in found

    def _split_pieces(self, text: str) -> list[str] | None:
        """The text's pre-tokens where ``_ASCII_PIECE`` finds them exactly: ASCII text (whose
        letters, digits and spaces it spells) holding no added token (which the tokenizer splits
        out first); None elsewhere."""
        if not (self._splits_ascii_pieces and text.isascii()):
            return None
        if self._added_token is not None and self._added_token.search(text):
            return None
        return _ASCII_PIECE.findall(text)

    def _encode_whole(self, text: str, pieces: list[str]) -> list[int]:
        """The text's ids in one tokenizer call, remembering each piece's ids: in ASCII text a
        piece of n characters is n bytes, so its tokens are the next ones that add up to n bytes."""
        ids = self._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        token_bytes, remembered, position = self._token_bytes, {}, 0
        for piece in pieces:
            start, left = position, len(piece)
            while left > 0 and position < len(ids):
                left -= token_bytes[ids[position]]
                position += 1
            if left:  # the tokens do not end where the piece does: remember nothing
                return ids
            remembered[piece] = tuple(ids[start:position])
        if position == len(ids):
            self._pieces.remember(remembered)
        return ids

    def _encode_each(self, texts: Sequence[str]) -> list[tuple[int, ...]]:
        """Each text's ids, in one tokenizer call."""
        encodings = self._tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        return [tuple(encoding.ids) for encoding in encodings]

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
        the rest in one tokenizer call."""
        found = self._texts.lookup(texts)
        if None not in found:
            return found  # type: ignore[return-value]  # None is not in found (a cast would cost a call)
        new = list(dict.fromkeys(text for text, ids in zip(texts, found) if ids is None))
        encoded = dict(zip(new, self._encode_each(new)))
        self._texts.remember(encoded)
        return [encoded[text] if ids is None else ids for text, ids in zip(texts, found)]

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


@dataclass(frozen=True)
class Head:
    """A question's part of its row, the same whatever the state: ``[CLS] instructions [SEP]
    ([MASK] option)* [SEP]``, and the position of each slot's marker."""

    ids: tuple[int, ...]
    markers: tuple[int, ...]
    qtype: int


def build_head(tok: LayaTokenizer, question: Question, *, head_max_len: int) -> Head:
    """The question's head, as ``laya.common.build_head`` cuts it to ``head_max_len``."""
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
    return Head(ids=tuple(ids), markers=tuple(markers), qtype=QUESTION_TYPES[question.qtype])


def head_row(head: Head, state_ids: Sequence[int], *, sep_id: int, truncate_left: bool, max_len: int) -> Row:
    """The row of a question's head and the state, as ``laya.common.build_sequence`` lays it out:
    the state cut to the room left (its newest tokens kept when ``truncate_left``), then ``[SEP]``.

    Markers that fall past ``max_len`` are dropped, as the reference drops them; the caller
    refuses a question that lost any.
    """
    room = max(0, max_len - len(head.ids) - 1)
    state = state_ids[max(0, len(state_ids) - room):] if truncate_left else state_ids[:room]
    ids = (*head.ids, *state, sep_id)
    if len(ids) <= max_len:
        return Row(ids=ids, markers=head.markers, qtype=head.qtype)
    return Row(ids=ids[:max_len], markers=tuple(m for m in head.markers if m < max_len), qtype=head.qtype)


def build_row(tok: LayaTokenizer, question: Question, state_ids: Sequence[int], *,
              truncate_left: bool, max_len: int, head_max_len: int) -> Row:
    """The question's row: ``build_head`` then ``head_row``."""
    return head_row(build_head(tok, question, head_max_len=head_max_len), state_ids, sep_id=tok.sep_id,
                    truncate_left=truncate_left, max_len=max_len)


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
    """The decision graph's inputs for ``rows``, padded in length and marker slots to the layout's
    buckets; the rows stay as they are (the stage's batch adapter pads a call's rows)."""
    n = len(rows)
    length = layout.length_bucket(max(len(r.ids) for r in rows))
    width = layout.markers_bucket(max(len(r.markers) for r in rows))
    input_ids = np.full((n, length), layout.pad_id, dtype=np.int64)
    attention_mask = np.zeros((n, length), dtype=np.int64)
    marker_pos = np.zeros((n, width), dtype=np.int64)
    marker_mask = np.zeros((n, width), dtype=bool)
    for i, row in enumerate(rows):
        input_ids[i, :len(row.ids)] = row.ids
        attention_mask[i, :len(row.ids)] = 1
        marker_pos[i, :len(row.markers)] = row.markers
        marker_mask[i, :len(row.markers)] = True
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "marker_pos": marker_pos,
        "marker_mask": marker_mask,
        "qtype": np.array([row.qtype for row in rows], dtype=np.int64),
    }
