"""The Laya encoder on ONNX Runtime's fused operators (the plain bundles' encoder).

The decision graph is first exported from `graph.DecisionGraph` by tracing (`export.export_onnx`);
the traced encoder is about 90 nodes a layer, most of them shape arithmetic around the few that
compute. `substitute_encoder` replaces them by a chain built here from the same weights, per layer:

    MatMul(Wq), MatMul(Wk) -> RotaryEmbedding ; MatMul(Wv)
    -> MultiHeadAttention (global layers: every key; local layers: block-banded, see below)
    -> MatMul(Wo) -> SkipLayerNormalization(mlp_norm)
    -> MatMul(Wi input half), MatMul(Wi gate half) -> Gelu * gate -> MatMul(Wo)
    -> SkipLayerNormalization(the next layer's attn_norm, or final_norm)

so the residual add, the norm, the rotation, the attention's scale, mask, softmax and head
transposes each run as one fused kernel (ONNX Runtime's `com.microsoft` operators, implemented on
its CPU and CUDA execution providers). A local layer attends block by block as
`graph.LocalWindows` describes: the queries in blocks of half-width rows, each block with the
`width` keys its windows reach, one MultiHeadAttention over B * blocks sequences whose
attention bias holds both the window and the key padding. The window tables are computed once
per call from the input's length, as graph.py does.

Everything stays float32; the decision head after the encoder is the traced export's own nodes.
The export validates the result against the torch module (`export.validate_export`), which stays
the reference for every bundle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from omnigraph.pipelines.laya.graph import GLOBAL, LOCAL, DecisionGraph, EncoderConfig

__all__ = ["EncoderSubstitutionError", "replace_encoder", "substitute_encoder"]

CONTRIB_DOMAIN = "com.microsoft"
# The exporter names every node by its module path; the encoder's output is final_norm's.
ENCODER_SCOPE = "/encoder/"
ENCODER_OUTPUT_SCOPE = "/encoder/final_norm/"
# Added to the attention scores of keys a query may not see (graph.py's value).
_NEG = float(np.finfo(np.float32).min)

EncoderBuilder = Callable[[str], tuple[list[onnx.NodeProto], list[onnx.TensorProto]]]


class EncoderSubstitutionError(RuntimeError):
    """The exported decision graph does not have the shape the substitution relies on."""


def replace_encoder(model: onnx.ModelProto, build: EncoderBuilder) -> onnx.ModelProto:
    """A copy of `model` (a traced export of `DecisionGraph`) whose encoder is what `build` returns.

    `build(hidden)` gives the nodes and new initializers computing the encoder's output under the
    name `hidden` from the graph inputs; the traced encoder nodes, and the initializers only they
    read, are dropped.
    """
    producers = [n for n in model.graph.node if n.name.startswith(ENCODER_OUTPUT_SCOPE)]
    outside_inputs = {name for n in model.graph.node if not n.name.startswith(ENCODER_SCOPE) for name in n.input}
    hidden = [out for n in producers for out in n.output if out in outside_inputs]
    if len(hidden) != 1:
        raise EncoderSubstitutionError(f"expected one encoder output from nodes under {ENCODER_OUTPUT_SCOPE!r}, "
                                       f"found {hidden}")
    new_nodes, new_initializers = build(hidden[0])
    replaced = onnx.ModelProto()
    replaced.CopyFrom(model)
    remaining = [n for n in replaced.graph.node if hidden[0] not in n.output]
    del replaced.graph.node[:]
    replaced.graph.node.extend([*new_nodes, *remaining])
    kept = _needed_nodes(replaced.graph)
    del replaced.graph.node[:]
    replaced.graph.node.extend(kept)
    used = {name for n in kept for name in n.input}
    initializers = [t for t in replaced.graph.initializer if t.name in used] + new_initializers
    del replaced.graph.initializer[:]
    replaced.graph.initializer.extend(initializers)
    return replaced


def _needed_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The nodes the graph outputs depend on, in their order (dead-code elimination)."""
    needed = {output.name for output in graph.output}
    kept = []
    for graph_node in reversed(graph.node):
        if needed.intersection(graph_node.output):
            kept.append(graph_node)
            needed.update(graph_node.input)
    return kept[::-1]


