"""Synthetic Laya checkpoints: the published layout, loadable by the reference, deterministic."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import pytest
from safetensors import safe_open

from omnigraph.pipelines.laya.synth import (
    SIZES,
    cached_checkpoint,
    encoder_config,
    synthesize_checkpoint,
    tensor_shapes,
)
from omnigraph.pipelines.laya.tokenizer_corpus import special_token_ids

CHECKPOINT_FILES = (
    "model.safetensors",
    "rl_agent_config.json",
    "encoder/config.json",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
)
REQUEST = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "priority": {"type": "choice", "instructions": "How urgent is this?",
                 "criteria": {"low": "can wait", "high": "today", "urgent": "now"}},
    "anger": {"type": "score", "instructions": "How upset is the customer?",
              "criteria": ["calm", "annoyed", "angry", "furious"]},
}


def _files(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path), framework="numpy") as weights:
        return {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_tensors_are_exactly_what_the_reference_model_loads(size, request):
    agent = request.getfixturevalue(f"laya_reference_{size}")
    checkpoint = request.getfixturevalue(f"laya_{size}_checkpoint")
    expected = {name: tuple(tensor.shape) for name, tensor in agent.model.state_dict().items()}
    assert _safetensors_shapes(checkpoint / "model.safetensors") == expected
    assert sorted(_files(checkpoint)) == sorted(CHECKPOINT_FILES)


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_the_reference_answers_every_question_type(size, request):
    answers = request.getfixturevalue(f"laya_reference_{size}").system_one(
        "Please refund the duplicate charge, I was billed twice.", REQUEST)["answers"]
    assert answers["refund"]["type"] == "noul" and 0 < answers["refund"]["noul"] < 1
    assert answers["priority"]["choice"] in ("low", "high", "urgent")
    assert sum(answers["priority"]["probabilities"].values()) == pytest.approx(1, abs=1e-3)
    assert 0 <= answers["anger"]["score"] <= 3
    # Not a degenerate model: the options and the action head are told apart.
    assert len(set(answers["priority"]["probabilities"].values())) == 3
    assert len({answer["action"]["act_probability"] for answer in answers.values()}) == 3


def test_full_has_the_published_architecture_and_206_tensors():
    config = encoder_config(SIZES["full"])
    assert {key: config[key] for key in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
        "pad_token_id", "global_attn_every_n_layers", "local_attention", "global_rope_theta",
        "local_rope_theta", "hidden_activation", "model_type")} == {
        "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "intermediate_size": 2624,
        "vocab_size": 50368, "pad_token_id": 50283, "global_attn_every_n_layers": 3, "local_attention": 128,
        "global_rope_theta": 160000.0, "local_rope_theta": 10000.0, "hidden_activation": "gelu",
        "model_type": "modernbert"}
    assert special_token_ids(50368) == {"[UNK]": 50280, "[CLS]": 50281, "[SEP]": 50282, "[PAD]": 50283,
                                        "[MASK]": 50284}
    shapes = tensor_shapes(SIZES["full"])
    assert len(shapes) == 206
    assert sum(math.prod(shape) for shape in shapes.values()) == pytest.approx(421e6, rel=0.02)


def test_full_tensor_names_match_the_reference_model_built_from_its_config(tmp_path):
    common = pytest.importorskip("laya.common")
    torch = pytest.importorskip("torch")
    (tmp_path / "encoder").mkdir()
    (tmp_path / "encoder" / "config.json").write_text(json.dumps(encoder_config(SIZES["full"])))
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = common.build_model({"encoder": "unused", "head_layers": 2, "act_costs": {"escalate": 0.1}},
                                   encoder_dir=str(tmp_path / "encoder"), pretrained=False)
    assert {name: tuple(t.shape) for name, t in model.state_dict().items()} == tensor_shapes(SIZES["full"])


def test_same_size_and_seed_give_byte_identical_files(tmp_path, laya_tiny_checkpoint):
    again = synthesize_checkpoint("tiny", seed=0, out=tmp_path / "again")
    assert _files(again) == _files(laya_tiny_checkpoint)
    other = synthesize_checkpoint("tiny", seed=1, out=tmp_path / "other")
    assert _files(other)["model.safetensors"] != _files(again)["model.safetensors"]


def test_tokenizer_names_special_tokens_at_the_encoder_ids(laya_tiny_checkpoint, laya_reference_tiny):
    tokenizer = laya_reference_tiny.tok
    encoder = json.loads((laya_tiny_checkpoint / "encoder" / "config.json").read_text())
    assert tokenizer.pad_token_id == encoder["pad_token_id"]
    assert tokenizer.cls_token_id == encoder["cls_token_id"] and tokenizer.sep_token_id == encoder["sep_token_id"]
    assert tokenizer.mask_token == "[MASK]" and len(tokenizer) <= encoder["vocab_size"]


def test_cached_checkpoint_is_written_once_under_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIGRAPH_CACHE", str(tmp_path))
    first = cached_checkpoint("tiny")
    assert first.parent == tmp_path / "checkpoints"
    stamp = os.stat(first / "model.safetensors").st_mtime_ns
    assert cached_checkpoint("tiny") == first
    assert os.stat(first / "model.safetensors").st_mtime_ns == stamp
    assert cached_checkpoint("tiny", seed=1) != first
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")) == []


def test_bad_arguments_change_nothing(tmp_path, laya_tiny_checkpoint):
    with pytest.raises(ValueError, match="unknown Laya checkpoint size 'huge'"):
        synthesize_checkpoint("huge", seed=0, out=tmp_path / "huge")
    assert not (tmp_path / "huge").exists()
    before = _files(laya_tiny_checkpoint)
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        synthesize_checkpoint("tiny", seed=3, out=laya_tiny_checkpoint)
    assert _files(laya_tiny_checkpoint) == before
    assert [p.name for p in laya_tiny_checkpoint.parent.iterdir()] == [laya_tiny_checkpoint.name]


@pytest.mark.slow
def test_full_checkpoint_loads_in_the_reference(tmp_path):
    laya = pytest.importorskip("laya")
    checkpoint = synthesize_checkpoint("full", seed=0, out=tmp_path / "full")
    assert _safetensors_shapes(checkpoint / "model.safetensors") == tensor_shapes(SIZES["full"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = laya.load(str(checkpoint), device="cpu")
    answers = agent.system_one("Please refund the duplicate charge.", REQUEST)["answers"]
    assert set(answers) == set(REQUEST)
