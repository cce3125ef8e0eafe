"""The persistent layer kernel's contract in NumPy (issue 19): its weight packing, its task
geometry and the semantics of one launch, so the CPU can check what the CUDA kernel
(`persistent_layer.cu`, beside this file) computes. It is research, not shipped: issue 19 is
blocked, because the design's own floor lies above its targets (round 13 of
`benchmarks/results/persistent-h200.md`), so the kernel was never registered as an ORT op.

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

The kernel runs these as four phases per layer (Wo, Wi, Wo_mlp, Wqkv), each a GEMM whose epilogue
does the row work; `phase_tasks` gives the (column range, K range) of every task of a plan.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "QKV",
    "D",
    "F",
    "PHASES",
    "bf16_round",
    "default_plan",
    "fragment_product",
    "interleave_wi",
    "layer_norm_from_sums",
    "layer_tail",
    "pack_weight",
    "pack_wi",
    "phase_tasks",
    "unpack_weight",
]

D, F, QKV = 1024, 2624, 3072
_GROUP, _BLOCK_K = 8, 32
MAX_NT, MAX_TILES = 8, 512
# phase: (name, columns N in packed order, K, n8 groups per column unit)
PHASES = (("wo", D, D, 1), ("wi", 2 * F, D, 2), ("wo_mlp", D, F, 1), ("wqkv", QKV, D, 1))


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Rounds FP32 values to the nearest BF16 (ties to even), returned as FP32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def pack_weight(w: np.ndarray) -> np.ndarray:
    """W [N, K] -> the kernel's n8-major layout, flat: for each group of 8 rows, K/32 blocks of
    512 bytes in which lane (g, t) holds W[8*group + g, b*32 + t*8 : +8] (one 16-byte load). The 8
    rows of a group over all of K are contiguous, so a task's weights (a range of groups, full K)
    are one contiguous run, and a K range of one group is one run too."""
    n, k = w.shape
    if n % _GROUP or k % _BLOCK_K:
        raise ValueError(
            f"weight shape {w.shape}: N must be a multiple of 8 and K of 32"
        )
    return np.ascontiguousarray(
        w.reshape(n // 8, 8, k // 32, 4, 8).transpose(0, 2, 1, 3, 4)
    ).reshape(-1)


def unpack_weight(packed: np.ndarray, n: int, k: int) -> np.ndarray:
    """The inverse of pack_weight."""
    return np.ascontiguousarray(
        packed.reshape(n // 8, k // 32, 8, 4, 8).transpose(0, 2, 1, 3, 4)
    ).reshape(n, k)


def interleave_wi(wi: np.ndarray) -> np.ndarray:
    """Wi [2F, K] (gate rows then up rows) -> rows in the order 8 gate rows, the matching 8 up rows,
    ...: packed group 2u holds gate features 8u..8u+7, group 2u+1 the same up features, so a tile
    of whole pairs computes GeGLU in its epilogue."""
    two_f, k = wi.shape
    f = two_f // 2
    if two_f % 16:
        raise ValueError(f"Wi shape {wi.shape}: 2F must be a multiple of 16")
    return np.ascontiguousarray(
        wi.reshape(2, f // 8, 8, k).transpose(1, 0, 2, 3)
    ).reshape(two_f, k)


def pack_wi(wi: np.ndarray) -> np.ndarray:
    """Wi as the kernel reads it: interleaved, then packed."""
    return pack_weight(interleave_wi(wi))


def default_plan(m: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(tiles per phase, K splits per phase): the kernel's DefaultPlan."""
    del m
    return (64, 132, 64, 128), (2, 1, 2, 1)


def phase_tasks(phase: int, tiles: int, splits: int) -> list[tuple[int, int, int, int]]:
    """The tasks of one phase in the kernel's order: (first n8 group, groups, first k32 block,
    blocks). Tile t covers column units [t*U // T, (t+1)*U // T), split s the k32 blocks
    [s*KB // S, (s+1)*KB // S). Raises ValueError for a plan the kernel refuses."""
    _, n, k, unit_groups = PHASES[phase]
    units, kb = n // 8 // unit_groups, k // 32
    if not (1 <= tiles <= min(units, MAX_TILES)) or not (1 <= splits <= kb):
        raise ValueError(f"phase {phase}: {tiles} tiles x {splits} splits")
    if -(-units // tiles) * unit_groups > MAX_NT:
        raise ValueError(
            f"phase {phase}: {tiles} tiles make tasks wider than {MAX_NT} n8 groups"
        )
    out = []
    for tile in range(tiles):
        u0, u1 = tile * units // tiles, (tile + 1) * units // tiles
        for split in range(splits):
            b0, b1 = split * kb // splits, (split + 1) * kb // splits
            out.append((u0 * unit_groups, (u1 - u0) * unit_groups, b0, b1 - b0))
    return out


def fragment_product(a: np.ndarray, packed: np.ndarray, n: int, k: int) -> np.ndarray:
    """a [M, K] @ W^T computed the way the kernel's warps do it: mma.sync m16n8k16 fragments,
    A read as 16 contiguous bytes per lane (physical columns b*32 + 8t .. +8), the two k16 steps of
    each k32 block fed the permuted halves, B read from the packed layout. Equal to a @ W^T up to
    summation order: it checks the layout contract the kernel relies on."""
    m = a.shape[0]
    groups = packed.reshape(n // 8, k // 32, 32, 8)  # group, block, lane, 8 values
    out = np.zeros((m, n), dtype=np.float64)
    g, t = np.arange(32) // 4, np.arange(32) % 4
    for row0 in range(0, m - m % 16, 16):
        for grp in range(n // 8):
            c = np.zeros((16, 8))
            for b in range(k // 32):
                a_lo = a[
                    (row0 + g)[:, None], b * 32 + 8 * t[:, None] + np.arange(8)
                ]  # [lane, 8]
                a_hi = a[
                    (row0 + 8 + g)[:, None], b * 32 + 8 * t[:, None] + np.arange(8)
                ]
                bw = groups[grp, b]  # [lane, 8]
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
            out[row0 : row0 + 16, grp * 8 : grp * 8 + 8] = c
    return out


def layer_norm_from_sums(
    y: np.ndarray, weight: np.ndarray, eps: float = 1e-5
) -> np.ndarray:
    """The kernel's LayerNorm epilogue: row sums and sums of squares accumulated per column tile
    (FP32 within a tile, FP64 across tiles), variance as E[y^2] - mean^2 in FP64."""
    s = y.astype(np.float64).sum(axis=-1, keepdims=True)
    q = (y.astype(np.float64) ** 2).sum(axis=-1, keepdims=True)
    mean = s / y.shape[-1]
    var = np.maximum(q / y.shape[-1] - mean**2, 0.0)
    return (y - mean) / np.sqrt(var + eps) * weight


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
