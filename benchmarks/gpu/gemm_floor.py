"""What one Laya encoder's projections cost on the GPU when each is its own GEMM (issue 7).

The 28 layers of the full-size encoder make four projections each (Wqkv 1024 -> 3072, Wo 1024 ->
1024, Wi 1024 -> 5248, the MLP's Wo 2624 -> 1024): 112 BF16 GEMMs per forward, FP32 accumulate.
This script times them on the GPU, replayed as one CUDA graph with 28 distinct weights per
projection (so no weight stays in L2), for M = 64, 176 and 512 rows (batch-1 requests of those
lengths):

- `cublas x@W[K,N]`: cuBLAS through torch, the weight stored K x N (the fast bundle's MatMul);
- `cublas linear W[N,K]`: the same through `F.linear`, the weight N x K (K contiguous);
- `triton split-K` (`--triton`, rows <= 64 only: every row sits in one tile): a plain Triton kernel
  for these skinny shapes (the columns over the grid, optionally K split over CTAs with FP32
  atomics), the best of a small search of tile sizes and splits, per projection.

Each row gives the microseconds per GEMM of a projection (its 28 GEMMs replayed, divided by 28),
and `encoder` the 112 GEMMs together.

    python3 -m benchmarks.gpu.gemm_floor [--rows 64 176 512] [--triton] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path
from typing import Callable

from benchmarks import laya_gpu

LAYERS = 28
PROJECTIONS = (("Wqkv", 1024, 3072), ("Wo", 1024, 1024), ("Wi", 1024, 5248), ("mlp_Wo", 2624, 1024))


def graph_us(run: Callable[[], None], replays: int = 50) -> float:
    """Microseconds per replay of `run` captured as one CUDA graph."""
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1000.0


def cublas_rows(rows: int, layout: str) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    weights = {}
    for name, k, n in PROJECTIONS:
        stack = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        weights[name] = [w.t().contiguous() for w in stack] if layout == "x@W[K,N]" else stack
    inputs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for k in (1024, 2624)}

    def project(name: str, k: int) -> None:
        for w in weights[name]:
            inputs[k] @ w if layout == "x@W[K,N]" else F.linear(inputs[k], w)

    result = {name: graph_us(lambda name=name, k=k: project(name, k)) / LAYERS for name, k, _ in PROJECTIONS}
    result["encoder"] = graph_us(lambda: [project(name, k) for name, k, _ in PROJECTIONS])
    return result


def triton_rows(rows: int) -> dict[str, float]:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def skinny_gemm(x_ptr, w_ptr, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    SPLIT: tl.constexpr):
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rm, rn = tl.arange(0, BM), pid_n * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        per_split = K // SPLIT
        for k0 in range(pid_k * per_split, (pid_k + 1) * per_split, BK):
            rk = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=rm[:, None] < M, other=0.0)
            acc += tl.dot(x, tl.load(w_ptr + rk[:, None] * N + rn[None, :]))
        out = y_ptr + rm[:, None] * N + rn[None, :]
        if SPLIT == 1:
            tl.store(out, acc, mask=rm[:, None] < M)
        else:
            tl.atomic_add(out, acc, mask=rm[:, None] < M)

    block_m = triton.next_power_of_2(max(rows, 16))
    result = {}
    for name, k, n in PROJECTIONS:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        weights = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        reference = x.float() @ weights[0].float()
        y = torch.zeros(rows, n, device="cuda", dtype=torch.float32)
        best = float("inf")
        for block_n in (32, 64):
            for block_k in (32, 64, 128):
                for split in (1, 2, 4, 8):
                    if (k // split) % block_k or n % block_n:
                        continue

                    def one(w, block_n=block_n, block_k=block_k, split=split) -> None:
                        if split > 1:
                            y.zero_()
                        skinny_gemm[(n // block_n, split)](x, w, y, rows, n, k, BM=block_m, BN=block_n, BK=block_k,
                                                           SPLIT=split, num_warps=4, num_stages=4)

                    one(weights[0])
                    torch.cuda.synchronize()
                    if not torch.allclose(y, reference, atol=0.05, rtol=0.01):
                        raise AssertionError(f"triton {name} BN={block_n} BK={block_k} split={split} is wrong")
                    best = min(best, graph_us(lambda: [one(w) for w in weights], replays=20) / LAYERS)
        result[name] = best
    result["encoder"] = LAYERS * sum(result[name] for name, _, _ in PROJECTIONS)  # the best of each, summed
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 176, 512])
    parser.add_argument("--triton", action="store_true", help="also search a Triton skinny GEMM")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    identity = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": shlex.join(["python3", *sys.argv])}
    rows = []
    for m in args.rows:
        cases = {"cublas x@W[K,N]": cublas_rows(m, "x@W[K,N]"), "cublas linear W[N,K]": cublas_rows(m, "linear W[N,K]")}
        if args.triton and m <= 64:
            cases["triton split-K"] = triton_rows(m)
        for case, timings in cases.items():
            for gemm, value in timings.items():
                rows.append({"case": case, "rows": m, "metric": f"{gemm}_us" + ("" if gemm == "encoder" else "_per_gemm"),
                             "value": round(value, 2), "unit": "us", **identity})
    print(f"{'case':<22} {'rows':>4}  " + "  ".join(f"{name:>8}" for name, _, _ in PROJECTIONS) + "  encoder (112 GEMMs)")
    for case in dict.fromkeys(r["case"] for r in rows):
        for m in args.rows:
            got = {r["metric"]: r["value"] for r in rows if r["case"] == case and r["rows"] == m}
            if got:
                print(f"{case:<22} {m:>4}  " + "  ".join(f"{got[f'{name}_us_per_gemm']:>8.2f}" for name, _, _ in PROJECTIONS)
                      + f"  {got['encoder_us']:>10.1f} us")
    print(f"{identity['gpu']}, torch {identity['torch']}, {identity['date']}")
    if args.json:
        laya_gpu.write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
