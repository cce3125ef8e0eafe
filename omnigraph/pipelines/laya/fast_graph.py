"""The Laya decision graph with its encoder on the omnigraph custom ops (the "fast" bundle).

The decision graph is first traced as the fp32 bundle is (`export.export_onnx` of
`graph.DecisionGraph`, without the fused-operator encoder); then the encoder's nodes are replaced
(`ort_encoder.replace_encoder`) by a chain built here from the same weights, per layer:

    MatMul(Wqkv) -> ModernBertAttention -> MatMul(Wo) -> AddLayerNorm -> MatMul(Wi) -> GeGLU
    -> MatMul(Wo) -> AddLayerNorm (the next layer's attn_norm, or final_norm)

with the residual stream and every norm in FP32 and the projections, their weights and the
activations between them in `activation` (bfloat16 for the CUDA kernels; float32 runs the same
structure on the CPU kernels, which is how CI checks it against the fp32 bundle). The embedding
lookup and its norm stay standard ONNX (FP32), and so does the decision head (type embedding,
two head layers, scorer, action head): everything downstream of the encoder is the fp32 export's
own nodes, untouched. Inputs and outputs are those of the fp32 bundle.

This module imports torch (through the exporter): the `export` extra, never serving code.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from omnigraph.pipelines.laya.export import WEIGHTS_FILE, export_onnx
from omnigraph.pipelines.laya.graph import LOCAL, DecisionGraph, EncoderConfig
from omnigraph.pipelines.laya.ort_encoder import EncoderSubstitutionError, replace_encoder
from omnigraph.workers.ops.graphs import DOMAIN, OPSET
from omnigraph.workers.ops.loader import SUPPORTED_ABI_VERSION

__all__ = ["ACTIVATIONS", "FastGraphError", "bundle_ops_library", "export_fast_onnx", "substitute_encoder"]

ACTIVATIONS = {"bfloat16": TensorProto.BFLOAT16, "float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT}
# The traced graph lacks the encoder the substitution replaces (the error ort_encoder raises).
FastGraphError = EncoderSubstitutionError


def _weight_tensor(name: str, matrix: np.ndarray, data_type: int) -> onnx.TensorProto:
    """A float32 matrix stored as `data_type` (bfloat16: round to nearest even on the bits)."""
    matrix = np.ascontiguousarray(matrix, dtype=np.float32)
    if data_type == TensorProto.FLOAT:
        return numpy_helper.from_array(matrix, name)
    if data_type == TensorProto.FLOAT16:
        return numpy_helper.from_array(matrix.astype(np.float16), name)
    bits = matrix.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return helper.make_tensor(name, TensorProto.BFLOAT16, matrix.shape, rounded.tobytes(), raw=True)


def _encoder_nodes(
    config: EncoderConfig, weights: dict[str, np.ndarray], data_type: int, hidden_out: str
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Nodes and new initializers computing the encoder's output (float32, named `hidden_out`)
    from the graph inputs `input_ids` and `attention_mask`. Norm weights and the embedding table
    are read from the graph's existing float32 initializers, by their checkpoint names."""
    nodes: list[onnx.NodeProto] = []
    initializers: list[onnx.TensorProto] = []

    def node(op: str, inputs: list[str], outputs: list[str], name: str, **attributes: Any) -> None:
        domain = DOMAIN if op in ("ModernBertAttention", "GeGLU", "AddLayerNorm") else ""
        nodes.append(helper.make_node(op, inputs, outputs, name=f"/fast_encoder/{name}", domain=domain, **attributes))

    def to_activation(tensor: str, name: str) -> str:
        if data_type == TensorProto.FLOAT:
            return tensor
        node("Cast", [tensor], [f"{name}_out"], name, to=data_type)
        return f"{name}_out"

    def projection(x: str, weight_name: str, name: str) -> str:
        stored = f"fast.{weight_name}.t"
        initializers.append(_weight_tensor(stored, weights[weight_name].T, data_type))
        node("MatMul", [x, stored], [f"{name}_out"], name)
        return f"{name}_out"

    node("Gather", ["encoder.embeddings.tok_embeddings.weight", "input_ids"], ["embedded"], "embeddings/Gather")
    node("LayerNormalization", ["embedded", "encoder.embeddings.norm.weight"], ["residual_0"], "embeddings/norm",
         axis=-1, epsilon=config.norm_eps)  # fmt: skip
    residual = "residual_0"
    attn_in = to_activation(residual, "layers.0/attn_in_cast")
    for i, layer_type in enumerate(config.layer_types):
        prefix = f"encoder.layers.{i}."
        local = layer_type == LOCAL
        qkv = projection(attn_in, prefix + "attn.Wqkv.weight", f"layers.{i}/Wqkv")
        node("ModernBertAttention", [qkv, "attention_mask"], [f"layers.{i}/context"], f"layers.{i}/attention",
             num_heads=config.num_heads, window=config.sliding_window if local else 0,
             rope_theta=config.local_rope_theta if local else config.global_rope_theta)  # fmt: skip
        attn_out = projection(f"layers.{i}/context", prefix + "attn.Wo.weight", f"layers.{i}/Wo")
        node("AddLayerNorm", [residual, attn_out, prefix + "mlp_norm.weight"],
             [f"layers.{i}/residual_mid", f"layers.{i}/mlp_in"], f"layers.{i}/mlp_norm",
             epsilon=config.norm_eps)  # fmt: skip
        gate_up = projection(f"layers.{i}/mlp_in", prefix + "mlp.Wi.weight", f"layers.{i}/Wi")
        node("GeGLU", [gate_up], [f"layers.{i}/geglu"], f"layers.{i}/geglu")
        mlp_out = projection(f"layers.{i}/geglu", prefix + "mlp.Wo.weight", f"layers.{i}/mlp_Wo")
        last = i == config.num_layers - 1
        norm_weight = "encoder.final_norm.weight" if last else f"encoder.layers.{i + 1}.attn_norm.weight"
        residual, attn_in = f"layers.{i}/residual_out", f"layers.{i}/normed_out"
        node("AddLayerNorm", [f"layers.{i}/residual_mid", mlp_out, norm_weight], [residual, attn_in],
             f"layers.{i}/next_norm", epsilon=config.norm_eps)  # fmt: skip
    if data_type == TensorProto.FLOAT:
        node("Identity", [attn_in], [hidden_out], "output")
    else:
        node("Cast", [attn_in], [hidden_out], "output_cast", to=TensorProto.FLOAT)
    return nodes, initializers


