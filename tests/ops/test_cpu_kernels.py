"""The CPU (FP32) kernels inside ONNX graphs match the float64 NumPy references, and bad
attributes or shapes give a clear ORT error naming the op."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument, RuntimeException

from omnigraph.workers.ops import graphs, reference


def _relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.max(np.abs(actual - expected)) / max(1.0, float(np.max(np.abs(expected)))))


@pytest.mark.parametrize(
    ("batch", "length", "heads", "head_dim", "window", "theta"),
    [
        (1, 1, 1, 2, 0, 10000.0),  # smallest: one token attends to itself
        (2, 37, 4, 16, 0, 160000.0),  # global, Laya's global theta
        (2, 37, 2, 32, 5, 10000.0),  # local window
        (3, 20, 2, 64, 1, 10000.0),  # narrowest window, Laya's head size
        (1, 70, 1, 8, 64, 10000.0),  # window wider than the sequence part it matters for
    ],
)
def test_attention_matches_reference(run_cpu, batch, length, heads, head_dim, window, theta):
    rng = np.random.default_rng(length * 31 + head_dim)
    qkv = rng.standard_normal((batch, length, 3 * heads * head_dim)).astype(np.float32)
    mask = np.ones((batch, length), dtype=np.int64)
    if batch > 1:
        mask[1, length // 2 :] = 0  # right padding
    if batch > 2:
        mask[2, :3] = 0  # left padding
    model = graphs.attention_model(num_heads=heads, rope_theta=theta, window=window)
    (context,) = run_cpu(model, qkv=qkv, key_mask=mask)
    expected = reference.modernbert_attention(qkv, mask, num_heads=heads, rope_theta=theta, window=window)
    assert context.shape == (batch, length, heads * head_dim)
    assert _relative_error(context, expected) < 2e-6


def test_attention_query_without_visible_key_gets_zeros(run_cpu):
    # Keys 0..3 real; with window 2, queries 6.. see no real key.
    qkv = np.random.default_rng(1).standard_normal((1, 9, 3 * 8)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 0, 0, 0, 0, 0]], dtype=np.int64)
    (context,) = run_cpu(graphs.attention_model(num_heads=2, rope_theta=10000.0, window=2), qkv=qkv, key_mask=mask)
    assert np.all(context[0, 6:] == 0.0)
    assert np.all(np.abs(context[0, :6]).sum(axis=-1) > 0)


def test_attention_ignores_padded_keys_content(run_cpu):
    rng = np.random.default_rng(2)
    qkv = rng.standard_normal((1, 12, 3 * 16)).astype(np.float32)
    mask = np.array([[1] * 8 + [0] * 4], dtype=np.int64)
    model = graphs.attention_model(num_heads=2, rope_theta=10000.0)
    (first,) = run_cpu(model, qkv=qkv, key_mask=mask)
    qkv[0, 8:] = 1e6  # whatever sits in padded positions
    (second,) = run_cpu(model, qkv=qkv, key_mask=mask)
    np.testing.assert_array_equal(first[0, :8], second[0, :8])


@pytest.mark.parametrize("shape", [(5, 16), (2, 3, 2 * 2624), (1, 2)])
def test_geglu_matches_reference(run_cpu, shape):
    x = (np.random.default_rng(3).standard_normal(shape) * 3).astype(np.float32)
    (y,) = run_cpu(graphs.geglu_model(), x=x.reshape(-1, shape[-1]))
    assert y.shape == (int(np.prod(shape[:-1])), shape[-1] // 2)
    assert _relative_error(y, reference.geglu(x.reshape(-1, shape[-1]))) < 1e-6


@pytest.mark.parametrize(("rows", "dim", "epsilon"), [(7, 64, 1e-5), (3, 1024, 1e-5), (2, 5, 1e-3)])
def test_add_layer_norm_matches_reference(run_cpu, rows, dim, epsilon):
    rng = np.random.default_rng(dim)
    residual = (rng.standard_normal((rows, dim)) * 4 + 2).astype(np.float32)
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    weight = rng.standard_normal(dim).astype(np.float32)
    new_residual, normed = run_cpu(graphs.add_layer_norm_model(epsilon=epsilon), residual=residual, x=x, weight=weight)
    expected_residual, expected_normed = reference.add_layer_norm(residual, x, weight, epsilon=epsilon)
    assert new_residual.dtype == np.float32 and normed.dtype == np.float32
    assert _relative_error(new_residual, expected_residual) < 1e-6
    assert _relative_error(normed, expected_normed) < 2e-6


def test_cuda_build_runs_the_same_cpu_kernels(run_cpu, cuda_library):
    """One .so serves both: the nvcc build loads into CPU onnxruntime and runs its CPU kernels."""
    x = np.random.default_rng(4).standard_normal((4, 10)).astype(np.float32)
    (y,) = run_cpu(graphs.geglu_model(), library=cuda_library.library_path, x=x)
    assert _relative_error(y, reference.geglu(x)) < 1e-6


def test_missing_required_attribute_is_refused_at_session_creation(run_cpu):
    model = graphs.attention_model(num_heads=2, rope_theta=10000.0)
    del model.graph.node[0].attribute[:]  # drops num_heads, window and rope_theta
    with pytest.raises(RuntimeException, match="ModernBertAttention: missing required attribute 'num_heads' \\(an int\\)"):
        run_cpu(model, qkv=np.zeros((1, 2, 12), np.float32), key_mask=np.ones((1, 2), np.int64))


@pytest.mark.parametrize(
    ("attribute", "value", "message"),
    [
        ("num_heads", 0, "num_heads must be positive"),
        ("window", -1, "window must be >= 0"),
        ("rope_theta", -5.0, "rope_theta must be positive"),
    ],
)
def test_bad_attribute_values_are_refused(run_cpu, attribute, value, message):
    settings = {"num_heads": 2, "rope_theta": 10000.0, "window": 0, attribute: value}
    model = graphs.attention_model(**settings)
    with pytest.raises(RuntimeException, match=message):
        run_cpu(model, qkv=np.zeros((1, 2, 12), np.float32), key_mask=np.ones((1, 2), np.int64))


def test_attribute_of_the_wrong_type_is_refused_not_defaulted(run_cpu):
    model = graphs.attention_model(num_heads=2, rope_theta=10000.0)
    window = next(attribute for attribute in model.graph.node[0].attribute if attribute.name == "window")
    window.CopyFrom(helper.make_attribute("window", 2.5))
    with pytest.raises(RuntimeException, match="ModernBertAttention: attribute 'window' must be an int"):
        run_cpu(model, qkv=np.zeros((1, 2, 12), np.float32), key_mask=np.ones((1, 2), np.int64))


@pytest.mark.parametrize(
    ("qkv_shape", "mask_shape", "message"),
    [
        ((1, 4, 13), (1, 4), "last dimension must be 3\\*d, got 13"),
        ((1, 4, 18), (1, 4), "d=6 is not divisible by num_heads=4"),
        ((1, 4, 48), (1, 5), "key_mask must be \\[B, L\\] = \\[1, 4\\], got \\[1, 5\\]"),
        ((1, 4, 12), (1, 4), "head dimension must be even"),
    ],
)
def test_bad_attention_shapes_name_the_problem(run_cpu, qkv_shape, mask_shape, message):
    model = graphs.attention_model(num_heads=4, rope_theta=10000.0)
    with pytest.raises(InvalidArgument, match=f"ModernBertAttention: .*{message}"):
        run_cpu(model, qkv=np.zeros(qkv_shape, np.float32), key_mask=np.ones(mask_shape, np.int64))


def test_geglu_odd_width_is_refused(run_cpu):
    with pytest.raises(InvalidArgument, match="GeGLU: input's last dimension must be even"):
        run_cpu(graphs.geglu_model(), x=np.zeros((2, 7), np.float32))


def test_add_layer_norm_weight_shape_is_checked(run_cpu):
    with pytest.raises(InvalidArgument, match="AddLayerNorm: weight must be \\[8\\], got \\[7\\]"):
        run_cpu(
            graphs.add_layer_norm_model(),
            residual=np.zeros((2, 8), np.float32),
            x=np.zeros((2, 8), np.float32),
            weight=np.ones(7, np.float32),
        )
