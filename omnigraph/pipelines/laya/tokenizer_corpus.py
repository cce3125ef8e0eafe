"""The byte-level BPE tokenizer of synthetic Laya checkpoints, trained on the shared corpus.

Synthetic Laya checkpoints need a real `tokenizer.json` in the format ModernBERT ships (byte-level
BPE, `[CLS] [SEP] [PAD] [MASK] [UNK]`), but no tokenizer can be downloaded on these machines. So
one is trained here, deterministically for a seed, on the generated corpus of
`omnigraph.pipelines.system_one.corpus` (the words decision prompts always contain and generated
syllable words). The special tokens sit where ModernBERT puts them: 88 ids below the end of the
embedding matrix, so `full` gets ModernBERT's real ids ([PAD] 50283).
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from omnigraph.pipelines.system_one.corpus import generate_corpus, train_byte_level_bpe

SPECIAL_TOKENS = ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]")
# ModernBERT: vocab 50368, [UNK] 50280 ... [MASK] 50284, then 83 [unused] slots.
SPECIALS_FROM_END = 88


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """Ids of the special tokens for an embedding matrix of `vocab_size` rows."""
    first = vocab_size - SPECIALS_FROM_END
    if first < 256:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for a byte-level vocabulary")
    return {token: first + i for i, token in enumerate(SPECIAL_TOKENS)}


def train_tokenizer(seed: int, vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer whose ids all fit an embedding matrix of `vocab_size` rows.

    The trained vocabulary fills the ids below the special tokens; when the corpus runs out of
    merges first, `[unused]` entries fill the gap so the specials keep ModernBERT's positions.
    """
    ids = special_token_ids(vocab_size)
    regular = vocab_size - SPECIALS_FROM_END
    tokenizer = train_byte_level_bpe(generate_corpus(seed), regular)
    vocab = tokenizer.get_vocab()
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    for filler in range(len(vocab), regular):
        vocab[f"[unused_bpe{filler}]"] = filler
    model = models.BPE(vocab=vocab, merges=[tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1))
                                            for m in merges], unk_token=None)
    final = Tokenizer(model)
    final.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    final.decoder = decoders.ByteLevel()
    final.add_special_tokens(list(SPECIAL_TOKENS))
    for token, token_id in ids.items():
        if final.token_to_id(token) != token_id:
            raise RuntimeError(f"special token {token} landed at id {final.token_to_id(token)}, not {token_id}")
    final.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])],
    )
    return final


def tokenizer_config(max_length: int) -> dict:
    """The `tokenizer_config.json` transformers reads: fast tokenizer class and special tokens."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": True,
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "mask_token": "[MASK]",
        "unk_token": "[UNK]",
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": max_length,
    }