def substitute_encoder(
    model: onnx.ModelProto, module: DecisionGraph, *, activation: str = "bfloat16"
) -> onnx.ModelProto:
    """`model` (the traced fp32 export of `module`, weights loaded) with its encoder on the custom ops."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    weights = {name: tensor.detach().float().numpy() for name, tensor in module.state_dict().items()}
    fast = replace_encoder(
        model, lambda hidden: _encoder_nodes(module.encoder.config, weights, ACTIVATIONS[activation], hidden)
    )
    fast.opset_import.append(helper.make_opsetid(DOMAIN, OPSET))
    fast.graph.name = f"laya_decision_fast_{activation}"
    return fast


def export_fast_onnx(
    module: DecisionGraph, inputs: dict[str, np.ndarray], graph_path: Path, *, activation: str = "bfloat16"
) -> None:
    """Like `export.export_onnx(module, inputs, graph_path, "fp32")`, with the encoder substituted:
    `graph_path` plus every initializer in the one external file weights.bin beside it."""
    with tempfile.TemporaryDirectory(prefix="laya-fast-export-") as scratch:
        reference_path = Path(scratch) / "reference.onnx"
        export_onnx(module, inputs, reference_path, "fp32")
        reference = onnx.load(str(reference_path))
    fast = substitute_encoder(reference, module, activation=activation)
    onnx.save_model(fast, str(graph_path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=WEIGHTS_FILE, size_threshold=0)  # fmt: skip
    (graph_path.parent / WEIGHTS_FILE).chmod(0o644)


def bundle_ops_library(directory: Path, *, arch: str = "90a") -> dict[str, Any]:
    """Builds the op library into `directory` (a bundle's staging folder) and returns the
    manifest's `custom_ops` entry (`CustomOpsEntry` fields) for `pack_bundle(..., custom_ops=...)`.

    With nvcc the library holds the CUDA kernels too; without, the CPU kernels alone (the bundle
    then runs on CPU only). The build manifest JSON beside it is packed as a member as well.
    """
    from omnigraph.workers.ops.build import build_library

    built = build_library(Path(directory), arch=arch)
    return {
        "library_file": built.library_path.name,
        "abi_version": SUPPORTED_ABI_VERSION,
        "sha256": built.library_sha256,
        "domain": DOMAIN,
    }