def substitute_encoder(model: onnx.ModelProto, module: DecisionGraph, *, max_len: int) -> onnx.ModelProto:
    """`model` (the traced float32 export of `module`, weights loaded) with its encoder on ONNX
    Runtime's fused operators; rows of up to `max_len` tokens (the RoPE tables' length)."""
    if max_len < 1:
        raise ValueError(f"max_len must be at least 1, got {max_len}")
    config = module.encoder.config
    weights = {name: tensor.detach().float().numpy() for name, tensor in module.state_dict().items()}
    rope = {layer_type: _rope_tables(getattr(module.encoder, f"{layer_type}_inv_freq"), max_len)
            for layer_type in (GLOBAL, LOCAL)}
    replaced = replace_encoder(model, lambda hidden: _EncoderBuilder(config, weights, rope).build(hidden))
    if not any(opset.domain == CONTRIB_DOMAIN for opset in replaced.opset_import):
        replaced.opset_import.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
    return replaced


def _rope_tables(inv_freq: torch.Tensor, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """RotaryEmbedding's cos and sin caches (max_len, head_dim / 2), in float32 as graph.py computes them."""
    freqs = torch.arange(max_len).float()[:, None] * inv_freq[None, :]
    return freqs.cos().numpy(), freqs.sin().numpy()


class _EncoderBuilder:
    """Accumulates the nodes and initializers of one substituted encoder."""

    def __init__(self, config: EncoderConfig, weights: dict[str, np.ndarray],
                 rope: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        self.config = config
        self.weights = weights
        self.rope = rope
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def node(self, op: str, inputs: list[str], name: str, *, outputs: int | list[str] = 1,
             domain: str = "", **attributes: Any) -> str:
        """Add a node named `/ort_encoder/<name>`; returns its (first) output's name."""
        names = outputs if isinstance(outputs, list) else [f"{name}_out{i or ''}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, names, name=f"/ort_encoder/{name}", domain=domain,
                                           **attributes))
        return names[0]

    def constant(self, name: str, value: np.ndarray) -> str:
        """A weight-sized constant: an initializer (stored in weights.bin with the others)."""
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), f"ort_encoder.{name}"))
        return f"ort_encoder.{name}"

    def literal(self, name: str, value: np.ndarray) -> str:
        """A small constant as a Constant node: kept in graph.onnx, where shape inference reads it."""
        return self.node("Constant", [], f"constant/{name}", value=numpy_helper.from_array(np.asarray(value), name))

    def projection(self, x: str, weight: np.ndarray, name: str) -> str:
        """x @ weight.T; the transposed weight is the initializer `name` + ".t" (named under the
        checkpoint's `encoder.` prefix, so reduced-precision bundles store it reduced)."""
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(weight.T), f"{name}.t"))
        return self.node("MatMul", [x, f"{name}.t"], name)

    def build(self, hidden: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
        config = self.config
        d, width = config.hidden_size, config.intermediate_size
        cos_sin = {layer_type: (self.constant(f"rope.{layer_type}.cos", cos), self.constant(f"rope.{layer_type}.sin", sin))
                   for layer_type, (cos, sin) in self.rope.items()}
        first_position = self.literal("first_position", np.zeros(1, dtype=np.int64))
        embedded = self.node("Gather", ["encoder.embeddings.tok_embeddings.weight", "input_ids"], "embeddings/gather")
        residual = self.node("LayerNormalization", [embedded, "encoder.embeddings.norm.weight"], "embeddings/norm",
                             axis=-1, epsilon=config.norm_eps)
        normed = residual  # layer 0 has no attn_norm: it reads the normed embeddings
        key_padding = self.node("Cast", ["attention_mask"], "key_padding_mask", to=TensorProto.INT32)
        windows = self.local_windows() if LOCAL in config.layer_types else None
        for i, layer_type in enumerate(config.layer_types):
            prefix, scope = f"encoder.layers.{i}.", f"layers.{i}"
            wqkv = self.weights[prefix + "attn.Wqkv.weight"]
            cos, sin = cos_sin[layer_type]
            q, k = (self.node("RotaryEmbedding", [self.projection(normed, wqkv[j * d:(j + 1) * d], f"{prefix}attn.W{part}"),
                                                  first_position, cos, sin],
                              f"{scope}/rope_{part}", domain=CONTRIB_DOMAIN, num_heads=config.num_heads)
                    for j, part in enumerate("qk"))
            v = self.projection(normed, wqkv[2 * d:], f"{prefix}attn.Wv")
            if layer_type == LOCAL:
                context = self.windowed_attention(q, k, v, windows, scope)
            else:
                context = self.node("MultiHeadAttention", [q, k, v, "", key_padding], f"{scope}/attention",
                                    domain=CONTRIB_DOMAIN, num_heads=config.num_heads,
                                    scale=config.head_dim ** -0.5, mask_filter_value=_NEG)
            attn_out = self.projection(context, self.weights[prefix + "attn.Wo.weight"], f"{prefix}attn.Wo")
            mlp_in, residual = self.skip_norm(attn_out, residual, prefix + "mlp_norm.weight", f"{scope}/mlp_norm")
            wi = self.weights[prefix + "mlp.Wi.weight"]
            activated = self.node("Gelu", [self.projection(mlp_in, wi[:width], f"{prefix}mlp.Wi_input")],
                                  f"{scope}/gelu", domain=CONTRIB_DOMAIN)
            gated = self.node("Mul", [activated, self.projection(mlp_in, wi[width:], f"{prefix}mlp.Wi_gate")], f"{scope}/geglu")
            mlp_out = self.projection(gated, self.weights[prefix + "mlp.Wo.weight"], f"{prefix}mlp.Wo")
            last = i == config.num_layers - 1
            norm_weight = "encoder.final_norm.weight" if last else f"encoder.layers.{i + 1}.attn_norm.weight"
            normed, residual = self.skip_norm(mlp_out, residual, norm_weight, f"{scope}/next_norm",
                                                    normed_name=hidden if last else None)
        return self.nodes, self.initializers

    def skip_norm(self, x: str, residual: str, weight: str, name: str, *, normed_name: str | None = None) -> tuple[str, str]:
        """(norm(residual + x), residual + x): Add then LayerNormalization (ONNX Runtime's CPU
        SkipLayerNormalization is several times slower than the two)."""
        total = self.node("Add", [residual, x], f"{name}/residual")
        normed = self.node("LayerNormalization", [total, weight], name, outputs=[normed_name or f"{name}_out"],
                           axis=-1, epsilon=self.config.norm_eps)
        return normed, total

    def local_windows(self) -> dict[str, str]:
        """`graph.LocalWindows` in ONNX, once per call: `key_index` (N, width), the attention bias
        (B * N, 1, block, width), and the shapes the blocked attention reshapes by."""
        block = half_width = self.config.sliding_window
        c = lambda name, value: self.literal(f"windows/{name}", np.array(value, dtype=np.int64))  # noqa: E731
        zero, one, block_c, axis_last = c("zero", 0), c("one", 1), c("block", block), c("axis_last", [-1])
        node = lambda op, inputs, name, **kw: self.node(op, inputs, f"windows/{name}", **kw)  # noqa: E731
        shape = node("Shape", ["input_ids"], "shape")
        batch, length = (node("Gather", [shape, c(f"dim{i}", i)], f"dim{i}", axis=0) for i in (0, 1))
        blocks = node("Div", [node("Add", [length, c("block_minus_one", block - 1)], "length_up"), block_c], "blocks")
        width = node("Min", [length, c("width_max", block + 2 * half_width)], "width")
        first_key = node("Min", [node("Max", [node("Sub", [node("Mul", [node("Range", [zero, blocks, one], "block_index"),
                                                                          block_c], "block_start"),
                                                           c("half_width", half_width)], "window_start"), zero], "clamp_low"),
                                 node("Sub", [length, width], "last_start")], "first_key")
        key_index = node("Add", [node("Unsqueeze", [first_key, axis_last], "first_key_column"),
                                 node("Range", [zero, width, one], "key_offset")], "key_index")   # (N, width)
        padded = node("Mul", [blocks, block_c], "padded_length")
        blocks_1d = node("Unsqueeze", [blocks, c("axis0", [0])], "blocks_1d")
        query_pos = node("Reshape", [node("Range", [zero, padded, one], "query_positions"),
                                     node("Concat", [blocks_1d, c("block_1d", [block])], "block_shape", axis=0)],
                         "query_pos")                                                            # (N, block)
        distance = node("Abs", [node("Sub", [node("Unsqueeze", [key_index, c("axis1", [1])], "key_index_rows"),
                                             node("Unsqueeze", [query_pos, axis_last], "query_pos_column")],
                                     "signed_distance")], "distance")                            # (N, block, width)
        near = node("LessOrEqual", [distance, c("half_width_bound", half_width)], "near")
        key_visible = node("Gather", [node("Cast", ["attention_mask"], "key_visible", to=TensorProto.BOOL), key_index],
                           "window_keys_visible", axis=1)                                       # (B, N, width)
        visible = node("And", [near, node("Unsqueeze", [key_visible, c("axis2", [2])], "keys_visible_rows")], "visible")
        bias = node("Where", [visible, self.literal("windows/visible_bias", np.array(0.0, dtype=np.float32)),
                              self.literal("windows/hidden_bias", np.array(_NEG, dtype=np.float32))], "bias")
        sequences = node("Unsqueeze", [node("Mul", [batch, blocks], "sequences"), c("axis0b", [0])], "sequences_1d")
        block_bias = node("Reshape", [bias, node("Concat", [sequences, c("bias_tail", [1, block]),
                                                            node("Unsqueeze", [width, c("axis0c", [0])], "width_1d")],
                                                 "bias_shape", axis=0)], "block_bias")          # (B*N, 1, block, width)
        d = self.config.hidden_size
        return {
            "key_index": key_index,
            "bias": block_bias,
            "pad": node("Concat", [c("pad_head", [0, 0, 0, 0]), node("Unsqueeze", [node("Sub", [padded, length],
                                                                                      "pad_rows"), c("axis0d", [0])],
                                                                       "pad_rows_1d"), c("pad_tail", [0])],
                        "pad", axis=0),                                                          # Pad's (B, L, D) pads
            "query_shape": node("Concat", [sequences, c("block_d", [block, d])], "query_shape", axis=0),
            "key_shape": node("Concat", [sequences, c("minus_one_d", [-1, d])], "key_shape", axis=0),
            "out_shape": node("Concat", [node("Unsqueeze", [batch, c("axis0e", [0])], "batch_1d"),
                                         c("minus_one_d_out", [-1, d])], "out_shape", axis=0),
            "length": node("Unsqueeze", [length, c("axis0f", [0])], "length_1d"),
            "zero_1d": c("zero_1d", [0]),
            "axis1_1d": c("axis1_1d", [1]),
        }

    def windowed_attention(self, q: str, k: str, v: str, windows: dict[str, str], scope: str) -> str:
        """A local layer's attention: (B, L, D) queries padded to whole blocks, each block's keys
        gathered, one MultiHeadAttention over B * blocks short sequences, cut back to L rows."""
        node = lambda op, inputs, name, **kw: self.node(op, inputs, f"{scope}/{name}", **kw)  # noqa: E731
        queries = node("Reshape", [node("Pad", [q, windows["pad"]], "pad_queries"), windows["query_shape"]], "query_blocks")
        keys, values = (node("Reshape", [node("Gather", [x, windows["key_index"]], f"gather_{part}", axis=1),
                                         windows["key_shape"]], f"{part}_blocks")
                        for x, part in ((k, "keys"), (v, "values")))
        context = node("MultiHeadAttention", [queries, keys, values, "", "", windows["bias"]], "attention",
                       domain=CONTRIB_DOMAIN, num_heads=self.config.num_heads, scale=self.config.head_dim ** -0.5,
                       mask_filter_value=_NEG)
        rows = node("Reshape", [context, windows["out_shape"]], "context_rows")
        return node("Slice", [rows, windows["zero_1d"], windows["length"], windows["axis1_1d"]], "context")
