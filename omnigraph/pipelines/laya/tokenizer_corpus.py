"""A generated English-like corpus and the byte-level BPE tokenizer trained on it.

Synthetic Laya checkpoints need a real `tokenizer.json` in the format ModernBERT ships (byte-level
BPE, `[CLS] [SEP] [PAD] [MASK] [UNK]`), but no tokenizer can be downloaded on these machines. So
one is trained here, deterministically for a seed, on text made of the words Laya prompts always
contain ("choice question:", "level 0:", the noul option texts, JSON punctuation) and generated
syllable words. The special tokens sit where ModernBERT puts them: 88 ids below the end of the
embedding matrix, so `full` gets ModernBERT's real ids ([PAD] 50283).
"""

from __future__ import annotations

import json

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]")
# ModernBERT: vocab 50368, [UNK] 50280 ... [MASK] 50284, then 83 [unused] slots.
SPECIALS_FROM_END = 88

_PROMPT_WORDS = (
    "choice question score noul level false true yes no the statement does not hold holds "
    "customer refund charge duplicate please ask for a an of to is are was were and or in on at "
    "this that it with as by from be have has do did can will would should may must which what "
    "when where who why how order account payment ticket email message user agent reply answer "
    "option label priority urgent low high medium spam billing shipping delivery cancel return "
    "status error login password update request support help thanks issue problem invoice plan"
).split()
_ONSETS = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "y", "z", "br", "ch", "cl", "cr", "dr", "fl", "gr", "pl", "pr", "sh", "sl", "st", "th", "tr")
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "ou", "oo", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "rt", "x")
_PUNCTUATION = (".", ",", "?", "!", ":", ";")


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """Ids of the special tokens for an embedding matrix of `vocab_size` rows."""
    first = vocab_size - SPECIALS_FROM_END
    if first < 256:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for a byte-level vocabulary")
    return {token: first + i for i, token in enumerate(SPECIAL_TOKENS)}


def generate_corpus(seed: int, *, sentences: int = 20000) -> list[str]:
    """Deterministic lines of prompt words, syllable words, numbers, punctuation and JSON."""
    rng = np.random.default_rng(seed)
    lexicon = list(_PROMPT_WORDS)
    for _ in range(3000):
        syllables = rng.integers(1, 4)
        lexicon.append("".join(
            _ONSETS[rng.integers(len(_ONSETS))] + _NUCLEI[rng.integers(len(_NUCLEI))]
            + _CODAS[rng.integers(len(_CODAS))] for _ in range(syllables)))
    weights = 1.0 / np.arange(1, len(lexicon) + 1)  # Zipf-like: frequent words become single tokens
    weights /= weights.sum()
    lengths = rng.integers(4, 16, size=sentences)
    draws = rng.choice(len(lexicon), size=int(lengths.sum()), p=weights)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    lines = []
    for i in range(sentences):
        words = [lexicon[j] for j in draws[starts[i]:starts[i + 1]]]
        if rng.random() < 0.2:
            words[0] = words[0].capitalize()
        if rng.random() < 0.15:
            words.insert(int(rng.integers(len(words))), str(int(rng.integers(0, 1000))))
        line = " ".join(words) + _PUNCTUATION[rng.integers(len(_PUNCTUATION))]
        kind = i % 10
        if kind == 0:
            line = f"{('choice', 'score', 'noul')[i % 3]} question: {line}"
        elif kind == 1:
            line = f"level {i % 7}: {line}"
        elif kind == 2:
            line = json.dumps({words[0]: line, "id": i % 97, "ok": bool(i % 2)})
        lines.append(line)
    return lines


def train_tokenizer(seed: int, vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer whose ids all fit an embedding matrix of `vocab_size` rows.

    The trained vocabulary fills the ids below the special tokens; when the corpus runs out of
    merges first, `[unused]` entries fill the gap so the specials keep ModernBERT's positions.
    """
    ids = special_token_ids(vocab_size)
    regular = vocab_size - SPECIALS_FROM_END
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=regular,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(generate_corpus(seed), trainer=trainer)
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
