"""The exporter: LoRA merged as PEFT merges it, the letter head equal to NumPy, a bundle that
covers the backbone, and clear refusals that leave nothing behind."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from safetensors.numpy import load_file, save_file

from omnigraph.bundles import sha256_file
from omnigraph.bundles.onnx_graph import IR_VERSION
from omnigraph.pipelines.cua_s1.export import CheckpointInvalid, build_bundle
from omnigraph.pipelines.cua_s1.processor import CuaS1Processor

torch = pytest.importorskip("torch")


def _merged_by_hand(checkpoint) -> dict[str, np.ndarray]:
    """W + (alpha / r) * B @ A in torch float32 from the adapter files, for every adapted module."""
    config = json.loads((checkpoint / "text" / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    base = load_file(str(checkpoint / "base" / "model.safetensors"))
    lora = load_file(str(checkpoint / "text" / "adapter_model.safetensors"))
    merged = dict(base)
    for name in lora:
        if name.endswith(".lora_A.weight"):
            module = name[len("base_model.model."):-len(".lora_A.weight")]
            a = torch.from_numpy(lora[name])
            b = torch.from_numpy(lora[name.replace("lora_A", "lora_B")])
            merged[f"{module}.weight"] = (torch.from_numpy(base[f"{module}.weight"]) + (b @ a) * scaling).numpy()
    return merged


def test_lora_merge_equals_peft_style_math(cua_checkpoint, cua_bundle):
    exported = load_file(str(cua_bundle.file("backbone/model.safetensors")))
    expected = _merged_by_hand(cua_checkpoint)
    base = load_file(str(cua_checkpoint / "base" / "model.safetensors"))
    assert sorted(exported) == sorted(expected)
    adapted = [name for name in expected if not np.array_equal(expected[name], base[name])]
    assert len(adapted) == 14  # q/k/v/o and gate/up/down of both layers
    for name, tensor in expected.items():
        assert exported[name].dtype == np.float32
        np.testing.assert_allclose(exported[name], tensor, rtol=0, atol=1e-6, err_msg=name)
    # The merge is not negligible: the LoRA moves each adapted weight by a visible fraction of its scale.
    for name in adapted:
        assert np.abs(exported[name] - base[name]).mean() > 0.1 * np.abs(base[name]).mean(), name


def test_lora_merge_equals_peft_merge_and_unload(cua_checkpoint, cua_bundle):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(cua_checkpoint / "base"), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(cua_checkpoint / "text")).merge_and_unload()
    expected = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    exported = load_file(str(cua_bundle.file("backbone/model.safetensors")))
    assert sorted(exported) == sorted(expected)
    for name, tensor in expected.items():
        np.testing.assert_allclose(exported[name], tensor, rtol=0, atol=1e-6, err_msg=name)


def test_head_graph_equals_numpy_on_the_letter_rows(cua_bundle):
    layout = cua_bundle.manifest.metadata.layout
    lm_head = load_file(str(cua_bundle.file("backbone/model.safetensors")))["lm_head.weight"]
    hidden = np.random.default_rng(7).standard_normal((5, layout["hidden_size"]), dtype=np.float32) * 3
    session = ort.InferenceSession(str(cua_bundle.graph_path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["letter_logits"], {"hidden_states": hidden})
    expected = hidden.astype(np.float64) @ lm_head[layout["letter_token_ids"]].astype(np.float64).T
    assert logits.dtype == np.float32 and logits.shape == (5, 26)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4)
    (shape,) = [i.shape for i in session.get_inputs()]
    assert shape == ["P", layout["hidden_size"]]
    assert session.get_outputs()[0].shape == ["P", 26]
    assert onnx.load(str(cua_bundle.graph_path), load_external_data=False).ir_version == IR_VERSION


def test_bundle_lists_the_backbone_and_the_contract_layout(cua_bundle):
    files = cua_bundle.manifest.files
    for name in ("graph.onnx", "inputs.npz", "prompt_template.json", "backbone/config.json",
                 "backbone/model.safetensors", "backbone/tokenizer.json", "backbone/tokenizer_config.json",
                 "backbone/generation_config.json"):
        assert files[name] == sha256_file(cua_bundle.root / name), name
    layout = cua_bundle.manifest.metadata.layout
    assert cua_bundle.manifest.component == "cua_s1.head"
    assert {key: layout[key] for key in ("backbone_dir", "hidden_size", "max_model_len", "head_outputs")} == {
        "backbone_dir": "backbone", "hidden_size": 128, "max_model_len": 4096, "head_outputs": ["letter_logits"]}
    assert cua_bundle.manifest.metadata.calibration["temperature"] == 1.0
    assert cua_bundle.manifest.metadata.validation["max_abs_diff"]["letter_logits"] < 1e-4
    with np.load(cua_bundle.example_inputs_path) as example:
        assert example["hidden_states"].dtype == np.float32 and example["hidden_states"].shape[1] == 128


def test_same_checkpoint_builds_the_same_bytes(cua_checkpoint, cua_bundle, tmp_path):
    again = build_bundle(cua_checkpoint, tmp_path / "again")
    assert again.manifest.files == cua_bundle.manifest.files


@pytest.mark.parametrize("kwargs, message", [
    ({"precision": "bf16"}, "precision must be one of fp32"),
    ({"fast": True}, "fast=True is not available"),
])
def test_unsupported_variants_are_refused_before_writing(cua_checkpoint, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_bundle(cua_checkpoint, tmp_path / "bundle", **kwargs)
    assert list(tmp_path.iterdir()) == []


def _copy(checkpoint, tmp_path):
    return shutil.copytree(checkpoint, tmp_path / "checkpoint")


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out=True is not supported"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern is not supported"),
    ({"r": 8}, "with r=8 needs A"),
])
def test_unsupported_adapters_are_refused(cua_checkpoint, tmp_path, change, message):
    checkpoint = _copy(cua_checkpoint, tmp_path)
    path = checkpoint / "text" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(CheckpointInvalid, match=message):
        build_bundle(checkpoint, tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists()


def test_unpaired_or_foreign_lora_tensors_are_refused(cua_checkpoint, tmp_path):
    checkpoint = _copy(cua_checkpoint, tmp_path)
    path = checkpoint / "text" / "adapter_model.safetensors"
    tensors = load_file(str(path))
    tensors["base_model.model.model.layers.0.mlp.extra.lora_A.weight"] = np.zeros((16, 128), np.float32)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointInvalid, match="mlp.extra.lora_B.weight breaks the lora_A / lora_B pairs"):
        build_bundle(checkpoint, tmp_path / "bundle")
    tensors["base_model.model.model.layers.0.mlp.extra.lora_B.weight"] = np.zeros((128, 16), np.float32)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointInvalid, match="adapts model.layers.0.mlp.extra.weight, which the base does not have"):
        build_bundle(checkpoint, tmp_path / "bundle")


def test_missing_files_are_named(cua_checkpoint, tmp_path):
    checkpoint = _copy(cua_checkpoint, tmp_path)
    (checkpoint / "text" / "adapter_config.json").unlink()
    with pytest.raises(CheckpointInvalid, match="missing checkpoint file text/adapter_config.json"):
        build_bundle(checkpoint, tmp_path / "bundle")


def test_a_checkpoint_prompt_template_replaces_the_defaults(cua_checkpoint, cua_bundle, tmp_path):
    checkpoint = _copy(cua_checkpoint, tmp_path)
    (checkpoint / "prompt_template.json").write_text(json.dumps({"system_message": "Pick one letter."}))
    bundle = build_bundle(checkpoint, tmp_path / "bundle")
    template = json.loads(bundle.file("prompt_template.json").read_text())
    assert template["system_message"] == "Pick one letter."
    audit = CuaS1Processor({1: bundle}).audit()
    assert audit["prompt_template_sha256"] == sha256_file(bundle.file("prompt_template.json"))
    assert audit["prompt_template_sha256"] != CuaS1Processor({1: cua_bundle}).audit()["prompt_template_sha256"]
    ids = CuaS1Processor({1: bundle}).prepare({"state": "s", "questions": {"q": {
        "type": "choice", "instructions": "i", "criteria": ["a", "b"]}}}).calls[0]["prompt_token_ids"]
    default_ids = CuaS1Processor({1: cua_bundle}).prepare({"state": "s", "questions": {"q": {
        "type": "choice", "instructions": "i", "criteria": ["a", "b"]}}}).calls[0]["prompt_token_ids"]
    assert len(ids) < len(default_ids)

    (checkpoint / "prompt_template.json").write_text(json.dumps({"chat_template": "x"}))
    with pytest.raises(CheckpointInvalid, match="chat_template is not one of system_message"):
        build_bundle(checkpoint, tmp_path / "other")
