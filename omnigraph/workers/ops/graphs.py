"""Small ONNX graphs holding one omnigraph op each: how the tests and the GPU self-test call the ops.

Graph inputs and outputs are always float32 (and int64 masks), so NumPy feeds them directly; the
op's activation type follows `dtype` (float32 for the CPU kernels, bfloat16 or float16 for the
CUDA kernels) through Cast nodes around it. FP32 inputs of mixed-precision ops (AddLayerNorm's
residual and weight) stay FP32.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

__all__ = ["DOMAIN", "OPSET", "attention_model", "geglu_model", "add_layer_norm_model"]

DOMAIN = "omnigraph"
OPSET = 1
_ELEM = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


def _elem(dtype: str) -> int:
    try:
        return _ELEM[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_ELEM)}, got {dtype!r}") from None


def _model(
    op: onnx.NodeProto, inputs: dict[str, tuple[bool, list[str]]], outputs: dict[str, tuple[bool, list[str]]], dtype: str
) -> onnx.ModelProto:
    """Wraps `op` in a graph; names flagged True are activations, cast to and from `dtype`."""
    elem = _elem(dtype)
    nodes: list[onnx.NodeProto] = []
    op_inputs, op_outputs = [], []
    graph_inputs, graph_outputs = [], []
    for name, (activation, shape) in inputs.items():
        is_mask = name == "key_mask"
        graph_inputs.append(helper.make_tensor_value_info(name, TensorProto.INT64 if is_mask else TensorProto.FLOAT, shape))
        if activation and elem != TensorProto.FLOAT:
            nodes.append(helper.make_node("Cast", [name], [f"{name}_cast"], name=f"cast_{name}", to=elem))
            op_inputs.append(f"{name}_cast")
        else:
            op_inputs.append(name)
    for name, (activation, shape) in outputs.items():
        graph_outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
        if activation and elem != TensorProto.FLOAT:
            nodes.append(helper.make_node("Cast", [f"{name}_raw"], [name], name=f"cast_{name}", to=TensorProto.FLOAT))
            op_outputs.append(f"{name}_raw")
        else:
            op_outputs.append(name)
    del op.input[:]
    op.input.extend(op_inputs)
    del op.output[:]
    op.output.extend(op_outputs)
    op.name = op.op_type
    casts_in = [node for node in nodes if node.input[0] in inputs]
    casts_out = [node for node in nodes if node.input[0] not in inputs]
    graph = helper.make_graph([*casts_in, op, *casts_out], f"omnigraph_{op.op_type}_{dtype}", graph_inputs, graph_outputs)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, OPSET)], ir_version=9
    )


def attention_model(*, num_heads: int, rope_theta: float, window: int = 0, dtype: str = "float32") -> onnx.ModelProto:
    """qkv [B, L, 3d], key_mask int64 [B, L] -> context [B, L, d]."""
    node = helper.make_node(
        "ModernBertAttention",
        ["qkv", "key_mask"],
        ["context"],
        domain=DOMAIN,
        num_heads=num_heads,
        window=window,
        rope_theta=float(rope_theta),
    )
    return _model(
        node,
        {"qkv": (True, ["B", "L", "D3"]), "key_mask": (False, ["B", "L"])},
        {"context": (True, ["B", "L", "D"])},
        dtype,
    )


def geglu_model(*, dtype: str = "float32") -> onnx.ModelProto:
    """x [N, 2F] -> y [N, F]."""
    node = helper.make_node("GeGLU", ["x"], ["y"], domain=DOMAIN)
    return _model(node, {"x": (True, ["N", "F2"])}, {"y": (True, ["N", "F"])}, dtype)


def add_layer_norm_model(*, epsilon: float = 1e-5, dtype: str = "float32") -> onnx.ModelProto:
    """residual [N, d], x [N, d], weight [d] -> residual_out [N, d], normed [N, d]."""
    node = helper.make_node(
        "AddLayerNorm", ["residual", "x", "weight"], ["residual_out", "normed"], domain=DOMAIN, epsilon=float(epsilon)
    )
    return _model(
        node,
        {"residual": (False, ["N", "D"]), "x": (True, ["N", "D"]), "weight": (False, ["D"])},
        {"residual_out": (False, ["N", "D"]), "normed": (True, ["N", "D"])},
        dtype,
    )
