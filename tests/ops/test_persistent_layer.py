"""The persistent layer kernel's contract (omnigraph/workers/ops/persistent.py, csrc/persistent_layer.cu).

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

from omnigraph.workers.ops import reference
from omnigraph.workers.ops.build import find_nvcc
from omnigraph.workers.ops.persistent import (
    bf16_round,
    fragment_product,
    layer_tail,
    pack_weight,
    unpack_weight,
)

CSRC = Path(__file__).resolve().parents[2] / "omnigraph" / "workers" / "ops" / "csrc"


def test_pack_weight_round_trips_and_keeps_chunks_contiguous():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((128, 96)).astype(np.float32)
    packed = pack_weight(w)
    assert packed.shape == (128 * 96,)
    np.testing.assert_array_equal(unpack_weight(packed, 128, 96), w)
    # tile 1, k block 2: one contiguous 64 x 32 run, lane (g, t) of n8-tile nt holding W[nt*8+g, 64+t*8 : +8]
    block = packed[(1 * 3 + 2) * 2048 : (1 * 3 + 3) * 2048].reshape(8, 32, 8)
    for nt in (0, 7):
        for lane in (0, 5, 31):
            g, t = divmod(lane, 4)
            np.testing.assert_array_equal(
                block[nt, lane], w[64 + nt * 8 + g, 64 + t * 8 : 64 + t * 8 + 8]
            )
    with pytest.raises(ValueError):
        pack_weight(np.zeros((100, 64), np.float32))


def test_fragment_mapping_reproduces_the_matrix_product():
    rng = np.random.default_rng(2)
    for m, n, k in ((16, 64, 32), (32, 128, 64)):
        a = rng.standard_normal((m, k))
        w = rng.standard_normal((n, k))
        np.testing.assert_allclose(
            fragment_product(a, pack_weight(w), n, k), a @ w.T, rtol=1e-12, atol=1e-12
        )


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
    lib.omnigraph_persistent_workspace_bytes.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.omnigraph_persistent_launch.argtypes = (
        [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float]
        + [ctypes.c_void_p] * 7
        + [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    )
    rng = np.random.default_rng(4)
    d, f = 1024, 2624
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
        k: torch.from_numpy(pack_weight(v)).to("cuda", torch.bfloat16)
        for k, v in w.items()
    }
    norms = [torch.from_numpy(n1).cuda(), torch.from_numpy(n2).cuda()]
    table = (ctypes.c_uint64 * 6)(
        *[dev[k].data_ptr() for k in shapes], *[t.data_ptr() for t in norms]
    )
    for m, kc in ((64, 0), (176, 512)):
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
            lib.omnigraph_persistent_workspace_bytes(m, kc),
            dtype=torch.uint8,
            device="cuda",
        )
        for _ in range(2):  # twice: the kernel must leave its counters reset
            err = lib.omnigraph_persistent_launch(
                m,
                1,
                kc,
                1e-5,
                ctx_d.data_ptr(),
                h_d.data_ptr(),
                out_d.data_ptr(),
                qkv_d.data_ptr(),
                table,
                ws.data_ptr(),
                torch.cuda.current_stream().cuda_stream,
                0,
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
