"""The Laya encoder on ONNX Runtime's fused operators (the plain bundles' encoder).

The decision graph is first exported from `graph.DecisionGraph` by tracing (`export.export_onnx`);
the traced encoder is about 90 nodes a layer, most of them shape arithmetic around the few that
compute. `substitute_encoder` replaces them by a chain built here from the same weights, per layer:

    MatMul(Wq), MatMul(Wk) -> RotaryEmbedding ; MatMul(Wv)
    -> MultiHeadAttention (global layers: every key; local layers: block-banded, see below)
    -> MatMul(Wo) -> Add (residual) -> LayerNormalization(mlp_norm)
    -> MatMul(Wi input half), MatMul(Wi gate half) -> Gelu * gate -> MatMul(Wo)
    -> Add (residual) -> LayerNormalization(the next layer's attn_norm, or final_norm)

so the rotation and the attention's scale, mask, softmax and head transposes each run as one
fused kernel (ONNX Runtime's `com.microsoft` operators, implemented on its CPU and CUDA execution
providers), and nothing is left to compute shapes but the local windows' tables. (ONNX Runtime's
SkipLayerNormalization would fuse the residual add too, but its CPU kernel is several times
slower than Add + LayerNormalization.)

Unpadded (`unpad=True`, as ModernBERT itself runs when it can): everything that works token by
token (the embedding, every projection, GeGLU, the residual stream and the norms) runs on the
call's real tokens only, an (N, D) matrix gathered once by the attention mask; only the rotation
and attention see the (B, L, D) layout, their inputs gathered into it (padded positions copy some
real token: attention masks them) and their output gathered back. A call of rows padded to a
common length then computes no padding in its projections, most of its FLOPs. The price is a
data-dependent shape (N): such a graph cannot run at fixed shapes (a captured CUDA graph, a
TensorRT engine), so only the float32 bundles (the CPU's) are built this way.

A local layer attends block by block as `graph.LocalWindows` describes: the queries in blocks of
half-width rows, each block with the `width` keys its windows reach, one MultiHeadAttention over
B * blocks short sequences whose attention bias holds both the window and the key padding. The
window tables are computed once per call from the input's length, as graph.py does.

Everything stays float32; the decision head after the encoder is the traced export's own nodes.
The export validates the result against the torch module (`export.validate_export`), which stays
the reference for every bundle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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


def substitute_encoder(model: onnx.ModelProto, module: DecisionGraph, *, max_len: int,
                       unpad: bool = False) -> onnx.ModelProto:
    """`model` (the traced float32 export of `module`, weights loaded) with its encoder on ONNX
    Runtime's fused operators; rows of up to `max_len` tokens (the RoPE tables' length); with
    `unpad`, its token-wise work on real tokens only (see the module docstring)."""
    if max_len < 1:
        raise ValueError(f"max_len must be at least 1, got {max_len}")
    config = module.encoder.config
    weights = {name: tensor.detach().float().numpy() for name, tensor in module.state_dict().items()}
    rope = {layer_type: _rope_tables(getattr(module.encoder, f"{layer_type}_inv_freq"), max_len)
            for layer_type in (GLOBAL, LOCAL)}
    replaced = replace_encoder(model, lambda hidden: _EncoderBuilder(config, weights, rope, unpad).build(hidden))
    if not any(opset.domain == CONTRIB_DOMAIN for opset in replaced.opset_import):
        replaced.opset_import.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
    return replaced


def _rope_tables(inv_freq: torch.Tensor, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """RotaryEmbedding's cos and sin caches (max_len, head_dim / 2), in float32 as graph.py computes them."""
    freqs = torch.arange(max_len).float()[:, None] * inv_freq[None, :]
    return freqs.cos().numpy(), freqs.sin().numpy()


@dataclass(frozen=True)
class _Windows:
    """Names of the local layers' window tensors (`graph.LocalWindows` in ONNX), built once per call."""

    key_index: str    # (N, width) int64: the keys each block of queries scores
    bias: str         # (B * N, 1, block, width) float32: 0 where visible, the most negative float elsewhere
    query_pads: str   # Pad's pads that take (B, L, D) queries to whole blocks
    query_shape: str  # (B * N, block, D)
    key_shape: str    # (B * N, width, D)
    row_shape: str    # (B, N * block, D)
    length: str       # (1,) int64: L, where the context is cut back


@dataclass(frozen=True)
class _RealTokens:
    """Names of the tensors that move rows between the (B, L, D) layout and the real tokens."""

    token_ids: str      # (N,) int64: the real tokens' ids
    token_index: str    # (N,) int64: the flat position b * L + l of each real token, in order
    padded_index: str   # (B * L,) int64: for each position, the real token (row of N) it copies
    padded_shape: str   # (3,) int64: B, L, D
    rows_shape: str     # (2,) int64: -1, D


