"""The Laya exporter: bundles that reproduce the reference model, or precise errors and no bundle."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from omnigraph.bundles import BundleHashMismatch, verify_bundle
from omnigraph.pipelines.laya import export
from omnigraph.pipelines.laya.export import build_bundle, default_bundle
from omnigraph.pipelines.laya.graph import (
    CheckpointInvalid,
    DecisionGraphConfig,
    EncoderConfig,
    LocalWindows,
    attention,
    build_decision_graph,
    load_checkpoint_weights,
    windowed_attention,
)
from omnigraph.pipelines.laya.ort_encoder import EncoderSubstitutionError, substitute_encoder

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

INPUTS = ("input_ids", "attention_mask", "marker_pos", "marker_mask", "qtype")
BUNDLE_FILES = {"graph.onnx", "weights.bin", "inputs.npz", "tokenizer.json", "tokenizer_config.json",
                "rl_agent_config.json"}


def _session(bundle) -> ort.InferenceSession:
    return ort.InferenceSession(str(bundle.graph_path), providers=["CPUExecutionProvider"])


def _run(session: ort.InferenceSession, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    logits, act_logits = session.run(["logits", "act_logits"], {name: batch[name] for name in INPUTS})
    return logits, act_logits


def _probabilities(logits: np.ndarray, valid: np.ndarray) -> np.ndarray:
    logits = np.where(valid, logits, -1e4).astype(np.float64)
    exp = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return exp / exp.sum(axis=-1, keepdims=True)


def _no_leftovers(out: Path) -> bool:
    return not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_fp32_bundle_matches_the_reference_model(size, request):
    session = _session(request.getfixturevalue(f"laya_{size}_bundle"))
    batches = request.getfixturevalue(f"laya_{size}_batches")
    assert {b["marker_pos"].shape[1] for b in batches} >= {1, 2, 100}  # dynamic M, incl. 1 and 100 slots
    for batch, (expected_logits, expected_act) in zip(batches, request.getfixturevalue(f"laya_{size}_expected")):
        logits, act_logits = _run(session, batch)
        assert logits.dtype == np.float32 and logits.shape == batch["marker_pos"].shape
        assert act_logits.shape == (batch["qtype"].shape[0], 2)
        np.testing.assert_allclose(logits, expected_logits, rtol=0, atol=1e-4)
        np.testing.assert_allclose(act_logits, expected_act, rtol=0, atol=1e-4)
        assert np.all(logits[~batch["marker_mask"]] == -1e4)


def test_example_inputs_are_a_bucket_padded_batch_the_reference_agrees_with(laya_tiny_bundle, laya_reference_tiny):
    with np.load(laya_tiny_bundle.example_inputs_path) as stored:
        inputs = {name: stored[name] for name in INPUTS}
    rows, length = inputs["input_ids"].shape
    assert rows & (rows - 1) == 0 and length % 16 == 0 and inputs["marker_mask"].dtype == bool
    assert not inputs["marker_mask"][-1].any()                      # a padding row
    logits, act_logits = _run(_session(laya_tiny_bundle), inputs)
    with torch.no_grad():
        expected_logits, expected_act = (t.numpy() for t in laya_reference_tiny.model(
            *(torch.from_numpy(inputs[name]) for name in INPUTS)))
    np.testing.assert_allclose(logits, expected_logits, rtol=0, atol=1e-4)
    np.testing.assert_allclose(act_logits, expected_act, rtol=0, atol=1e-4)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("size", ["tiny", pytest.param("small", marks=pytest.mark.slow)])
def test_reduced_precision_keeps_probabilities_and_decisions(size, precision, request, tmp_path):
    checkpoint = request.getfixturevalue(f"laya_{size}_checkpoint")
    fp32 = request.getfixturevalue(f"laya_{size}_bundle")
    bundle = build_bundle(checkpoint, tmp_path / precision, precision=precision)
    assert bundle.manifest.metadata.precision == precision
    assert (bundle.root / "weights.bin").stat().st_size < 0.6 * (fp32.root / "weights.bin").stat().st_size
    session = _session(bundle)
    expected = request.getfixturevalue(f"laya_{size}_expected")
    for batch, (expected_logits, expected_act) in zip(request.getfixturevalue(f"laya_{size}_batches"), expected):
        valid = batch["marker_mask"]
        logits, act_logits = _run(session, batch)
        p, expected_p = _probabilities(logits, valid), _probabilities(expected_logits, valid)
        assert np.abs(p - expected_p)[valid].max() <= 0.002
        act, expected_act_p = _probabilities(act_logits, True)[:, 0], _probabilities(expected_act, True)[:, 0]
        assert np.abs(act - expected_act_p).max() <= 0.002
        ranked = np.sort(np.where(valid, expected_p, -1), axis=-1)
        decisive = (valid.sum(-1) >= 2) & (ranked[:, -1] - ranked[:, -min(2, ranked.shape[1])] > 0.01)
        assert np.array_equal(p.argmax(-1)[decisive], expected_p.argmax(-1)[decisive])


def test_graph_io_contract(laya_tiny_bundle):
    model = onnx.load(str(laya_tiny_bundle.graph_path), load_external_data=False)

    def signature(values):
        return {v.name: (onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type),
                         [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]) for v in values}

    assert signature(model.graph.input) == {
        "input_ids": ("INT64", ["B", "L"]),
        "attention_mask": ("INT64", ["B", "L"]),
        "marker_pos": ("INT64", ["B", "M"]),
        "marker_mask": ("BOOL", ["B", "M"]),
        "qtype": ("INT64", ["B"]),
    }
    assert signature(model.graph.output) == {"logits": ("FLOAT", ["B", "M"]), "act_logits": ("FLOAT", ["B", 2])}
    assert {o.version for o in model.opset_import if o.domain in ("", "ai.onnx")} == {17}
    locations = {entry.value for init in model.graph.initializer for entry in init.external_data
                 if entry.key == "location"}
    assert locations == {"weights.bin"}
    assert all(init.data_location == onnx.TensorProto.EXTERNAL for init in model.graph.initializer)


def test_manifest_verifies_and_describes_the_bundle(laya_tiny_bundle, laya_tiny_checkpoint):
    bundle = verify_bundle(laya_tiny_bundle.root)
    assert bundle.manifest.component == "laya.decision"
    assert set(bundle.manifest.files) == BUNDLE_FILES
    metadata = bundle.manifest.metadata
    assert metadata.graph_file == "graph.onnx" and metadata.example_inputs_file == "inputs.npz"
    assert metadata.precision == "fp32" and metadata.checkpoint_revision.startswith("sha256:")
    agent_config = json.loads((laya_tiny_checkpoint / "rl_agent_config.json").read_text())
    encoder = json.loads((laya_tiny_checkpoint / "encoder" / "config.json").read_text())
    assert metadata.layout | {"inputs": None, "outputs": None} == {
        "rows": "pow2", "length_multiple": 16, "length_multiple_above_256": 64, "marker_bucket": "pow2",
        "max_len": 512, "head_max_len": 192, "option_tokens": 48, "pad_id": encoder["pad_token_id"],
        "cls_id": encoder["cls_token_id"], "sep_id": encoder["sep_token_id"], "mask_id": encoder["pad_token_id"] + 1,
        "qtypes": ["choice", "score", "noul"], "option_layout": "sequential", "masked_logit": -1e4,
        "unpadded": True, "inputs": None, "outputs": None}
    temperatures = {key: agent_config[key] for key in ("temperature", "temperature_by_options")}
    version = hashlib.sha256(json.dumps(temperatures, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert metadata.calibration == {**temperatures, "version": version}
    assert metadata.exporter["opset"] == 17 and metadata.exporter["torch"] == torch.__version__
    assert max(metadata.validation["max_abs_diff"].values()) < 1e-4
    for member, source in (("tokenizer.json", "tokenizer/tokenizer.json"), ("rl_agent_config.json", "rl_agent_config.json")):
        assert bundle.file(member).read_bytes() == (laya_tiny_checkpoint / source).read_bytes()


def test_a_tampered_bundle_is_refused(laya_tiny_bundle, tmp_path):
    copy = Path(shutil.copytree(laya_tiny_bundle.root, tmp_path / "copy"))
    with open(copy / "weights.bin", "r+b") as weights:
        weights.seek(100)
        weights.write(b"\x00\x01\x02\x03")
    with pytest.raises(BundleHashMismatch, match="weights.bin"):
        verify_bundle(copy)


def _corrupt(checkpoint: Path, out: Path, edit) -> Path:
    copy = Path(shutil.copytree(checkpoint, out))
    tensors = safetensors_torch.load_file(str(copy / "model.safetensors"))
    edit(tensors)
    safetensors_torch.save_file(tensors, str(copy / "model.safetensors"))
    return copy


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("encoder.layers.2.attn.Wqkv.weight"),
     r"missing tensor 'encoder.layers.2.attn.Wqkv.weight' \(shape \(192, 64\)\)"),
    (lambda t: t.update({"scorer.1.weight": torch.zeros(64, 32)}),
     r"tensor 'scorer.1.weight' has shape \(64, 32\), expected \(64, 64\)"),
    (lambda t: t.update({"encoder.layers.0.attn_norm.weight": torch.ones(64)}),
     r"unexpected tensor 'encoder.layers.0.attn_norm.weight'"),
    (lambda t: t["act_head.0.weight"].__setitem__((0, 0), float("nan")),
     r"tensor 'act_head.0.weight' holds NaN"),
])
def test_a_corrupted_checkpoint_names_the_tensor_and_leaves_no_bundle(laya_tiny_checkpoint, tmp_path, edit, message):
    checkpoint = _corrupt(laya_tiny_checkpoint, tmp_path / "checkpoint", edit)
    out = tmp_path / "bundles" / "laya"
    out.parent.mkdir()
    with pytest.raises(CheckpointInvalid, match=message):
        build_bundle(checkpoint, out)
    assert _no_leftovers(out)


def test_a_missing_checkpoint_file_is_named(laya_tiny_checkpoint, tmp_path):
    checkpoint = Path(shutil.copytree(laya_tiny_checkpoint, tmp_path / "checkpoint"))
    (checkpoint / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(CheckpointInvalid, match="missing checkpoint file tokenizer/tokenizer.json"):
        build_bundle(checkpoint, tmp_path / "out")
    assert _no_leftovers(tmp_path / "out")


def test_bad_arguments_are_refused_before_anything_is_written(laya_tiny_checkpoint, laya_tiny_bundle, tmp_path):
    with pytest.raises(ValueError, match="precision must be one of fp32, fp16, bf16, got 'int8'"):
        build_bundle(laya_tiny_checkpoint, tmp_path / "out", precision="int8")
    assert _no_leftovers(tmp_path / "out")
    before = laya_tiny_bundle.manifest_sha256
    with pytest.raises(FileExistsError):
        build_bundle(laya_tiny_checkpoint, laya_tiny_bundle.root)
    assert verify_bundle(laya_tiny_bundle.root).manifest_sha256 == before


def test_fast_bundles_need_the_custom_op_library(laya_tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(export, "FAST_GRAPH_MODULE", "omnigraph.workers.ops.absent_fast_graph")
    with pytest.raises(ValueError, match="fast bundles need the omnigraph custom-op library"):
        build_bundle(laya_tiny_checkpoint, tmp_path / "fast", fast=True)
    assert _no_leftovers(tmp_path / "fast")


@pytest.mark.slow
def test_fast_fp32_bundle_runs_the_custom_ops_and_matches_the_reference(laya_tiny_checkpoint, laya_tiny_batches,
                                                                      laya_tiny_expected, tmp_path):
    bundle = build_bundle(laya_tiny_checkpoint, tmp_path / "fast", fast=True)
    assert bundle.manifest.custom_ops is not None and bundle.custom_ops_path.is_file()
    assert bundle.manifest.metadata.exporter["fast"] is True
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(bundle.custom_ops_path))
    session = ort.InferenceSession(str(bundle.graph_path), options, providers=["CPUExecutionProvider"])
    for batch, (expected_logits, expected_act) in zip(laya_tiny_batches, laya_tiny_expected):
        logits, act_logits = _run(session, batch)
        np.testing.assert_allclose(logits, expected_logits, rtol=0, atol=1e-3)
        np.testing.assert_allclose(act_logits, expected_act, rtol=0, atol=1e-3)


def test_default_bundle_is_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIGRAPH_CACHE", str(tmp_path))
    path = default_bundle()
    assert path.parent == tmp_path / "bundles"
    bundle = verify_bundle(path)
    assert bundle.manifest.component == "laya.decision" and bundle.manifest.metadata.precision == "fp32"
    stamp = os.stat(path / "manifest.json").st_mtime_ns
    assert default_bundle() == path
    assert os.stat(path / "manifest.json").st_mtime_ns == stamp


@pytest.mark.parametrize("file, edit, message", [
    ("encoder/config.json", lambda c: c.update(model_type="bert"), "model_type must be 'modernbert', got 'bert'"),
    ("encoder/config.json", lambda c: c.update(hidden_activation="silu"), "hidden_activation 'silu' is not supported"),
    ("encoder/config.json", lambda c: c.pop("hidden_size"), "missing key 'hidden_size'"),
    ("rl_agent_config.json", lambda c: c.pop("head_layers"), "missing key 'head_layers'"),
    ("rl_agent_config.json", lambda c: c.update(option_layout="parallel"), "option_layout 'parallel' is not supported"),
    ("tokenizer/tokenizer_config.json", lambda c: c.update(mask_token="<mask>"), "mask_token '<mask>' is not in"),
])
def test_a_bad_checkpoint_config_is_named(laya_tiny_checkpoint, tmp_path, file, edit, message):
    checkpoint = Path(shutil.copytree(laya_tiny_checkpoint, tmp_path / "checkpoint"))
    config = json.loads((checkpoint / file).read_text())
    edit(config)
    (checkpoint / file).write_text(json.dumps(config))
    with pytest.raises(CheckpointInvalid, match=message):
        build_bundle(checkpoint, tmp_path / "out")
    assert _no_leftovers(tmp_path / "out")


def test_encoder_config_saved_by_transformers_5_reads_the_same(laya_tiny_checkpoint, tmp_path):
    """A checkpoint re-saved by transformers 5 carries `rope_parameters` and `layer_types` instead."""
    transformers = pytest.importorskip("transformers")
    transformers.AutoConfig.from_pretrained(str(laya_tiny_checkpoint / "encoder")).save_pretrained(str(tmp_path))
    resaved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in resaved and "global_rope_theta" not in resaved
    original = EncoderConfig.from_dict(json.loads((laya_tiny_checkpoint / "encoder" / "config.json").read_text()))
    assert EncoderConfig.from_dict(resaved) == original
    assert original.layer_types == ("full_attention", "sliding_attention", "sliding_attention", "full_attention")


@pytest.mark.parametrize("length", [1, 7, 8, 9, 23, 24, 25, 40, 61])
def test_windowed_attention_is_dense_attention_under_the_window_mask(length):
    """Local layers attend block by block; every real token gets what the dense |i - j| <= w mask gives."""
    half_width = 8
    generator = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(2, 3, length, 4, generator=generator) for _ in range(3))
    key_visible = torch.ones(2, length, dtype=torch.bool)
    key_visible[1, max(1, 2 * length // 3):] = False                      # a shorter, padded row
    positions = torch.arange(length)
    near = (positions[:, None] - positions[None, :]).abs() <= half_width
    dense_bias = torch.where(near & key_visible[:, None, None, :], 0.0, torch.finfo(torch.float32).min)
    windows = LocalWindows.build(key_visible, half_width)
    assert windows.key_index.shape[1] == min(length, 3 * half_width)       # keys scored per query block
    actual, expected = windowed_attention(q, k, v, windows), attention(q, k, v, dense_bias)
    assert actual.shape == expected.shape
    real = key_visible[:, None, :, None].expand_as(expected)               # padding rows are never read
    torch.testing.assert_close(actual[real], expected[real], rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_traced(laya_tiny_checkpoint, tmp_path_factory):
    """(torch module, its traced export without the encoder substitution) for the tiny checkpoint."""
    module = build_decision_graph(DecisionGraphConfig.from_checkpoint(laya_tiny_checkpoint))
    load_checkpoint_weights(module, laya_tiny_checkpoint / "model.safetensors")
    with np.load(build_bundle(laya_tiny_checkpoint, tmp_path_factory.mktemp("b") / "b").example_inputs_path) as stored:
        inputs = {name: stored[name] for name in INPUTS}
    path = tmp_path_factory.mktemp("traced") / "graph.onnx"
    export.export_onnx(module, inputs, path, "fp32")
    return module, onnx.load(str(path))


def test_the_plain_bundle_runs_its_encoder_on_onnx_runtime_fused_operators(laya_tiny_bundle, laya_tiny_checkpoint):
    model = onnx.load(str(laya_tiny_bundle.graph_path), load_external_data=False)
    config = EncoderConfig.from_dict(json.loads((laya_tiny_checkpoint / "encoder" / "config.json").read_text()))
    fused = [n.op_type for n in model.graph.node if n.domain == "com.microsoft"]
    assert fused.count("MultiHeadAttention") == config.num_layers
    assert fused.count("RotaryEmbedding") == 2 * config.num_layers          # queries and keys
    assert fused.count("Gelu") == config.num_layers
    traced_encoder = ("/encoder/layers.", "/encoder/embeddings/", "/encoder/final_norm/")
    assert not any(n.name.startswith(traced_encoder) for n in model.graph.node)
    assert {o.domain for o in model.opset_import} >= {"", "com.microsoft"}
    assert laya_tiny_bundle.manifest.metadata.exporter["version"] == export.EXPORTER_VERSION
    # fp32 computes the real tokens only: one NonZero finds them, Gathers move rows in and out
    assert laya_tiny_bundle.manifest.metadata.layout["unpadded"] is True
    assert [n.op_type for n in model.graph.node].count("NonZero") == 1


def test_the_unpadded_encoder_gives_every_row_the_answer_it_gets_alone(laya_tiny_bundle, laya_tiny_batches):
    """A row beside other rows, padded to a longer call, gives its logits alone up to float32
    summation order (MatMul blocks by the call's rows): padding is neither computed nor able to
    reach a real token."""
    session = _session(laya_tiny_bundle)
    batch = laya_tiny_batches[0]
    together = _run(session, batch)
    for row in range(batch["input_ids"].shape[0]):
        real = max(1, int(batch["attention_mask"][row].sum()))
        alone = {name: value[row:row + 1] for name, value in batch.items()}
        alone = {**alone, "input_ids": alone["input_ids"][:, :real], "attention_mask": alone["attention_mask"][:, :real]}
        for got, expected in zip(_run(session, alone), together):
            np.testing.assert_allclose(got[0], expected[row], rtol=0, atol=1e-5)


@pytest.mark.parametrize("unpad", [False, True], ids=["padded", "unpadded"])
@pytest.mark.parametrize("length", [1, 7, 8, 9, 23, 24, 25, 40, 64])
def test_fused_encoder_matches_the_traced_export_at_every_window_shape(tiny_traced, length, unpad):
    """One block, windows covering every key (L <= 3 half-widths), and several shifted windows,
    with a padded second row: the substituted graph gives the traced graph's outputs, also when
    it computes the real tokens only."""
    module, traced = tiny_traced
    assert module.encoder.config.sliding_window == 8
    rng = np.random.default_rng(length)
    batch = {
        "input_ids": rng.integers(5, module.encoder.config.vocab_size, size=(2, length)),
        "attention_mask": np.ones((2, length), dtype=np.int64),
        "marker_pos": np.array([[0, length - 1], [0, 0]], dtype=np.int64),
        "marker_mask": np.array([[True, length > 1], [True, False]]),
        "qtype": np.array([0, 2], dtype=np.int64),
    }
    batch["attention_mask"][1, max(1, 2 * length // 3):] = 0
    fused = substitute_encoder(traced, module, max_len=64, unpad=unpad)

    def run(model):
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(["logits", "act_logits"], batch)

    for actual, expected in zip(run(fused), run(traced)):
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)


def test_the_fused_graph_takes_rows_up_to_its_max_len(tiny_traced):
    """The RoPE tables hold max_len positions (the layout's limit, which the processor enforces);
    a longer row is refused by ONNX Runtime rather than rotated with positions it has no table for."""
    module, traced = tiny_traced
    session = ort.InferenceSession(substitute_encoder(traced, module, max_len=16).SerializeToString(),
                                   providers=["CPUExecutionProvider"])

    def row(length: int) -> dict[str, np.ndarray]:
        return {"input_ids": np.full((1, length), 5, dtype=np.int64), "attention_mask": np.ones((1, length), np.int64),
                "marker_pos": np.array([[1]]), "marker_mask": np.array([[True]]), "qtype": np.array([0])}

    assert np.isfinite(session.run(["logits"], row(16))[0]).all()
    with pytest.raises(Exception, match="RotaryEmbedding"):
        session.run(["logits"], row(17))


def test_encoder_substitution_refuses_what_it_cannot_rewrite(tiny_traced):
    module, traced = tiny_traced
    with pytest.raises(ValueError, match="max_len must be at least 1, got 0"):
        substitute_encoder(traced, module, max_len=0)
    headless = onnx.ModelProto()
    headless.CopyFrom(traced)
    kept = [n for n in headless.graph.node if not n.name.startswith("/encoder/final_norm/")]
    del headless.graph.node[:]
    headless.graph.node.extend(kept)
    with pytest.raises(EncoderSubstitutionError, match="expected one encoder output from nodes under '/encoder/final_norm/'"):
        substitute_encoder(headless, module, max_len=64)
