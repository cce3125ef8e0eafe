"""Tiny random Qwen3 checkpoints that vLLM (CPU) and transformers both load, for CI and demos.

The real backbones (Qwen3.5-4B, 9B, 27B) cannot be downloaded on these machines, so the mixed
pipelines' tests run on a Qwen3ForCausalLM written here: HF tensor names, an explicit `lm_head`
(untied, so a head bundle built from its letter rows is not the embedding), float32 weights drawn
per tensor from `seed`, and a byte-level BPE tokenizer trained locally with Qwen's special tokens.
Every capital letter A..Z is a single token (the byte-level alphabet holds each one, and the
pre-tokenizer never glues a letter to the punctuation after it). Same arguments give the same
bytes, so bundles built on top hash the same everywhere.
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from omnigraph.bundles import staged_bundle_dir
from omnigraph.pipelines.laya.tokenizer_corpus import generate_corpus

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK = "<think>"
END_THINK = "</think>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, THINK, END_THINK)
LETTERS = tuple(string.ascii_uppercase)
# BPE merges trained on top of the 256 byte tokens; the embedding rows are rounded up to 64.
BPE_VOCAB_SIZE = 1536
VOCAB_ALIGNMENT = 64
BUILTIN_CORPUS_SENTENCES = 6000
# Chat-prompt words the Qwen pipelines always contain, so they become few tokens.
_PROMPT_LINES = (
    "system", "user", "assistant", "Goal: ", "App: Cua Driver", "Task family: closed-candidate decision",
    "Accessibility tree:", "Options:", 'A. Decision "', '" -> select', "Answer with a single letter.",
    "Context:", "Question: ", "Candidate: ", "Is the answer yes?",
)
MAX_POSITION_EMBEDDINGS = 4096
RMS_NORM_EPS = 1e-6
ROPE_THETA = 1000000.0


def train_tokenizer(corpus: Sequence[str], *, seed: int) -> Tokenizer:
    """A byte-level BPE on `corpus` plus the built-in English corpus; specials after the merges."""
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    lines = [*generate_corpus(seed, sentences=BUILTIN_CORPUS_SENTENCES), *_PROMPT_LINES, *corpus]
    tokenizer.train_from_iterator(lines, trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    for letter in LETTERS:
        if len(tokenizer.encode(letter, add_special_tokens=False).ids) != 1:
            raise RuntimeError(f"letter {letter!r} is not a single token of the trained tokenizer")
    return tokenizer


def model_config(*, vocab_size: int, hidden_size: int, num_layers: int, num_attention_heads: int,
                 num_key_value_heads: int, head_dim: int, intermediate_size: int,
                 special_ids: dict[str, int]) -> dict:
    """`config.json`: Qwen3's published keys with these dimensions (untied head, float32)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": special_ids[ENDOFTEXT],
        "eos_token_id": special_ids[IM_END],
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "max_window_layers": num_layers,
        "model_type": "qwen3",
        "num_attention_heads": num_attention_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": num_key_value_heads,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def tensor_shapes(*, vocab_size: int, hidden_size: int, num_layers: int, num_attention_heads: int,
                  num_key_value_heads: int, head_dim: int, intermediate_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of `model.safetensors`, in Qwen3ForCausalLM's state_dict naming."""
    d, q, kv, f = hidden_size, num_attention_heads * head_dim, num_key_value_heads * head_dim, intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, d)}
    for i in range(num_layers):
        prefix = f"model.layers.{i}"
        shapes.update({
            f"{prefix}.input_layernorm.weight": (d,),
            f"{prefix}.self_attn.q_proj.weight": (q, d),
            f"{prefix}.self_attn.k_proj.weight": (kv, d),
            f"{prefix}.self_attn.v_proj.weight": (kv, d),
            f"{prefix}.self_attn.o_proj.weight": (d, q),
            f"{prefix}.self_attn.q_norm.weight": (head_dim,),
            f"{prefix}.self_attn.k_norm.weight": (head_dim,),
            f"{prefix}.post_attention_layernorm.weight": (d,),
            f"{prefix}.mlp.gate_proj.weight": (f, d),
            f"{prefix}.mlp.up_proj.weight": (f, d),
            f"{prefix}.mlp.down_proj.weight": (d, f),
        })
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (vocab_size, d)
    return shapes


def _random_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Unit-gain norms with a spread, unit-variance embeddings, fan-in scaled projections.

    Norm gains vary (1 +- 0.1) so a missing or misplaced final norm shows in the hidden state; the
    untied `lm_head` is fan-in scaled, so letter logits spread by units and a wrong row is visible.
    """
    normal = rng.standard_normal(shape, dtype=np.float32)
    if name.endswith("norm.weight"):
        return np.float32(1.0) + np.float32(0.1) * normal
    if name == "model.embed_tokens.weight":
        return normal
    scale = np.float32(1.0 / np.sqrt(shape[-1]))
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        scale *= np.float32(0.5)  # residual branches: keep the stream's scale stable with depth
    return normal * scale


def _write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def synthesize_qwen3_backbone(out: Path, *, seed: int, hidden_size: int = 128, num_layers: int = 2,
                              num_attention_heads: int = 2, num_key_value_heads: int = 1, head_dim: int = 64,
                              intermediate_size: int = 256, chat_template: str | None = None,
                              corpus: Sequence[str] = ()) -> Path:
    """Write a Qwen3ForCausalLM checkpoint folder to the new folder `out` and return it.

    Files: `config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json` (with
    `chat_template` when given), `generation_config.json`. Written into a staged folder renamed
    onto `out`, so `out` is complete or absent; an existing `out` is refused.
    """
    if num_attention_heads % num_key_value_heads:
        raise ValueError(f"num_attention_heads {num_attention_heads} is not a multiple of "
                         f"num_key_value_heads {num_key_value_heads}")
    if min(hidden_size, num_layers, num_key_value_heads, head_dim, intermediate_size) < 1:
        raise ValueError("every Qwen3 dimension must be at least 1")
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even (rotary embedding pairs)")
    tokenizer = train_tokenizer(corpus, seed=seed)
    special_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    vocab_size = -(-tokenizer.get_vocab_size() // VOCAB_ALIGNMENT) * VOCAB_ALIGNMENT
    dims = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                head_dim=head_dim, intermediate_size=intermediate_size)
    weights = {
        name: _random_tensor(name, shape, np.random.default_rng([seed, index]))
        for index, (name, shape) in enumerate(tensor_shapes(**dims).items())
    }
    with staged_bundle_dir(out) as staging:
        _write_json(staging / "config.json", model_config(**dims, special_ids=special_ids))
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
        _write_json(staging / "tokenizer_config.json", tokenizer_config(chat_template))
        _write_json(staging / "generation_config.json", {
            "bos_token_id": special_ids[ENDOFTEXT],
            "do_sample": False,
            "eos_token_id": [special_ids[IM_END], special_ids[ENDOFTEXT]],
            "pad_token_id": special_ids[ENDOFTEXT],
        })
    return Path(out)


def tokenizer_config(chat_template: str | None) -> dict:
    """`tokenizer_config.json`: a fast tokenizer with Qwen's eos/pad tokens and no BOS."""
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "pad_token": ENDOFTEXT,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config
