"""Where a Laya forward's GPU time goes: every CUDA kernel of a bundle's ORT session, timed on the GPU.

ONNX Runtime's own profile times kernel launches on the host; this script runs the bundle's
session in process (the worker's `load_session`, a CUDA route without CUDA graphs so that every
kernel is its own launch) under `torch.profiler`, whose CUPTI tracing records the GPU time of every
kernel the process launches, ORT's and the omnigraph op library's included. Per bundle and length
(the batch-1 noul requests of benchmarks/laya_gpu.py): the wall time of a forward (IOBinding, host
outputs), the summed kernel time per forward (the GPU's busy time), and the kernels ranked by time.

    python3 -m benchmarks.gpu.kernel_profile --checkpoint CK --bundle fast=DIR [--bundle bf16=DIR ...]
        [--lengths 64 176 512] [--runs 30] [--rows 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

from benchmarks import laya_gpu

# Kernel name fragments -> the operator family they belong to (first match wins).
FAMILIES = (
    ("attention", ("Attention", "attention", "Attn", "attn", "Fmha", "fmha")),
    ("geglu / gelu", ("Geglu", "geglu", "Gelu", "gelu")),
    ("layernorm", ("LayerNorm", "layernorm", "layer_norm")),
    ("gemm", ("gemm", "Gemm", "cutlass", "xmma", "sm90", "nvjet", "cublas", "splitK")),
    ("softmax", ("softmax", "Softmax")),
    ("copy / cast / transpose", ("Cast", "cast", "Copy", "copy", "memcpy", "Memcpy", "Transpose", "transpose")),
)


def family(name: str) -> str:
    for label, fragments in FAMILIES:
        if any(fragment in name for fragment in fragments):
            return label
    return "other elementwise / gather"


def profile_bundle(name: str, bundle: Path, checkpoint: Path, lengths: list[int], runs: int, batch_rows: int) -> list[dict]:
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    from omnigraph.bundles import verify_bundle
    from omnigraph.pipelines.laya.processor import LayaProcessor
    from omnigraph.workers.route import WorkerRoute
    from omnigraph.workers.session import describe, load_session

    route = WorkerRoute(name=f"profile-{name}", interpreter=sys.executable, ep="cuda",
                        allowed_providers=("CUDAExecutionProvider", "CPUExecutionProvider"), min_fraction_on_target=0.0)
    session, report = load_session(str(Path(bundle) / "manifest.json"), route)
    processor = LayaProcessor({0: verify_bundle(bundle)})
    rows = []
    for requests in laya_gpu.build_requests(checkpoint, tuple(lengths)):
        (work,) = processor.prepare(requests.timed).calls
        work = {key: np.repeat(value, batch_rows, axis=0) for key, value in work.items()}  # the row, repeated
        described = describe(work)
        for _ in range(5):
            session.run(work, described)
        walls = []
        # (on a machine without CUDA the CPU activity keeps the script runnable: no kernel rows)
        activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
        with profile(activities=[activity]) as prof:
            for _ in range(runs):
                started = time.perf_counter()
                session.run(work, described)
                walls.append((time.perf_counter() - started) * 1e3)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        kernels: dict[str, list[float]] = {}
        for event in prof.events():
            if "CUDA" in str(event.device_type):  # a kernel (or a copy) on the GPU: its own time range
                kernels.setdefault(event.name, []).append(float(event.time_range.elapsed_us()))
        case = f"{name} L{requests.length}" + (f" x{batch_rows} rows" if batch_rows > 1 else "")
        per_forward = {kernel: sum(times) / runs for kernel, times in kernels.items()}
        busy_us = sum(per_forward.values())
        families: dict[str, float] = {}
        for kernel, us in per_forward.items():
            families[family(kernel)] = families.get(family(kernel), 0.0) + us
        base = {"bundle": name, "length": requests.length, "tokens": requests.tokens, "rows": batch_rows, "runs": runs,
                "placement": dict(report.placement.nodes_by_provider)}
        rows.append({**base, "case": case, "metric": "wall_p50_ms",
                     "value": round(statistics.median(walls), 4), "unit": "ms"})
        rows.append({**base, "case": case, "metric": "gpu_busy_ms",
                     "value": round(busy_us / 1e3, 4), "unit": "ms", "kernels_per_forward":
                     round(sum(len(t) for t in kernels.values()) / runs, 1)})
        for label, us in sorted(families.items(), key=lambda item: -item[1]):
            rows.append({**base, "case": case, "metric": f"family {label}",
                         "value": round(us, 1), "unit": "us"})
        for kernel, us in sorted(per_forward.items(), key=lambda item: -item[1])[:12]:
            rows.append({**base, "case": case, "metric": "kernel", "kernel": kernel[:160],
                         "calls_per_forward": round(len(kernels[kernel]) / runs, 1), "value": round(us, 1), "unit": "us"})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--bundle", action="append", required=True, help="NAME=DIR (repeatable)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 176, 512])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--rows", type=int, default=1, help="rows per forward (the request's row repeated)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    import torch

    identity = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                "python": platform.python_version(), "torch": torch.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": shlex.join([sys.executable, *sys.argv])}
    rows = []
    for spec in args.bundle:
        name, _, path = spec.partition("=")
        try:
            rows += profile_bundle(name, Path(path), args.checkpoint, args.lengths, args.runs, args.rows)
        except Exception as error:  # one bundle failing leaves the others to run
            rows.append({"case": name, "metric": "status", "value": "error", "unit": "",
                         "detail": f"{type(error).__name__}: {error}"})
        if args.json:
            laya_gpu.write_json(args.json, [{**row, **identity} for row in rows])
    for row in rows:
        extra = f"  x{row['calls_per_forward']}  {row['kernel']}" if row.get("kernel") else ""
        print(f"{row['case']:<24} {row['metric']:<32} {row['value']!s:>10} {row['unit']}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
