"""Where the time of one Laya decision goes on the GPU: per-kernel timings and the end-to-end split.

Issue 7 asks, where a target is missed, for the time broken down. For one bundle (default: the
`fast` one) at each length this prints and writes:
  kernels  ORT's own profile of the session (in this process, CUDA EP, the op library registered):
           microseconds per forward by operator type and provider, and the nodes left on the CPU;
  split    `AsyncOmni` end to end against its parts: the processor's prepare and finish, and the
           stage time the orchestrator records (worker call including the wire), the rest being
           the async front's hand-offs.

    python3 -m benchmarks.gpu.profile_laya --checkpoint CKPT --bundle BUNDLE --json $OUT/profile.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import laya_gpu as harness



def kernel_profile(bundle: Path, lengths: list, runs: int) -> list[dict]:
    """Per-forward microseconds by (op type, provider) from ORT's profile, per length."""
    import onnxruntime as ort

    from omnigraph.bundles import verify_bundle
    from omnigraph.pipelines.laya.processor import LayaProcessor
    from omnigraph.workers.ops.loader import custom_ops_library

    verified = verify_bundle(bundle)
    processor = LayaProcessor({0: verified})
    rows = []
    for requests in lengths:
        options = ort.SessionOptions()
        library = custom_ops_library(verified)
        if library is not None:
            options.register_custom_ops_library(str(library))
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "profile")
        session = ort.InferenceSession(str(verified.graph_path), options,
                                       providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        (work,) = processor.prepare(requests.timed).calls
        for _ in range(5):
            session.run(None, work)
        started = time.perf_counter()
        for _ in range(runs):
            session.run(None, work)
        wall_us = (time.perf_counter() - started) / runs * 1e6
        events = json.loads(Path(session.end_profiling()).read_text())
        by_kind: dict[tuple[str, str], float] = collections.defaultdict(float)
        cpu_nodes: dict[str, str] = {}
        for event in events:
            if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
                continue
            args = event.get("args", {})
            provider = args.get("provider", "?")
            by_kind[(args.get("op_name", "?"), provider)] += event["dur"]
            if provider == "CPUExecutionProvider":
                cpu_nodes[event["name"].removesuffix("_kernel_time")] = args.get("op_name", "?")
        calls = runs + 5
        for (op, provider), total in sorted(by_kind.items(), key=lambda item: -item[1]):
            rows.append({"case": "kernels", "metric": "us_per_forward", "value": round(total / calls, 2),
                         "unit": "us", "op": op, "provider": provider, "length": requests.length,
                         "tokens": requests.tokens})
        rows.append({"case": "kernels", "metric": "session_run_wall_us", "value": round(wall_us, 1), "unit": "us",
                     "length": requests.length, "tokens": requests.tokens, "detail": "plain run, profiling on"})
        rows.append({"case": "kernels", "metric": "cpu_nodes", "value": len(cpu_nodes), "unit": "count",
                     "length": requests.length, "nodes": cpu_nodes})
    return rows


def e2e_split(harness: Any, plan: Any, lengths: list, requests_per_length: int) -> list[dict]:
    """AsyncOmni end to end, and its parts, per length (medians in microseconds)."""
    from omnigraph.plugin.omni import AsyncOmni

    omni = AsyncOmni(model="laya", deploy_config=plan)
    rows = []
    try:
        async def measure() -> None:
            for requests in lengths:
                totals, stages = [], []
                for index in range(requests_per_length + 10):
                    started = time.perf_counter()
                    generator = omni.generate(requests.timed)
                    output = await generator.__anext__()
                    await generator.aclose()
                    if index >= 10:
                        totals.append(time.perf_counter() - started)
                        stages.append(sum(output.stage_durations.values()))
                row = {"length": requests.length, "tokens": requests.tokens, "requests": len(totals)}
                rows.append({"case": "e2e", "metric": "total_p50_us", "value": round(statistics.median(totals) * 1e6, 1),
                             "unit": "us", **row})
                rows.append({"case": "e2e", "metric": "stage_p50_us", "value": round(statistics.median(stages) * 1e6, 1),
                             "unit": "us", "detail": "the orchestrator's stage duration (worker call with the wire)", **row})

        asyncio.run(measure())
    finally:
        omni.shutdown()
    from omnigraph.bundles import verify_bundle
    from omnigraph.pipelines.laya.processor import LayaProcessor

    processor = LayaProcessor({0: verify_bundle(plan.stages[0].backend.manifest)})
    import numpy as np

    for requests in lengths:
        prepares, finishes = [], []
        for _ in range(requests_per_length):
            started = time.perf_counter()
            prepared = processor.prepare(requests.timed)
            prepares.append(time.perf_counter() - started)
            outputs = [{"logits": np.zeros(w["marker_pos"].shape, np.float32),
                        "act_logits": np.zeros((w["marker_pos"].shape[0], 2), np.float32)} for w in prepared.calls]
            started = time.perf_counter()
            processor.finish(prepared, outputs)
            finishes.append(time.perf_counter() - started)
        for metric, values in (("prepare_p50_us", prepares), ("finish_p50_us", finishes)):
            rows.append({"case": "e2e", "metric": metric, "value": round(statistics.median(values) * 1e6, 1),
                         "unit": "us", "length": requests.length, "tokens": requests.tokens})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--case", default="ort-fast-graph", help="the laya_gpu.py case whose route to use")
    parser.add_argument("--lengths", nargs="+", type=int, default=[64, 176, 512])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    import torch  # noqa: F401  (loads the CUDA libraries onnxruntime-gpu needs, before it)

    lengths = harness.build_requests(args.checkpoint, tuple(args.lengths))
    run_args = argparse.Namespace(device="cuda", strict_placement=False)
    plan = harness.ort_plan(argparse.Namespace(args=run_args), args.case, args.bundle)
    rows: list[dict] = []
    for section in (lambda: kernel_profile(args.bundle, lengths, args.runs),
                    lambda: e2e_split(harness, plan, lengths, args.runs)):
        try:
            rows += section()
        except Exception as error:  # one section failing leaves the other's rows
            rows.append({"case": "error", "metric": "exception", "value": f"{type(error).__name__}: {error}",
                         "unit": ""})
        if args.json is not None:
            harness.write_json(args.json, rows)
    for row in rows:
        if row["case"] == "kernels" and row["metric"] == "us_per_forward" and row["value"] < 5:
            continue
        extra = {k: row[k] for k in ("op", "provider") if k in row}
        print(row["case"], row["metric"], row.get("length", ""), row["value"], row["unit"], extra or "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
