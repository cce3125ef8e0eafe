"""Small ONNX graphs holding one omnigraph op each: how the tests and the GPU self-test call the ops.

Graph inputs and outputs are always float32 (and int64 masks), so NumPy feeds them directly; the
op's activation type follows `dtype` (float32 for the CPU kernels, bfloat16 or float16 for the
CUDA kernels) through Cast nodes around it. FP32 inputs of mixed-precision ops (AddLayerNorm's
residual and weight) stay FP32.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import onnx
from onnx import TensorProto, helper

from omnigraph.workers.ops.loader import DOMAIN

__all__ = ["DOMAIN", "OPSET", "add_layer_norm_model", "attention_model", "geglu_model"]

OPSET = 1  # the `omnigraph` domain's opset version
_ELEM = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}

# A graph input or output: (name, shape, element type at the graph boundary, is an activation).
Port = tuple[str, Sequence[str], int, bool]


def _one_op_model(op_type: str, inputs: Sequence[Port], outputs: Sequence[Port], dtype: str,
                  attributes: Mapping[str, Any]) -> onnx.ModelProto:  # fmt: skip
    """Cast(activations -> dtype) -> op -> Cast(activations -> float32)."""
    try:
        elem = _ELEM[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_ELEM)}, got {dtype!r}") from None
    cast = elem != TensorProto.FLOAT
    casts_in, casts_out, op_inputs, op_outputs = [], [], [], []
    for name, _, _, activation in inputs:
        if cast and activation:
            casts_in.append(helper.make_node("Cast", [name], [f"{name}_{dtype}"], name=f"cast_{name}", to=elem))
        op_inputs.append(f"{name}_{dtype}" if cast and activation else name)
    for name, _, _, activation in outputs:
        if cast and activation:
            casts_out.append(
                helper.make_node("Cast", [f"{name}_{dtype}"], [name], name=f"cast_{name}", to=TensorProto.FLOAT)
            )
        op_outputs.append(f"{name}_{dtype}" if cast and activation else name)
    op = helper.make_node(op_type, op_inputs, op_outputs, name=op_type, domain=DOMAIN, **attributes)
    graph = helper.make_graph(
        [*casts_in, op, *casts_out],
        f"omnigraph_{op_type}_{dtype}",
        [helper.make_tensor_value_info(name, boundary, list(shape)) for name, shape, boundary, _ in inputs],
        [helper.make_tensor_value_info(name, boundary, list(shape)) for name, shape, boundary, _ in outputs],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, OPSET)], ir_version=9
    )


def attention_model(*, num_heads: int, rope_theta: float, window: int = 0, dtype: str = "float32") -> onnx.ModelProto:
    """qkv [B, L, 3d], key_mask int64 [B, L] -> context [B, L, d]."""
    return _one_op_model(
        "ModernBertAttention",
        [("qkv", ["B", "L", "D3"], TensorProto.FLOAT, True), ("key_mask", ["B", "L"], TensorProto.INT64, False)],
        [("context", ["B", "L", "D"], TensorProto.FLOAT, True)],
        dtype,
        {"num_heads": num_heads, "window": window, "rope_theta": float(rope_theta)},
    )


def geglu_model(*, dtype: str = "float32") -> onnx.ModelProto:
    """x [N, 2F] -> y [N, F]."""
    return _one_op_model(
        "GeGLU", [("x", ["N", "F2"], TensorProto.FLOAT, True)], [("y", ["N", "F"], TensorProto.FLOAT, True)], dtype, {}
    )


def add_layer_norm_model(*, epsilon: float = 1e-5, dtype: str = "float32") -> onnx.ModelProto:
    """residual [N, d], x [N, d], weight [d] -> residual_out [N, d], normed [N, d]."""
    return _one_op_model(
        "AddLayerNorm",
        [
            ("residual", ["N", "D"], TensorProto.FLOAT, False),
            ("x", ["N", "D"], TensorProto.FLOAT, True),
            ("weight", ["D"], TensorProto.FLOAT, False),
        ],
        [("residual_out", ["N", "D"], TensorProto.FLOAT, False), ("normed", ["N", "D"], TensorProto.FLOAT, True)],
        dtype,
        {"epsilon": float(epsilon)},
    )
