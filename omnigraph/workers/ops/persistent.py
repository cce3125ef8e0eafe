"""The persistent layer kernel's contract in NumPy (issue 19, step 1): its weight packing and the
semantics of one launch, so the CPU can check what the CUDA kernel (`csrc/persistent_layer.cu`)
computes. Not registered as an ORT op yet: see `benchmarks/results/RESULTS.md` (persistent
section) for why.

One launch with `layers == 1` computes, for M rows (M <= 512, d = 1024, F = 2624):

    h1  = h + ctx @ Wo^T                              (FP32)
    x   = bf16(LayerNorm(h1) * mlp_norm)
    u   = x @ Wi^T                                    (FP32 accumulate)
    g   = bf16(gelu_erf(u[:, :F]) * u[:, F:])
    out = h1 + g @ Wo_mlp^T                           (FP32, the residual stream output)
    y   = bf16(LayerNorm(out) * attn_norm_next)
    qkv = bf16(y @ Wqkv_next^T)                       (the next layer's qkv output)

LayerNorm has no bias, biased variance, epsilon 1e-5. With `layers > 1` (benchmarks only) layer
l+1's ctx is layer l's qkv[:, :1024], a stand-in for attention.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "QKV",
    "D",
    "F",
    "bf16_round",
    "fragment_product",
    "layer_tail",
    "pack_weight",
    "unpack_weight",
]

D, F, QKV = 1024, 2624, 3072
_TILE_N, _BLOCK_K = 64, 32


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Rounds FP32 values to the nearest BF16 (ties to even), returned as FP32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def pack_weight(w: np.ndarray) -> np.ndarray:
    """W [N, K] -> the kernel's layout, flat: 64-row tiles, each as K/32 blocks of 4 KB in which
    lane (g, t) of n8-tile nt holds W[nt*8 + g, b*32 + t*8 : +8] (one 16-byte shared-memory load).
    A K chunk of a tile (a task's weights) is then one contiguous run (one bulk copy)."""
    n, k = w.shape
    if n % _TILE_N or k % _BLOCK_K:
        raise ValueError(
            f"weight shape {w.shape}: N must be a multiple of 64 and K of 32"
        )
    return np.ascontiguousarray(
        w.reshape(n // 64, 8, 8, k // 32, 4, 8).transpose(0, 3, 1, 2, 4, 5)
    ).reshape(-1)


def unpack_weight(packed: np.ndarray, n: int, k: int) -> np.ndarray:
    """The inverse of pack_weight."""
    return np.ascontiguousarray(
        packed.reshape(n // 64, k // 32, 8, 8, 4, 8).transpose(0, 2, 3, 1, 4, 5)
    ).reshape(n, k)


def fragment_product(a: np.ndarray, packed: np.ndarray, n: int, k: int) -> np.ndarray:
    """a [M, K] @ W^T computed the way the kernel's warps do it: mma.sync m16n8k16 fragments,
    A read as 16 contiguous bytes per lane (physical columns b*32 + 8t .. +8), the two k16 steps of
    each k32 block fed the permuted halves, B read from the packed layout. Equal to a @ W^T up to
    summation order: it checks the layout contract the kernel relies on."""
    m = a.shape[0]
    tiles = packed.reshape(
        n // 64, k // 32, 8, 32, 8
    )  # tile, block, nt, lane, 8 values
    out = np.zeros((m, n), dtype=np.float64)
    g, t = np.arange(32) // 4, np.arange(32) % 4
    for row0 in range(0, m - m % 16, 16):
        for tile in range(n // 64):
            for nt in range(8):
                c = np.zeros((16, 8))
                for b in range(k // 32):
                    a_lo = a[
                        (row0 + g)[:, None], b * 32 + 8 * t[:, None] + np.arange(8)
                    ]  # [lane, 8]
                    a_hi = a[
                        (row0 + 8 + g)[:, None], b * 32 + 8 * t[:, None] + np.arange(8)
                    ]
                    bw = tiles[tile, b, nt]  # [lane, 8]
                    for j in range(2):
                        # logical A[16, 16] and B[16, 8] of this k16 step, rebuilt from the lanes' registers
                        big_a, big_b = np.zeros((16, 16)), np.zeros((16, 8))
                        for lane in range(32):
                            gg, tt = g[lane], t[lane]
                            lo, hi, wv = (
                                a_lo[lane, 4 * j : 4 * j + 4],
                                a_hi[lane, 4 * j : 4 * j + 4],
                                bw[lane, 4 * j : 4 * j + 4],
                            )
                            (
                                big_a[gg, 2 * tt : 2 * tt + 2],
                                big_a[gg, 2 * tt + 8 : 2 * tt + 10],
                            ) = lo[:2], lo[2:]
                            (
                                big_a[gg + 8, 2 * tt : 2 * tt + 2],
                                big_a[gg + 8, 2 * tt + 8 : 2 * tt + 10],
                            ) = hi[:2], hi[2:]
                            (
                                big_b[2 * tt : 2 * tt + 2, gg],
                                big_b[2 * tt + 8 : 2 * tt + 10, gg],
                            ) = wv[:2], wv[2:]
                        c += big_a @ big_b
                out[row0 : row0 + 16, tile * 64 + nt * 8 : tile * 64 + nt * 8 + 8] = c
    return out


def _layer_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def layer_tail(
    ctx: np.ndarray,
    h: np.ndarray,
    wo: np.ndarray,
    mlp_norm: np.ndarray,
    wi: np.ndarray,
    wo_mlp: np.ndarray,
    attn_norm: np.ndarray,
    wqkv: np.ndarray,
    eps: float = 1e-5,
) -> tuple[np.ndarray, np.ndarray]:
    """One launch with layers == 1, in FP64 with BF16 rounding where the kernel rounds:
    returns (out [M, d] residual, qkv [M, 3d] before its final BF16 rounding)."""
    f = wi.shape[0] // 2
    h1 = (
        h.astype(np.float64)
        + bf16_round(ctx).astype(np.float64) @ wo.astype(np.float64).T
    )
    x = bf16_round(_layer_norm(h1, mlp_norm, eps).astype(np.float32)).astype(np.float64)
    u = x @ wi.astype(np.float64).T
    g = bf16_round((_gelu_erf(u[:, :f]) * u[:, f:]).astype(np.float32)).astype(
        np.float64
    )
    out = h1 + g @ wo_mlp.astype(np.float64).T
    y = bf16_round(_layer_norm(out, attn_norm, eps).astype(np.float32)).astype(
        np.float64
    )
    return out, y @ wqkv.astype(np.float64).T
