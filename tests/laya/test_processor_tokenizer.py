"""LayaTokenizer (the `tokenizers` library alone) encodes as the reference's transformers tokenizer.

The synthetic checkpoints exercise the default configuration; these cases change the
tokenizer_config.json settings transformers acts on: special tokens it registers, whether special
tokens are split, and which side a 48-token option cut keeps.
"""

from __future__ import annotations

import json
import random
import shutil
import warnings

import pytest
from tokenizers import Tokenizer

from omnigraph.pipelines.laya.sequence import OPTION_TOKEN_LIMIT, LayaTokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["hello <extra> world [SEP] x [CLS]y", "a<extra>b [MASK] c", " [PAD] [UNK] ", "é 日本 😀 " * 30, ""]


@pytest.mark.parametrize("change", [
    {},
    {"extra_special_tokens": ["<extra>"]},
    {"additional_special_tokens": ["<extra>"]},
    {"split_special_tokens": True},
    {"truncation_side": "left"},
], ids=["default", "extra special token", "additional special token", "split special tokens",
        "left truncation"])
def test_encodes_as_the_transformers_tokenizer(laya_tiny_bundle, tmp_path, change):
    shutil.copy(laya_tiny_bundle.file("tokenizer.json"), tmp_path / "tokenizer.json")
    config = json.loads(laya_tiny_bundle.file("tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    tokenizer = LayaTokenizer(tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json")
    mask = reference.mask_token
    for text in TEXTS:
        assert tokenizer.encode(text) == reference(text.replace(mask, " "), add_special_tokens=False)["input_ids"]
        assert list(tokenizer.encode_head(text)) == tokenizer.encode(text)
        for _ in range(2):  # the second time from the memo
            assert [list(ids) for ids in tokenizer.encode_options([text])] == [reference(
                " " + text.replace(mask, " "), add_special_tokens=False, truncation=True,
                max_length=OPTION_TOKEN_LIMIT)["input_ids"]]
    if "extra_special_tokens" in change or "additional_special_tokens" in change:
        assert len(tokenizer.encode("<extra>")) == 1  # registered as one special token


def test_a_config_naming_an_unknown_mask_token_is_refused(laya_tiny_bundle, tmp_path):
    config = json.loads(laya_tiny_bundle.file("tokenizer_config.json").read_text())
    del config["mask_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mask_token"):
        LayaTokenizer(laya_tiny_bundle.file("tokenizer.json"), tmp_path / "tokenizer_config.json")


def test_the_memo_of_heads_and_options_stays_bounded(laya_tiny_bundle, monkeypatch):
    """Heads and options are remembered, but only short ones, and the memo starts over once full;
    what comes back is the same either way."""
    from omnigraph.pipelines.laya import sequence

    monkeypatch.setattr(sequence, "_MEMO_ENTRIES", 3)
    monkeypatch.setattr(sequence, "_MEMO_MAX_CHARS", 20)
    tokenizer = LayaTokenizer(laya_tiny_bundle.file("tokenizer.json"), laya_tiny_bundle.file("tokenizer_config.json"))
    long_text = "refund " * 10
    assert list(tokenizer.encode_head(long_text)) == tokenizer.encode(long_text)
    assert tokenizer._texts.ids == {}  # too long to keep
    texts = ["billing", "support", "sales"]
    first = tokenizer.encode_options(texts)
    assert len(tokenizer._texts.ids) == 3
    # A remembered text and a new one: the memo is full, so it starts over with the new one.
    assert tokenizer.encode_options(["billing", "refund"]) == [first[0], tuple(tokenizer.encode(" refund"))]
    assert set(tokenizer._texts.ids) == {" refund"}


# Fragments of ASCII text where GPT-2's pre-tokenizer pattern has edge cases: contractions (only
# lower case ones are pieces), runs of white space before a word or at the end, control characters
# (white space or not), punctuation runs, digits next to letters.
_FRAGMENTS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'", "''", " ", "  ", "   ", "\n", "\r\n",
              "\t", " \n ", "\x0b", "\x0c", "\x1c", "\x1f", "\x00", "\x7f", "refund", " the", " charge",
              "123", "4.5", "...", "it's", " I'm", "don't", "x2y", "{\"a\": [1, 2]}")


def _ascii_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(0, 40)):
            if rng.random() < 0.7:
                parts.append(rng.choice(_FRAGMENTS))
            else:
                parts.append("".join(chr(rng.randrange(128)) for _ in range(rng.randint(1, 4))))
        texts.append("".join(parts))
    return texts


@pytest.mark.parametrize("new_pieces", ["whole text", "new pieces alone"])
def test_the_piece_memo_encodes_as_the_tokenizer(laya_small_bundle, monkeypatch, new_pieces):
    """ASCII text goes through the piece memo: its ids are the tokenizer's, whether the new pieces
    are encoded in the whole text (word ids) or on their own, and again from the memo."""
    from omnigraph.pipelines.laya import sequence

    # Always (or never) encode the whole text, whatever share of its pieces is new.
    monkeypatch.setattr(sequence, "_PIECES_PER_NEW_PIECE", 10**9 if new_pieces == "whole text" else 0)
    tokenizer = LayaTokenizer(laya_small_bundle.file("tokenizer.json"), laya_small_bundle.file("tokenizer_config.json"))
    plain = Tokenizer.from_file(str(laya_small_bundle.file("tokenizer.json")))
    for text in _ascii_texts(seed=len(new_pieces), count=1500):
        expected = plain.encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text) == expected, repr(text)
        assert tokenizer.encode(text) == expected, repr(text)  # every piece now from the memo
    assert len(tokenizer._pieces.ids) > 1000


def test_text_the_pieces_cannot_split_is_encoded_whole(laya_tiny_bundle):
    """Non-ASCII text and text that holds an added token skip the piece memo (and come out right)."""
    tokenizer = LayaTokenizer(laya_tiny_bundle.file("tokenizer.json"), laya_tiny_bundle.file("tokenizer_config.json"))
    plain = Tokenizer.from_file(str(laya_tiny_bundle.file("tokenizer.json")))
    for text in ("café au lait", "the [SEP] charge", "x[CLS]y", "\u2019s refund"):
        assert tokenizer.encode(text) == plain.encode(text, add_special_tokens=False).ids
    assert tokenizer._pieces.ids == {}
    assert tokenizer.encode("the charge") == plain.encode("the charge", add_special_tokens=False).ids
    assert set(tokenizer._pieces.ids) == {"the", " charge"}


def test_the_piece_memo_stays_bounded(laya_tiny_bundle, monkeypatch):
    from omnigraph.pipelines.laya import sequence

    monkeypatch.setattr(sequence, "_PIECE_MEMO_ENTRIES", 4)
    monkeypatch.setattr(sequence, "_PIECE_MAX_CHARS", 8)
    tokenizer = LayaTokenizer(laya_tiny_bundle.file("tokenizer.json"), laya_tiny_bundle.file("tokenizer_config.json"))
    plain = Tokenizer.from_file(str(laya_tiny_bundle.file("tokenizer.json")))
    for text in ("please refund", "a duplicated invoice", "the charge was twice as much as it ought to be"):
        assert tokenizer.encode(text) == plain.encode(text, add_special_tokens=False).ids
        assert len(tokenizer._pieces.ids) <= 4
        assert all(len(piece) <= 8 for piece in tokenizer._pieces.ids)
