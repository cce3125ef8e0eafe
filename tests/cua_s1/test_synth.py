"""The synthetic checkpoint: the published two-part layout, a PEFT adapter on real modules, and
the same bytes for the same seed."""

from __future__ import annotations

import json

import pytest
from safetensors.numpy import load_file

from omnigraph.bundles import sha256_file
from omnigraph.pipelines.cua_s1.synth import synthesize_checkpoint


def _hashes(root) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def test_layout_is_base_plus_text_adapter(cua_checkpoint):
    assert sorted(_hashes(cua_checkpoint)) == [
        "base/config.json", "base/generation_config.json", "base/model.safetensors", "base/tokenizer.json",
        "base/tokenizer_config.json", "text/adapter_config.json", "text/adapter_model.safetensors"]
    config = json.loads((cua_checkpoint / "base" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["hidden_size"] == 128
    chat_template = json.loads((cua_checkpoint / "base" / "tokenizer_config.json").read_text())["chat_template"]
    assert "<think>\\n" in chat_template


def test_adapter_is_rank_16_lora_on_every_projection(cua_checkpoint):
    config = json.loads((cua_checkpoint / "text" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 16, 32)
    assert config["task_type"] == "CAUSAL_LM"
    base = load_file(str(cua_checkpoint / "base" / "model.safetensors"))
    lora = load_file(str(cua_checkpoint / "text" / "adapter_model.safetensors"))
    assert len(lora) == 2 * 2 * 7  # layers x (q, k, v, o, gate, up, down) x (A, B)
    for name, tensor in lora.items():
        module = name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        out_features, in_features = base[f"{module}.weight"].shape
        assert tensor.shape == ((16, in_features) if ".lora_A." in name else (out_features, 16)), name
        assert module.rsplit(".", 1)[1] in config["target_modules"]


def test_same_seed_same_bytes_other_seed_other_weights(cua_checkpoint, tmp_path):
    again = synthesize_checkpoint("tiny", seed=0, out=tmp_path / "again")
    assert _hashes(again) == _hashes(cua_checkpoint)
    other = _hashes(synthesize_checkpoint("tiny", seed=1, out=tmp_path / "other"))
    assert other["text/adapter_model.safetensors"] != _hashes(cua_checkpoint)["text/adapter_model.safetensors"]


def test_refusals_write_nothing(cua_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="unknown Cua-S1 checkpoint size 'full'"):
        synthesize_checkpoint("full", seed=0, out=tmp_path / "full")
    with pytest.raises(FileExistsError):
        synthesize_checkpoint("tiny", seed=0, out=cua_checkpoint)
    assert list(tmp_path.iterdir()) == []
