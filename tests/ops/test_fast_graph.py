"""The fast Laya graph (encoder on the custom ops) against the fp32 export, on CPU: the float32
twin of the BF16 graph runs the same structure on the CPU kernels and must reproduce the fp32
bundle's logits; the BF16 graph's structure is checked as built."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

pytest.importorskip("torch")

from omnigraph.bundles import pack_bundle  # noqa: E402
from omnigraph.pipelines.laya import export  # noqa: E402
from omnigraph.pipelines.laya.fast_graph import (  # noqa: E402
    FastGraphError,
    bundle_ops_library,
    export_fast_onnx,
    substitute_encoder,
)
from omnigraph.pipelines.laya.graph import (  # noqa: E402
    DecisionGraphConfig,
    build_decision_graph,
    load_checkpoint_weights,
)
from omnigraph.pipelines.laya.synth import cached_checkpoint  # noqa: E402
from omnigraph.workers.ops import graphs  # noqa: E402
from omnigraph.workers.ops.loader import custom_ops_library  # noqa: E402

LOGIT_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(module, example inputs, fp32 reference graph with weights loaded) for the tiny checkpoint."""
    from tokenizers import Tokenizer

    checkpoint = cached_checkpoint("tiny")
    module = build_decision_graph(DecisionGraphConfig.from_checkpoint(checkpoint))
    load_checkpoint_weights(module, checkpoint / "model.safetensors")
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer" / "tokenizer.json"))
    layout = export.bundle_layout(
        export.read_json(checkpoint / "rl_agent_config.json"),
        export.read_json(checkpoint / "tokenizer" / "tokenizer_config.json"),
        tokenizer,
        module.encoder.config.pad_token_id,
    )
    inputs = export.example_inputs(tokenizer, layout)
    reference_path = tmp_path_factory.mktemp("reference") / "graph.onnx"
    export.export_onnx(module, inputs, reference_path, "fp32")
    return module, inputs, onnx.load(str(reference_path))


def _run(model: onnx.ModelProto | str, inputs: dict, library: Path | None = None) -> list[np.ndarray]:
    options = ort.SessionOptions()
    if library is not None:
        options.register_custom_ops_library(str(library))
    source = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"]).run(
        list(export.OUTPUT_NAMES), {name: inputs[name] for name in export.INPUT_NAMES}
    )


def _assert_same_decisions(actual: list[np.ndarray], expected: list[np.ndarray], marker_mask: np.ndarray) -> None:
    assert np.abs(actual[0] - expected[0])[marker_mask].max() <= LOGIT_TOLERANCE
    assert np.abs(actual[1] - expected[1]).max() <= LOGIT_TOLERANCE
    np.testing.assert_array_equal(actual[0][~marker_mask], expected[0][~marker_mask])  # the -1e4 slots


def test_float32_fast_graph_matches_the_fp32_export(tiny, cpu_library):
    module, inputs, reference = tiny
    fast = substitute_encoder(reference, module, activation="float32")
    assert [(i.name, i.type) for i in fast.graph.input] == [(i.name, i.type) for i in reference.graph.input]
    assert [(o.name, o.type) for o in fast.graph.output] == [(o.name, o.type) for o in reference.graph.output]
    _assert_same_decisions(_run(fast, inputs, cpu_library.library_path), _run(reference, inputs), inputs["marker_mask"])


def test_bfloat16_fast_graph_structure(tiny):
    module, _, reference = tiny
    config = module.encoder.config
    fast = substitute_encoder(reference, module, activation="bfloat16")
    ops = [node for node in fast.graph.node if node.domain == "omnigraph"]
    assert sum(node.op_type == "ModernBertAttention" for node in ops) == config.num_layers
    assert sum(node.op_type == "GeGLU" for node in ops) == config.num_layers
    assert sum(node.op_type == "AddLayerNorm" for node in ops) == 2 * config.num_layers
    windows = [
        onnx.helper.get_attribute_value(next(a for a in node.attribute if a.name == "window"))
        for node in ops
        if node.op_type == "ModernBertAttention"
    ]
    assert windows == [0 if t == "full_attention" else config.sliding_window for t in config.layer_types]
    types = {tensor.name: tensor.data_type for tensor in fast.graph.initializer}
    assert types["fast.encoder.layers.0.attn.Wqkv.weight.t"] == TensorProto.BFLOAT16
    assert types["encoder.layers.0.mlp_norm.weight"] == TensorProto.FLOAT  # norms stay FP32
    assert "encoder.layers.0.attn.Wqkv.weight" not in types  # the fp32 projections are gone
    assert not any(node.name.startswith("/encoder/layers.") for node in fast.graph.node)
    assert any(opset.domain == "omnigraph" for opset in fast.opset_import)


def test_a_graph_without_the_encoder_is_refused(tiny):
    module, _, _ = tiny
    with pytest.raises(FastGraphError, match="expected one encoder output"):
        substitute_encoder(graphs.geglu_model(), module, activation="float32")


def test_bad_activation_is_refused(tiny):
    module, _, reference = tiny
    with pytest.raises(ValueError, match="activation must be one of bfloat16, float16, float32"):
        substitute_encoder(reference, module, activation="int8")


def test_fast_bundle_packs_verifies_and_runs(tiny, cpu_library, tmp_path):
    """export_fast_onnx + bundle_ops_library + pack_bundle: the worker's path from manifest to session."""
    module, inputs, reference = tiny
    export_fast_onnx(module, inputs, tmp_path / export.GRAPH_FILE, activation="float32")
    entry = bundle_ops_library(tmp_path)
    bundle = pack_bundle(tmp_path, component=export.COMPONENT, custom_ops=entry)
    library = custom_ops_library(bundle)
    assert library == bundle.custom_ops_path and bundle.manifest.custom_ops.sha256 == entry["sha256"]
    actual = _run(str(bundle.graph_path), inputs, library)
    _assert_same_decisions(actual, _run(reference, inputs), inputs["marker_mask"])