class _EncoderBuilder:
    """Accumulates the nodes and initializers of one substituted encoder."""

    def __init__(self, config: EncoderConfig, weights: dict[str, np.ndarray],
                 rope: dict[str, tuple[np.ndarray, np.ndarray]], unpad: bool) -> None:
        self.config = config
        self.weights = weights
        self.rope = rope
        self.unpad = unpad
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def node(self, op: str, inputs: list[str], name: str, *, outputs: list[str] | None = None,
             domain: str = "", **attributes: Any) -> str:
        """Add a node named `/ort_encoder/<name>`; returns its (first) output's name."""
        outputs = outputs or [f"{name}_out"]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=f"/ort_encoder/{name}", domain=domain,
                                           **attributes))
        return outputs[0]

    def fused(self, op: str, inputs: list[str], name: str, **attributes: Any) -> str:
        """A node of ONNX Runtime's contrib domain."""
        return self.node(op, inputs, name, domain=CONTRIB_DOMAIN, **attributes)

    def literal(self, name: str, value: Any, dtype: type = np.int64) -> str:
        """A small constant as a Constant node: kept in graph.onnx, where shape inference reads it."""
        return self.node("Constant", [], f"constant/{name}",
                         value=numpy_helper.from_array(np.asarray(value, dtype=dtype), name))

    def initializer(self, name: str, value: np.ndarray) -> str:
        """A weight-sized constant, stored in weights.bin with the others."""
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def projection(self, x: str, weight: np.ndarray, name: str) -> str:
        """x @ weight.T; the transposed weight is the initializer `name.t`, named under the
        checkpoint's `encoder.` prefix, so reduced-precision bundles store it reduced."""
        return self.node("MatMul", [x, self.initializer(f"{name}.t", weight.T)], name)

    def add_norm(self, residual: str, x: str, weight: str, name: str, *, normed: str | None = None) -> tuple[str, str]:
        """(LayerNorm(residual + x), residual + x)."""
        total = self.node("Add", [residual, x], f"{name}/residual")
        out = self.node("LayerNormalization", [total, weight], name, outputs=[normed] if normed else None,
                        axis=-1, epsilon=self.config.norm_eps)
        return out, total

    def build(self, hidden: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
        config = self.config
        d, width = config.hidden_size, config.intermediate_size
        attention = {"num_heads": config.num_heads, "scale": config.head_dim ** -0.5, "mask_filter_value": _NEG}
        rope = {layer_type: [self.initializer(f"ort_encoder.rope.{layer_type}.{part}", table)
                             for part, table in zip(("cos", "sin"), tables)]
                for layer_type, tables in self.rope.items()}
        first_position = self.literal("first_position", [0])
        tokens = self.real_tokens() if self.unpad else None
        token_ids = "input_ids" if tokens is None else tokens.token_ids
        embedded = self.node("Gather", ["encoder.embeddings.tok_embeddings.weight", token_ids], "embeddings/gather")
        residual = self.node("LayerNormalization", [embedded, "encoder.embeddings.norm.weight"], "embeddings/norm",
                             axis=-1, epsilon=config.norm_eps)
        normed = residual  # layer 0 has no attn_norm: it reads the normed embeddings
        key_padding = self.node("Cast", ["attention_mask"], "key_padding_mask", to=TensorProto.INT32)
        windows = self.local_windows() if LOCAL in config.layer_types else None
        for i, layer_type in enumerate(config.layer_types):
            prefix, scope = f"encoder.layers.{i}.", f"layers.{i}"
            wqkv = self.weights[prefix + "attn.Wqkv.weight"]
            q = self.projection(normed, wqkv[:d], prefix + "attn.Wq")
            k = self.projection(normed, wqkv[d:2 * d], prefix + "attn.Wk")
            v = self.projection(normed, wqkv[2 * d:], prefix + "attn.Wv")
            if tokens is not None:
                q, k, v = (self.padded(x, tokens, f"{scope}/padded_{part}")
                           for x, part in ((q, "q"), (k, "k"), (v, "v")))
            q, k = (self.fused("RotaryEmbedding", [x, first_position, *rope[layer_type]], f"{scope}/rope_{part}",
                               num_heads=config.num_heads) for x, part in ((q, "q"), (k, "k")))
            if layer_type == LOCAL:
                assert windows is not None  # built above, as LOCAL is among the layer types
                context = self.windowed_attention(q, k, v, windows, scope, attention)
            else:
                context = self.fused("MultiHeadAttention", [q, k, v, "", key_padding], f"{scope}/attention",
                                     **attention)
            if tokens is not None:
                context = self.real(context, tokens, f"{scope}/real_context")
            attn_out = self.projection(context, self.weights[prefix + "attn.Wo.weight"], prefix + "attn.Wo")
            mlp_in, residual = self.add_norm(residual, attn_out, prefix + "mlp_norm.weight", f"{scope}/mlp_norm")
            wi = self.weights[prefix + "mlp.Wi.weight"]
            activated = self.fused("Gelu", [self.projection(mlp_in, wi[:width], prefix + "mlp.Wi_input")],
                                   f"{scope}/gelu")
            gated = self.node("Mul", [activated, self.projection(mlp_in, wi[width:], prefix + "mlp.Wi_gate")],
                              f"{scope}/geglu")
            mlp_out = self.projection(gated, self.weights[prefix + "mlp.Wo.weight"], prefix + "mlp.Wo")
            last = i == config.num_layers - 1
            norm_weight = "encoder.final_norm.weight" if last else f"encoder.layers.{i + 1}.attn_norm.weight"
            normed, residual = self.add_norm(residual, mlp_out, norm_weight, f"{scope}/next_norm",
                                             normed=hidden if last and tokens is None else None)
        if tokens is not None:
            self.padded(normed, tokens, "unpad/hidden", output=hidden)
        return self.nodes, self.initializers

    def real_tokens(self) -> _RealTokens:
        """The gather indices between (B, L) positions and the real tokens (attention_mask != 0).

        A padded position copies the last real token before it (the first row's leading padding,
        which the processor never sends, copies token 0): any finite value serves, attention masks it."""
        flat = self.literal("unpad/flat", [-1])
        real = self.node("Cast", [self.node("Reshape", ["attention_mask", flat], "unpad/flat_mask")], "unpad/real",
                         to=TensorProto.BOOL)
        token_index = self.node("Squeeze", [self.node("NonZero", [real], "unpad/nonzero"),
                                            self.literal("unpad/index_axis", [0])], "unpad/token_index")
        seen = self.node("CumSum", [self.node("Cast", [real], "unpad/real_count", to=TensorProto.INT64),
                                    self.literal("unpad/cumsum_axis", 0)], "unpad/seen")
        latest = self.node("Sub", [seen, self.literal("unpad/one", 1)], "unpad/latest")
        padded_index = self.node("Max", [latest, self.literal("unpad/zero", 0)], "unpad/padded_index")
        padded_shape = self.node("Concat", [self.node("Shape", ["input_ids"], "unpad/input_shape"),
                                            self.literal("unpad/width", [self.config.hidden_size])],
                                 "unpad/padded_shape", axis=0)
        token_ids = self.node("Gather", [self.node("Reshape", ["input_ids", flat], "unpad/flat_ids"), token_index],
                              "unpad/token_ids", axis=0)
        return _RealTokens(token_ids=token_ids, token_index=token_index, padded_index=padded_index,
                           padded_shape=padded_shape,
                           rows_shape=self.literal("unpad/rows_shape", [-1, self.config.hidden_size]))

    def padded(self, x: str, tokens: _RealTokens, name: str, *, output: str | None = None) -> str:
        """(N, D) real tokens -> (B, L, D)."""
        rows = self.node("Gather", [x, tokens.padded_index], f"{name}/rows", axis=0)
        return self.node("Reshape", [rows, tokens.padded_shape], name, outputs=[output] if output else None)

    def real(self, x: str, tokens: _RealTokens, name: str) -> str:
        """(B, L, D) -> (N, D) real tokens."""
        flat = self.node("Reshape", [x, tokens.rows_shape], f"{name}/flat")
        return self.node("Gather", [flat, tokens.token_index], name, axis=0)

    def local_windows(self) -> _Windows:
        """`graph.LocalWindows.build` in ONNX: blocks of `block` = half-width queries, each scoring
        `width` = min(L, 3 * half-width) consecutive keys starting at its first window's start,
        shifted inwards at the ends."""
        block = half_width = self.config.sliding_window
        d = self.config.hidden_size

        def node(op: str, inputs: list[str], name: str, **attributes: Any) -> str:
            return self.node(op, inputs, f"windows/{name}", **attributes)

        def lit(name: str, value: Any) -> str:
            return self.literal(f"windows/{name}", value)

        def as_1d(scalar: str, name: str) -> str:
            return node("Unsqueeze", [scalar, lit(f"{name}_axis", [0])], name)

        zero, one, block_size = lit("zero", 0), lit("one", 1), lit("block", block)
        shape = node("Shape", ["input_ids"], "input_shape")
        batch = node("Gather", [shape, lit("batch_axis", 0)], "batch", axis=0)
        length = node("Gather", [shape, lit("length_axis", 1)], "length", axis=0)
        blocks = node("Div", [node("Add", [length, lit("block_minus_one", block - 1)], "length_rounded_up"),
                              block_size], "blocks")
        width = node("Min", [length, lit("width_limit", block + 2 * half_width)], "width")
        block_start = node("Mul", [node("Range", [zero, blocks, one], "block_index"), block_size], "block_start")
        window_start = node("Max", [node("Sub", [block_start, lit("half_width", half_width)], "window_start_raw"),
                                    zero], "window_start")
        first_key = node("Min", [window_start, node("Sub", [length, width], "last_first_key")], "first_key")
        key_index = node("Add", [node("Unsqueeze", [first_key, lit("column_axis", [-1])], "first_key_column"),
                                 node("Range", [zero, width, one], "key_offset")], "key_index")      # (N, width)
        padded_length = node("Mul", [blocks, block_size], "padded_length")
        block_shape = node("Concat", [as_1d(blocks, "blocks_1d"), lit("block_1d", [block])], "block_shape", axis=0)
        query_pos = node("Reshape", [node("Range", [zero, padded_length, one], "query_positions"), block_shape],
                         "query_pos")                                                                # (N, block)
        offset = node("Sub", [node("Unsqueeze", [key_index, lit("row_axis", [1])], "key_index_rows"),
                              node("Unsqueeze", [query_pos, lit("key_axis", [-1])], "query_pos_column")], "offset")
        near = node("LessOrEqual", [node("Abs", [offset], "distance"), lit("max_distance", half_width)], "near")
        real_keys = node("Gather", [node("Cast", ["attention_mask"], "real", to=TensorProto.BOOL), key_index],
                         "real_keys", axis=1)                                                 # (B, N, width)
        visible = node("And", [near, node("Unsqueeze", [real_keys, lit("query_axis", [2])], "real_keys_rows")],
                       "visible")                                                             # (B, N, block, width)
        bias = node("Where", [visible, self.literal("windows/seen", 0.0, np.float32),
                              self.literal("windows/unseen", _NEG, np.float32)], "bias")
        sequences = as_1d(node("Mul", [batch, blocks], "sequences"), "sequences_1d")
        width_1d = as_1d(width, "width_1d")
        pad_rows = as_1d(node("Sub", [padded_length, length], "pad_rows"), "pad_rows_1d")
        return _Windows(
            key_index=key_index,
            bias=node("Reshape", [bias, node("Concat", [sequences, lit("bias_middle", [1, block]), width_1d],
                                             "bias_shape", axis=0)], "block_bias"),
            query_pads=node("Concat", [lit("pads_before", [0, 0, 0, 0]), pad_rows, lit("pads_after", [0])],
                            "query_pads", axis=0),
            query_shape=node("Concat", [sequences, lit("query_tail", [block, d])], "query_shape", axis=0),
            key_shape=node("Concat", [sequences, width_1d, lit("key_tail", [d])], "key_shape", axis=0),
            row_shape=node("Concat", [as_1d(batch, "batch_1d"), lit("row_tail", [-1, d])], "row_shape", axis=0),
            length=as_1d(length, "length_1d"),
        )

    def windowed_attention(self, q: str, k: str, v: str, windows: _Windows, scope: str,
                           attention: dict[str, Any]) -> str:
        """A local layer's attention: (B, L, D) queries padded to whole blocks, each block's keys
        and values gathered, one MultiHeadAttention over B * N short sequences, cut back to L rows."""
        def node(op: str, inputs: list[str], name: str, **attributes: Any) -> str:
            return self.node(op, inputs, f"{scope}/{name}", **attributes)

        queries = node("Reshape", [node("Pad", [q, windows.query_pads], "padded_queries"), windows.query_shape],
                       "query_blocks")
        keys, values = (node("Reshape", [node("Gather", [x, windows.key_index], f"window_{part}", axis=1),
                                         windows.key_shape], f"{part}_blocks")
                        for x, part in ((k, "keys"), (v, "values")))
        context = self.fused("MultiHeadAttention", [queries, keys, values, "", "", windows.bias],
                             f"{scope}/attention", **attention)
        rows = node("Reshape", [context, windows.row_shape], "context_rows")
        return node("Slice", [rows, self.literal(f"{scope}/slice_start", [0]), windows.length,
                              self.literal(f"{scope}/slice_axis", [1])], "context")
