"""NumPy references of the omnigraph custom ops, written from the ModernBERT definitions.

They are the ground truth the CPU and CUDA kernels are checked against (tests and the GPU
self-test), computed in float64 so that the kernels' own FP32 rounding is what a comparison sees.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["add_layer_norm", "geglu", "modernbert_attention", "rotary"]

_ERF = np.vectorize(math.erf, otypes=[np.float64])


def rotary(x: np.ndarray, theta: float) -> np.ndarray:
    """NeoX-style rotary embedding (ModernBERT's rotate_half) of x [..., L, D] at positions 0..L-1."""
    length, head_dim = x.shape[-2], x.shape[-1]
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(length, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1)
    sin = np.concatenate([np.sin(angles)] * 2, axis=-1)
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def modernbert_attention(
    qkv: np.ndarray, key_mask: np.ndarray, *, num_heads: int, rope_theta: float, window: int = 0
) -> np.ndarray:
    """qkv [B, L, 3d] (Wqkv's output), key_mask [B, L] -> context [B, L, d].

    Query i sees key j when key j is real and (window == 0 or |i - j| <= window); a query that
    sees no key gets zeros.
    """
    batch, length, three_d = qkv.shape
    model_dim = three_d // 3
    head_dim = model_dim // num_heads
    heads = qkv.astype(np.float64).reshape(batch, length, 3, num_heads, head_dim).transpose(2, 0, 3, 1, 4)
    q, k, v = rotary(heads[0], rope_theta), rotary(heads[1], rope_theta), heads[2]
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(head_dim)  # [B, H, L, L]
    visible = (key_mask != 0)[:, None, None, :]
    if window > 0:
        positions = np.arange(length)
        visible = visible & (np.abs(positions[:, None] - positions[None, :]) <= window)[None, None]
    scores = np.where(visible, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    weights = np.where(visible, np.exp(scores - np.where(np.isfinite(row_max), row_max, 0.0)), 0.0)
    totals = weights.sum(axis=-1, keepdims=True)
    probabilities = np.divide(weights, totals, out=np.zeros_like(weights), where=totals > 0)
    context = probabilities @ v  # [B, H, L, D]
    return context.transpose(0, 2, 1, 3).reshape(batch, length, model_dim)


def geglu(x: np.ndarray) -> np.ndarray:
    """x [..., 2F] -> gelu(x[..., :F]) * x[..., F:] with the exact (erf) GELU, ModernBERT's "gelu"."""
    a, gate = np.split(x.astype(np.float64), 2, axis=-1)
    return 0.5 * a * (1.0 + _ERF(a / math.sqrt(2.0))) * gate


def add_layer_norm(
    residual: np.ndarray, x: np.ndarray, weight: np.ndarray, *, epsilon: float = 1e-5
) -> tuple[np.ndarray, np.ndarray]:
    """(residual + x, LayerNorm(residual + x) * weight): no bias, biased variance."""
    total = residual.astype(np.float64) + x.astype(np.float64)
    mean = total.mean(axis=-1, keepdims=True)
    variance = ((total - mean) ** 2).mean(axis=-1, keepdims=True)
    return total, (total - mean) / np.sqrt(variance + epsilon) * weight.astype(np.float64)
