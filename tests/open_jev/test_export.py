"""build_bundle: one self-contained head bundle whose graph is NumPy's float64 head, or nothing at all."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer

from omnigraph.bundles import BundleHashMismatch, verify_bundle
from omnigraph.bundles.onnx_graph import IR_VERSION
from omnigraph.pipelines.open_jev.export import CheckpointInvalid, build_bundle, default_bundle, reference_scores
from omnigraph.pipelines.open_jev.processor import OpenJevProcessor
from omnigraph.pipelines.processor import RequestTooLarge
from omnigraph.pipelines.open_jev.prompt import DEFAULT_PROMPT_TEMPLATE, PromptTemplate, PromptTemplateInvalid


def test_the_bundle_carries_backbone_head_template_and_calibration(jev_bundle, jev_checkpoint):
    manifest = jev_bundle.manifest
    assert manifest.component == "open_jev.head"
    backbone = sorted(p.name for p in (jev_checkpoint / "backbone").iterdir())
    assert sorted(manifest.files) == sorted(
        ["graph.onnx", "inputs.npz", "prompt_template.json", *(f"backbone/{name}" for name in backbone)])
    for name in backbone:  # what vLLM loads is verified with the bundle, byte for byte
        assert jev_bundle.file(f"backbone/{name}").read_bytes() == (jev_checkpoint / "backbone" / name).read_bytes()
    layout = manifest.metadata.layout
    assert layout["backbone_dir"] == "backbone" and layout["hidden_size"] == 128
    positions = json.loads((jev_checkpoint / "backbone" / "config.json").read_text())["max_position_embeddings"]
    assert layout["max_model_len"] == min(4096, positions)
    assert layout["head_outputs"] == ["scores"]
    assert manifest.metadata.calibration["temperature"] == 1.5 and manifest.metadata.calibration["version"]
    assert PromptTemplate.from_file(jev_bundle.file("prompt_template.json")) == DEFAULT_PROMPT_TEMPLATE


def test_the_head_graph_equals_numpy_float64(jev_bundle, jev_checkpoint):
    head = load_file(str(jev_checkpoint / "head.safetensors"))
    graph = onnx.load(str(jev_bundle.graph_path))
    assert graph.ir_version == IR_VERSION  # what an older ONNX Runtime still loads
    assert [d.dim_param for d in graph.graph.input[0].type.tensor_type.shape.dim] == ["P", ""]
    assert graph.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.DOUBLE
    session = ort.InferenceSession(str(jev_bundle.graph_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for rows in (1, 3, 64):
        hidden = (rng.standard_normal((rows, 128)) * 4).astype(np.float32)
        (scores,) = session.run(["scores"], {"hidden_states": hidden})
        assert scores.dtype == np.float64 and scores.shape == (rows,)
        np.testing.assert_allclose(scores, reference_scores(hidden, head["head_w"], head["b"]), rtol=0, atol=1e-12)
    # float64 accumulation: a float32 dot product would lose these low bits
    hidden = np.full((1, 128), 1e4, dtype=np.float32)
    hidden[0, 0] = 1e-3
    (scores,) = session.run(["scores"], {"hidden_states": hidden})
    assert scores[0] == pytest.approx(float(reference_scores(hidden, head["head_w"], head["b"])[0]), abs=1e-9)
    example = np.load(jev_bundle.example_inputs_path)
    assert example["hidden_states"].dtype == np.float32 and example["hidden_states"].shape[1] == 128


def test_a_template_the_checkpoint_carries_is_used(jev_checkpoint, tmp_path):
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(jev_checkpoint, checkpoint)
    template = PromptTemplate(prefix="State: {state}\nAsk: {instructions}\n", candidate="Option: {candidate}",
                              noul="Yes?", noul_criteria=" (yes: {true}; no: {false})")
    (checkpoint / "prompt_template.json").write_text(template.to_json())
    bundle = build_bundle(checkpoint, tmp_path / "bundle")
    assert PromptTemplate.from_file(bundle.file("prompt_template.json")) == template
    processor = OpenJevProcessor({1: bundle})
    prepared = processor.prepare({"state": "s", "questions": {"q": {"type": "noul", "instructions": "i"}}})
    tokenizer = Tokenizer.from_file(str(bundle.file("backbone/tokenizer.json")))
    assert prepared.calls[0]["prompt_token_ids"].tolist() == tokenizer.encode("State: s\nAsk: i\nYes?").ids
    assert processor.audit()["prompt_template_sha256"] == hashlib.sha256(template.to_json().encode()).hexdigest()


@pytest.mark.parametrize("kwargs, message", [
    ({"precision": "bf16"}, "fp32 only"),
    ({"fast": True}, "no fast"),
])
def test_unsupported_variants_are_refused_and_write_nothing(jev_checkpoint, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_bundle(jev_checkpoint, tmp_path / "bundle", **kwargs)
    assert list(tmp_path.iterdir()) == []


def _broken_head(checkpoint):
    head = load_file(str(checkpoint / "head.safetensors"))
    save_file({"head_w": head["head_w"][:64], "b": head["b"]}, str(checkpoint / "head.safetensors"))


@pytest.mark.parametrize("breaks, message", [
    (_broken_head, "head_w must be float32 \\[128\\]"),
    (lambda c: (c / "temperature.json").write_text('{"temperature": 0}'), "temperature"),
    (lambda c: (c / "backbone" / "tokenizer.json").unlink(), "tokenizer.json"),
    (lambda c: (c / "prompt_template.json").write_text('{"format": "x"}'), "format"),
])
def test_a_broken_checkpoint_is_refused_and_writes_nothing(jev_checkpoint, tmp_path, breaks, message):
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(jev_checkpoint, checkpoint)
    breaks(checkpoint)
    with pytest.raises((CheckpointInvalid, PromptTemplateInvalid), match=message):
        build_bundle(checkpoint, tmp_path / "bundle")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]


def test_a_changed_backbone_file_fails_verification(jev_bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(jev_bundle.root, copy)
    (copy / "backbone" / "config.json").write_text("{}")
    with pytest.raises(BundleHashMismatch, match="backbone/config.json"):
        verify_bundle(copy)


def test_an_existing_output_folder_is_refused(jev_checkpoint, jev_bundle):
    with pytest.raises(FileExistsError):
        build_bundle(jev_checkpoint, jev_bundle.root)


def test_max_model_len_is_the_backbones_when_smaller(jev_checkpoint, tmp_path):
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(jev_checkpoint, checkpoint)
    config_path = checkpoint / "backbone" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "max_position_embeddings": 64}))
    bundle = build_bundle(checkpoint, tmp_path / "bundle")
    assert bundle.manifest.metadata.layout["max_model_len"] == 64
    processor = OpenJevProcessor({1: bundle})
    with pytest.raises(RequestTooLarge, match="max_model_len=64"):
        processor.prepare({"state": "word " * 64, "questions": {"q": {"type": "noul", "instructions": "?"}}})


def test_default_bundle_is_built_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("OMNIGRAPH_CACHE", str(tmp_path))
    first = default_bundle()
    assert first.is_relative_to(tmp_path / "bundles")
    manifest = verify_bundle(first).manifest
    assert manifest.component == "open_jev.head" and manifest.metadata.calibration["temperature"] == 1.5
    mtime = (first / "manifest.json").stat().st_mtime_ns
    assert default_bundle() == first and (first / "manifest.json").stat().st_mtime_ns == mtime
