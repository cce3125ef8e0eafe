"""The persistent layer kernel's contract (benchmarks/gpu/persistent/: persistent_layer.py, persistent_layer.cu).

On the CPU: the weight packing round-trips, the kernel's fragment mapping (mma.sync m16n8k16 with
the K permutation that its 16-byte A loads and the packing share) reproduces a @ W^T, and the NumPy
semantics agree with the op references (GeGLU, AddLayerNorm). On a GPU (marked `gpu`): the kernel,
built with nvcc, matches those semantics for one layer at batch-1 shapes.
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import numpy as np
import pytest

from benchmarks.gpu.persistent.persistent_layer import (
    D,
    F,
    PHASES,
    bf16_round,
    default_plan,
    fragment_product,
    interleave_wi,
    layer_norm_from_sums,
    layer_tail,
    pack_weight,
    pack_wi,
    phase_tasks,
    unpack_weight,
)
from omnigraph.workers.ops import reference
from omnigraph.workers.ops.build import find_nvcc

CSRC = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "persistent"
# plans the benchmark times (tiles per phase, K splits per phase); the default first
PLANS = (
    default_plan(64),
    ((64, 164, 64, 128), (2, 1, 2, 1)),
    ((128, 164, 128, 128), (1, 1, 1, 1)),
    ((64, 132, 64, 132), (2, 1, 2, 1)),
    ((64, 164, 32, 128), (2, 1, 4, 1)),
)


def test_pack_weight_round_trips_and_keeps_groups_contiguous():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((24, 96)).astype(np.float32)
    packed = pack_weight(w)
    assert packed.shape == (24 * 96,)
    np.testing.assert_array_equal(unpack_weight(packed, 24, 96), w)
    # group 1 (rows 8..15) is one run of 3 blocks; in block 2, lane (g, t) holds W[8+g, 64+8t : +8]
    group = packed[1 * 8 * 96 : 2 * 8 * 96].reshape(3, 32, 8)
    for lane in (0, 5, 31):
        g, t = divmod(lane, 4)
        np.testing.assert_array_equal(group[2, lane], w[8 + g, 64 + t * 8 : 64 + t * 8 + 8])
    with pytest.raises(ValueError):
        pack_weight(np.zeros((12, 64), np.float32))


def test_wi_interleave_pairs_gate_and_up_groups():
    rng = np.random.default_rng(5)
    f, k = 24, 32
    wi = rng.standard_normal((2 * f, k)).astype(np.float32)
    inter = interleave_wi(wi)
    for u in range(f // 8):
        np.testing.assert_array_equal(inter[16 * u : 16 * u + 8], wi[8 * u : 8 * u + 8])
        np.testing.assert_array_equal(inter[16 * u + 8 : 16 * u + 16], wi[f + 8 * u : f + 8 * u + 8])
    # the GeGLU epilogue: packed n8 tile 2j (gate) and 2j+1 (up) give features 8j .. 8j+7
    x = rng.standard_normal((3, k))
    u_packed = x @ unpack_weight(pack_wi(wi), 2 * f, k).T
    u = x @ wi.T
    for j in range(f // 8):
        np.testing.assert_allclose(u_packed[:, 16 * j : 16 * j + 8], u[:, 8 * j : 8 * j + 8])
        np.testing.assert_allclose(u_packed[:, 16 * j + 8 : 16 * j + 16], u[:, f + 8 * j : f + 8 * j + 8])


@pytest.mark.parametrize("plan", PLANS)
def test_plan_tasks_cover_every_column_and_k_block_once(plan):
    tiles, splits = plan
    for phase, (_, n, k, unit_groups) in enumerate(PHASES):
        seen = np.zeros((n // 8, k // 32), dtype=int)
        tasks = phase_tasks(phase, tiles[phase], splits[phase])
        assert len(tasks) == tiles[phase] * splits[phase]
        for g0, nt, b0, nb in tasks:
            assert nt % unit_groups == 0 and g0 % unit_groups == 0 and 1 <= nt <= 8 and nb >= 1
            seen[g0 : g0 + nt, b0 : b0 + nb] += 1
        assert (seen == 1).all()
        if phase in (0, 2):  # LayerNorm phases meet inside the phase: one task per CTA
            assert len(tasks) <= 132
    with pytest.raises(ValueError):
        phase_tasks(1, 20, 1)  # 328 pair units / 20 tiles = 17 pairs: wider than 8 n8 groups


def test_fragment_mapping_reproduces_the_matrix_product():
    rng = np.random.default_rng(2)
    for m, n, k in ((16, 8, 32), (32, 24, 64)):
        a = rng.standard_normal((m, k))
        w = rng.standard_normal((n, k))
        np.testing.assert_allclose(
            fragment_product(a, pack_weight(w), n, k), a @ w.T, rtol=1e-12, atol=1e-12
        )


def test_layer_norm_from_sums_matches_two_pass():
    rng = np.random.default_rng(6)
    y = (rng.standard_normal((4, D)) * 3 + 5).astype(np.float32)  # a mean well off zero
    w = 1 + 0.1 * rng.standard_normal(D)
    mean = y.astype(np.float64).mean(-1, keepdims=True)
    ref = (y - mean) / np.sqrt(((y - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(layer_norm_from_sums(y, w), ref, rtol=1e-6, atol=1e-6)


def test_bf16_round_matches_bit_truncation_with_ties_to_even():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 3.14159], np.float32)
    got = bf16_round(x)
    assert (
        got[0] == 1.0 and got[1] == 1.0 and got[2] == 1.0 + 4 * 2**-8 and got[3] == -2.5
    )
    assert abs(got[4] - 3.14159) < 2**-7 * 4


def test_layer_tail_agrees_with_the_op_references():
    rng = np.random.default_rng(3)
    m, d, f = 8, 64, 96
    ctx, h = (
        rng.standard_normal((m, d)).astype(np.float32),
        rng.standard_normal((m, d)).astype(np.float32),
    )
    wo, wi = rng.standard_normal((d, d)) / 8, rng.standard_normal((2 * f, d)) / 8
    wo_mlp, wqkv = rng.standard_normal((d, f)) / 10, rng.standard_normal((3 * d, d)) / 8
    n1, n2 = 1 + 0.1 * rng.standard_normal(d), 1 + 0.1 * rng.standard_normal(d)
    out, qkv = layer_tail(ctx, h, wo, n1, wi, wo_mlp, n2, wqkv)
    # the same chain through the existing ops' NumPy definitions (no BF16 rounding: loose tolerance)
    h1, x = reference.add_layer_norm(h, bf16_round(ctx) @ wo.T, n1, epsilon=1e-5)
    g = reference.geglu(x @ wi.T)
    out_ref, y = reference.add_layer_norm(h1, g @ wo_mlp.T, n2, epsilon=1e-5)
    np.testing.assert_allclose(out, out_ref, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(qkv, y @ wqkv.T, rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
def test_cuda_kernel_matches_the_semantics_for_one_layer(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper GPU with torch")
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    library = tmp_path / "libpersistent.so"
    subprocess.run(
        [
            str(nvcc),
            "-O3",
            "-std=c++17",
            "-gencode=arch=compute_90a,code=sm_90a",
            "-Xcompiler",
            "-fPIC",
            "-shared",
            "--cudart",
            "static",
            str(CSRC / "persistent_layer.cu"),
            "-o",
            str(library),
        ],
        check=True,
    )
    lib = ctypes.CDLL(str(library))
    lib.omnigraph_persistent_workspace_bytes.restype = ctypes.c_size_t
    lib.omnigraph_persistent_workspace_bytes.argtypes = [ctypes.c_int, ctypes.c_void_p]
    lib.omnigraph_persistent_launch.argtypes = (
        [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_float]
        + [ctypes.c_void_p] * 7
        + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    )
    rng = np.random.default_rng(4)
    d, f = D, F
    shapes = {"wo": (d, d), "wi": (2 * f, d), "wo_mlp": (d, f), "wqkv": (3 * d, d)}
    w = {
        k: bf16_round((rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32))
        for k, s in shapes.items()
    }
    n1, n2 = (
        (1 + 0.1 * rng.standard_normal(d)).astype(np.float32),
        (1 + 0.1 * rng.standard_normal(d)).astype(np.float32),
    )
    dev = {
        k: torch.from_numpy(pack_wi(v) if k == "wi" else pack_weight(v)).to(
            "cuda", torch.bfloat16
        )
        for k, v in w.items()
    }
    norms = [torch.from_numpy(n1).cuda(), torch.from_numpy(n2).cuda()]
    table = (ctypes.c_uint64 * 6)(
        *[dev[k].data_ptr() for k in shapes], *[t.data_ptr() for t in norms]
    )
    for m, plan in ((64, PLANS[0]), (176, PLANS[1]), (33, PLANS[2])):
        plan8 = (ctypes.c_int * 8)(*plan[0], *plan[1])
        ctx = bf16_round(rng.standard_normal((m, d)).astype(np.float32))
        h = rng.standard_normal((m, d)).astype(np.float32)
        ctx_d, h_d = (
            torch.from_numpy(ctx).to("cuda", torch.bfloat16),
            torch.from_numpy(h).cuda(),
        )
        out_d = torch.full((m, d), float("nan"), device="cuda")
        qkv_d = torch.full(
            (m, 3 * d), float("nan"), device="cuda", dtype=torch.bfloat16
        )
        ws = torch.zeros(
            lib.omnigraph_persistent_workspace_bytes(m, plan8),
            dtype=torch.uint8,
            device="cuda",
        )
        for _ in range(2):  # twice: the kernel must leave its counters and statistics reset
            err = lib.omnigraph_persistent_launch(
                m,
                1,
                plan8,
                1e-5,
                ctx_d.data_ptr(),
                h_d.data_ptr(),
                out_d.data_ptr(),
                qkv_d.data_ptr(),
                table,
                ws.data_ptr(),
                torch.cuda.current_stream().cuda_stream,
                0,
                None,
                0,
            )
            assert err == 0
            torch.cuda.synchronize()
            out_ref, qkv_ref = layer_tail(
                ctx, h, w["wo"], n1, w["wi"], w["wo_mlp"], n2, w["wqkv"]
            )
            out, qkv = out_d.cpu().numpy(), qkv_d.float().cpu().numpy()
            assert np.isfinite(out).all() and np.isfinite(qkv).all()
            assert np.linalg.norm(out - out_ref) / np.linalg.norm(out_ref) < 1e-3
            assert np.linalg.norm(qkv - qkv_ref) / np.linalg.norm(qkv_ref) < 1e-2
