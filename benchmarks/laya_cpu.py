"""Laya on the CPU (issue 4): omnigraph's pipeline end to end against laya's own predict path.

Both answer the same batch-1 requests on the same synthetic checkpoint (default `small`): one `noul`
question whose state is repeated until the row holds about 48 and 512 tokens (the actual counts are
reported). omnigraph runs `Omni(model="laya", bundle=...)` on its fp32 bundle (validation,
tokenization, admission, the graph worker, decoding); laya runs `agent.system_one(state, questions)`
(torch eager fp32). The two take turns in blocks of calls, so load from other processes on the
machine falls on both alike; rows give the median and p99 of each and the ratio of the medians, and the
answers of the two are compared after rounding.

    python benchmarks/laya_cpu.py --json benchmarks/results/laya-cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

# Run as a script, this folder is sys.path[0], where benchmarks/http.py shadows the standard
# library's `http` (which torch and httpx import).
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]

TARGET_SPEEDUP = 2.0


def _harness() -> Any:
    """benchmarks/laya_gpu.py, whose request builder and statistics this script shares."""
    spec = importlib.util.spec_from_file_location("laya_gpu", Path(__file__).with_name("laya_gpu.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["laya_gpu"] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def time_in_blocks(calls: dict[str, Callable[[], Any]], requests: int, warmup: int,
                   rounds: int = 4) -> dict[str, list[float]]:
    """Seconds per call of each entry, timed in blocks that take turns over `rounds` rounds.

    Blocks rather than call-by-call turns: each engine's thread pools spin for a moment after a
    call (ONNX Runtime's and torch's both do), which would be charged to the other engine's next
    call. Taking turns by block still spreads the machine's other load over both.
    """
    samples: dict[str, list[float]] = {name: [] for name in calls}
    per_round = max(1, requests // rounds)
    for _ in range(rounds):
        for name, call in calls.items():
            for index in range(warmup + per_round):
                started = time.perf_counter()
                call()
                if index >= warmup:
                    samples[name].append(time.perf_counter() - started)
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", help="synthetic checkpoint size (tiny, small, full)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lengths", nargs="+", type=int, default=[48, 512], help="nominal row lengths")
    parser.add_argument("--requests", type=int, default=40, help="timed requests per engine and length")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before each block")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import laya

    from omnigraph import Omni
    from omnigraph.pipelines.laya.export import cached_bundle
    from omnigraph.pipelines.laya.synth import cached_checkpoint

    harness = _harness()
    checkpoint = cached_checkpoint(args.size, seed=args.seed)
    bundle = cached_bundle(checkpoint)
    lengths = harness.build_requests(checkpoint, tuple(args.lengths))
    agent = laya.load(str(checkpoint), device="cpu")
    identity = {
        "cpu": harness._device_name("cpu"), "cores": os.cpu_count(), "checkpoint": f"synthetic {args.size} seed {args.seed}",
        "versions": harness._versions(), "load_average": os.getloadavg()[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["benchmarks/laya_cpu.py", *(argv if argv is not None else sys.argv[1:])]),
        "python": platform.python_version(),
    }
    rows: list[dict[str, Any]] = []
    with Omni(model="laya", bundle=bundle) as omni:
        for requests in lengths:
            state, questions = requests.timed["state"], requests.timed["questions"]
            request = requests.timed

            def omnigraph_call() -> dict:
                output = omni.generate([request])[0]
                if output.error is not None:
                    raise RuntimeError(output.error)
                return output.custom_output

            samples = time_in_blocks({"laya": lambda: agent.system_one(state, questions),
                                      "omnigraph": omnigraph_call}, args.requests, args.warmup)
            reference, ours = agent.system_one(state, questions), omnigraph_call()
            same = reference["answers"] == ours["answers"]
            medians = {}
            for engine, values in samples.items():
                medians[engine] = harness.percentile(values, 50) * 1000
                for metric, value in (("p50_ms", medians[engine]), ("p99_ms", harness.percentile(values, 99) * 1000)):
                    rows.append({"case": engine, "metric": metric, "value": round(value, 3), "unit": "ms",
                                 "length": requests.length, "tokens": requests.tokens,
                                 "requests": len(values), **identity})
            rows.append({"case": "omnigraph vs laya", "metric": "speedup_p50", "unit": "x",
                         "value": round(medians["laya"] / medians["omnigraph"], 3), "goal": TARGET_SPEEDUP,
                         "status": "met" if medians["laya"] / medians["omnigraph"] >= TARGET_SPEEDUP else "missed",
                         "answers_equal": same, "length": requests.length, "tokens": requests.tokens, **identity})

    print(f"{'case':<20} {'metric':<12} {'tokens':>6} {'value':>10}  unit  status")
    for row in rows:
        print(f"{row['case']:<20} {row['metric']:<12} {row['tokens']:>6} {row['value']:>10}  {row['unit']:<4}  "
              f"{row.get('status', '')}{'' if row.get('answers_equal', True) else '  ANSWERS DIFFER'}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
