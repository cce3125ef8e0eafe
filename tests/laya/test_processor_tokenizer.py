"""LayaTokenizer (the `tokenizers` library alone) encodes as the reference's transformers tokenizer.

The synthetic checkpoints exercise the default configuration; these cases change the
tokenizer_config.json settings transformers acts on: special tokens it registers, whether special
tokens are split, and which side a 48-token option cut keeps.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

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
    assert tokenizer._memo == {}  # too long to keep
    texts = ["billing", "support", "sales"]
    first = tokenizer.encode_options(texts)
    assert len(tokenizer._memo) == 3
    # A remembered text and a new one: the memo is full, so it starts over with the new one.
    assert tokenizer.encode_options(["billing", "refund"]) == [first[0], tuple(tokenizer.encode(" refund"))]
    assert set(tokenizer._memo) == {" refund"}
