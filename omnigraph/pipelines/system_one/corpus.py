"""A generated English-like corpus on which the synthetic checkpoints' tokenizers are trained.

No tokenizer can be downloaded on these machines, so every synthetic checkpoint (Laya's ModernBERT
tokenizer, the tiny Qwen3 backbone's) trains its own byte-level BPE, deterministically for a seed,
on these lines: the words decision prompts always contain ("choice question:", "level 0:", the
noul option texts, JSON punctuation), generated syllable words, numbers and punctuation.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

__all__ = ["generate_corpus"]

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


def train_byte_level_bpe(lines: Iterable[str], vocab_size: int, *,
                         normalizer: normalizers.Normalizer | None = None) -> Tokenizer:
    """A byte-level BPE (no unknown token, merges of pairs seen at least twice) trained on `lines`:
    the base both synthetic tokenizers (Laya's ModernBERT-style, the Qwen3 backbone's) build on."""
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer
