"""Decision throughput under concurrent load (issue 9): omnigraph with batching off and on.

Closed-loop clients (each sends its next request when its last one answered) drive `AsyncOmni` at
each `--concurrency` (default 1, 8, 32, 64) for `--seconds`, after `--warmup-s` of the same load.
Every request is the same one-question `noul` decision whose row holds about `--tokens` (108)
tokens. One decision per request, so decisions per second = answered requests per second. Rows per
case and concurrency: decisions_per_s, p50_ms and p99_ms (nearest rank), requests, and
cpu_us_per_decision (this process's CPU time over every thread per decision: for omnigraph the
whole host path, prepare -> admission -> batch -> finish -> response; the worker runs in its own
process).

Cases:
  omnigraph batching off   one deploy plan (`--replicas` worker replicas, default 1),
                           `batching: {max_batch_rows: 1}` (every request alone).
  omnigraph batching on    the same plan, `batching: {max_batch_rows: --max-batch-rows}` (and
                           `batch_wait_us: --batch-wait-us` when given; else the stage default).
                           `--intra-op-threads N` sets both plans' worker route to N ORT threads.
  laya-cuda BatchEngine    `laya_cuda.batching.BatchEngine(DIR, max_batch_size=--max-batch-rows)`
                           (tokens per batch to match), futures awaited by the same clients.
  laya predict_batch       the reference's `agent.predict_batch([state] * 64, questions)`, one call
                           at a time (under its bf16 autocast on CUDA): decisions/s = 64 / call time.
  host prepare / finish    `LayaProcessor.prepare` and `finish` alone, per request, for rows of
                           --tokens and of 512 tokens (the host's share of each decision).
A case that cannot run here (laya-cuda without CUDA, a missing package) is recorded as skipped with
the reason. Answers are compared: batching on must equal batching off exactly; the others report
their largest probability drift from omnigraph's.

Devices:
  --device cpu    (default) the `small` synthetic checkpoint, its fp32 bundle, a CPU route.
  --device cuda   the `full` synthetic checkpoint, the `fast` bundle (`bundle build laya --fast`,
                  or `--bundle fast=PATH`), a CUDA route with CUDA graphs, as benchmarks/laya_gpu.py
                  sets them up (benchmarks/gpu/throughput_run.sh prepares the H200 machine).
Targets (rows with case "target"): on CPU, batching on at c=32 gives >= 2x the decisions/s of
batching off with p99 <= 3x its own c=1 p99; on CUDA, >= 3,500 decisions/s at c=64, beside
laya-cuda's BatchEngine (the issue measured 1,226/s) and laya's predict_batch of 64 (1,327/s).

    python benchmarks/throughput.py --json benchmarks/results/throughput-cpu.json
    python benchmarks/throughput.py --device cuda --bundle fast=DIR --json $OUT/throughput.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Awaitable, Callable

try:
    from benchmarks import laya_gpu as harness
except ImportError:  # run as a script: this folder is sys.path[0]
    import laya_gpu as harness

CONCURRENCY = (1, 8, 32, 64)
PREDICT_BATCH = 64
HOST_COST_TOKENS = 512  # the length at which the issue measured prepare on the H200 host
# Issue 9's targets and the bars it measured on the H200.
TARGET_CPU_SPEEDUP_AT_32 = 2.0
TARGET_CPU_P99_OVER_C1 = 3.0
TARGET_GPU_DECISIONS_PER_S_AT_64 = 3500.0
BAR_LAYA_CUDA_BATCH_ENGINE = 1226.0
BAR_LAYA_PREDICT_BATCH_64 = 1327.0
OFF, ON = "omnigraph batching off", "omnigraph batching on"
LAYA_CUDA, LAYA_BATCH = "laya-cuda BatchEngine", "laya predict_batch"
# host first: in a process where torch has run (laya) its idle thread pools slow the processor down.
CASES = ("host", "omnigraph", "laya-cuda", "laya")





@dataclass(frozen=True)
class Load:
    """What the closed-loop clients measured at one concurrency."""

    concurrency: int
    latencies: list[float]   # seconds per answered request
    seconds: float           # wall time of the measured phase
    cpu_seconds: float       # this process's CPU time (all threads) over the measured phase
    decisions_per_request: int = 1

    def rows(self) -> list[tuple[str, float, str]]:
        decisions = len(self.latencies) * self.decisions_per_request
        return [("decisions_per_s", round(decisions / self.seconds, 1), "1/s"),
                ("p50_ms", round(1000 * harness.percentile(self.latencies, 50), 3), "ms"),
                ("p99_ms", round(1000 * harness.percentile(self.latencies, 99), 3), "ms"),
                ("requests", len(self.latencies), "count"),
                ("cpu_us_per_decision", round(1e6 * self.cpu_seconds / decisions, 1), "us")]


async def closed_loop(call: Callable[[], Awaitable[Any]], concurrency: int, seconds: float,
                      warmup_s: float) -> Load:
    """`concurrency` clients calling `call` back to back: `warmup_s` untimed, then `seconds` timed."""
    async def phase(duration: float, latencies: list[float] | None) -> None:
        stop_at = time.perf_counter() + duration

        async def client() -> None:
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                await call()
                if latencies is not None:
                    latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(client() for _ in range(concurrency)))

    await phase(warmup_s, None)
    latencies: list[float] = []
    began, cpu = time.perf_counter(), time.process_time()
    await phase(seconds, latencies)
    return Load(concurrency, latencies, time.perf_counter() - began, time.process_time() - cpu)


class Run:
    """The rows of one run and the JSON rewritten after each case (a cut-short run keeps them)."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        self.args = args
        self.rows: list[dict[str, Any]] = []
        self.answers: dict[str, dict] = {}  # case -> its response to the timed request
        self.identity = {
            "device": args.device,
            "cpu": harness._device_name("cpu"),
            "cores": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0],  # other work on the machine when the run began
            "checkpoint": str(args.checkpoint) if args.checkpoint else f"synthetic {args.size} seed {args.seed}",
            "versions": harness._versions(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join(["benchmarks/throughput.py", *argv]),
        }
        if args.device == "cuda":
            self.identity["gpu"] = harness._device_name("cuda")

    def add(self, case: str, metric: str, value: Any, unit: str, **fields: Any) -> None:
        self.rows.append({"case": case, "metric": metric, "value": value, "unit": unit, **fields, **self.identity})

    def add_load(self, case: str, load: Load, **fields: Any) -> None:
        for metric, value, unit in load.rows():
            self.add(case, metric, value, unit, concurrency=load.concurrency, **fields)
        self.write()

    def write(self) -> None:
        if self.args.json is not None:
            harness.write_json(self.args.json, self.rows + targets(self.rows, self.args.device))


# ----------------------------------------------------------------------------------------------
# Cases


def omnigraph_plan(args: argparse.Namespace, bundle: Path, max_batch_rows: int) -> Any:
    """laya_gpu.py's one-stage plan for the device (CUDA graphs on CUDA), with this batching and
    `--replicas` worker replicas."""
    from omnigraph.pipelines.deploy import validate_deploy_config

    case = "ort-fast-graph" if args.device == "cuda" else "ort-fp32"
    plan = harness.ort_plan(SimpleNamespace(args=args), case, bundle).model_dump(exclude_defaults=True)
    plan["max_queued_requests"] = max(args.concurrency)
    batching = {"max_batch_rows": max_batch_rows}
    if max_batch_rows > 1 and args.batch_wait_us is not None:
        batching["batch_wait_us"] = args.batch_wait_us
    plan["stages"][0]["batching"] = batching
    plan["stages"][0]["num_replicas"] = args.replicas
    if args.intra_op_threads is not None:
        plan["stages"][0]["backend"]["route"]["intra_op_num_threads"] = args.intra_op_threads
    return validate_deploy_config(plan)


def case_omnigraph(run: Run, bundle: Path, request: dict) -> None:
    """AsyncOmni on the same plan with batching off, then on; every concurrency of each."""
    from omnigraph.plugin.omni import AsyncOmni

    args = run.args
    for case, rows in ((OFF, 1), (ON, args.max_batch_rows)):
        plan = omnigraph_plan(args, bundle, rows)
        started = time.perf_counter()
        omni = AsyncOmni(model="laya", deploy_config=plan, startup_timeout=args.startup_timeout)
        run.add(case, "load_s", round(time.perf_counter() - started, 3), "s",
                batching=plan.stages[0].batching.model_dump(), replicas=args.replicas)
        try:
            async def answer() -> dict:
                # Run the generator to its end: that acknowledges the request, freeing its
                # admission slot before the client sends its next one.
                outputs = [output async for output in omni.generate(request)]
                return outputs[-1].custom_output

            async def measure() -> None:
                run.answers[case] = await answer()
                for concurrency in args.concurrency:
                    run.add_load(case, await closed_loop(answer, concurrency, args.seconds, args.warmup_s))

            asyncio.run(measure())
        finally:
            omni.shutdown()


def case_laya_cuda(run: Run, checkpoint: Path, request: dict, tokens: int) -> None:
    """laya-cuda's own cross-request batching engine, driven by the same closed-loop clients."""
    if run.args.device != "cuda":
        raise harness.CaseSkipped("laya-cuda needs CUDA (--device cuda)")
    try:
        from laya_cuda.batching import BatchEngine
    except ImportError as error:
        raise harness.CaseSkipped(f"laya-cuda is not installed ({error})") from error

    # Its batches are bounded by rows and by packed tokens (rows start at multiples of 16): room
    # for --max-batch-rows rows of this request, so its limit is the same as omnigraph's.
    max_batch_tokens = run.args.max_batch_rows * -(-tokens // 16) * 16
    started = time.perf_counter()
    engine = BatchEngine(str(checkpoint), max_batch_size=run.args.max_batch_rows,
                         max_batch_tokens=max_batch_tokens, max_pending=2 * max(run.args.concurrency))
    run.add(LAYA_CUDA, "load_s", round(time.perf_counter() - started, 3), "s",
            max_batch_size=run.args.max_batch_rows, max_batch_tokens=max_batch_tokens)
    try:
        async def answer() -> dict:
            return await asyncio.wrap_future(engine.submit(request["state"], request["questions"]))

        async def measure() -> None:
            run.answers[LAYA_CUDA] = await answer()
            for concurrency in run.args.concurrency:
                run.add_load(LAYA_CUDA, await closed_loop(answer, concurrency, run.args.seconds, run.args.warmup_s))

        asyncio.run(measure())
    finally:
        engine.close()


def case_laya_predict_batch(run: Run, checkpoint: Path, request: dict) -> None:
    """The reference's batch path: 64 states, one question, one call at a time."""
    if run.args.device == "cuda":
        os.environ["LAYA_CUDA_AMP"] = "bf16"  # its own CUDA default, as benchmarks/laya_gpu.py times it
    try:
        import laya
    except ImportError as error:
        raise harness.CaseSkipped(f"laya is not installed ({error})") from error

    started = time.perf_counter()
    agent = laya.load(str(checkpoint), device=run.args.device)
    run.add(LAYA_BATCH, "load_s", round(time.perf_counter() - started, 3), "s")
    try:
        states = [request["state"]] * PREDICT_BATCH

        async def answer() -> list[dict]:
            return agent.predict_batch(states, request["questions"], batch_size=PREDICT_BATCH)

        async def measure() -> None:
            run.answers[LAYA_BATCH] = (await answer())[0]
            load = await closed_loop(answer, 1, run.args.seconds, run.args.warmup_s)
            run.add_load(LAYA_BATCH, Load(PREDICT_BATCH, load.latencies, load.seconds, load.cpu_seconds,
                                          decisions_per_request=PREDICT_BATCH),
                         detail=f"one predict_batch call of {PREDICT_BATCH} states at a time; "
                                f"latency is the call's")

        asyncio.run(measure())
    finally:
        del agent
        gc.collect()


def case_host(run: Run, bundle: Path, lengths: list[Any]) -> None:
    """The processor alone: prepare and finish per request, no worker (the host's share)."""
    import numpy as np

    from omnigraph.bundles import verify_bundle
    from omnigraph.pipelines.laya.processor import LayaProcessor

    processor = LayaProcessor({0: verify_bundle(bundle)})
    calls = max(200, run.args.host_calls)
    for requests in lengths:
        prepared = processor.prepare(requests.timed)
        # finish does the same work whatever the logits hold; these are shaped as the graph's.
        outputs = [{"logits": np.zeros(work["marker_pos"].shape, np.float32),
                    "act_logits": np.zeros((work["marker_pos"].shape[0], 2), np.float32)}
                   for work in prepared.calls]
        for name, call in (("host prepare", lambda: processor.prepare(requests.timed)),
                           ("host finish", lambda: processor.finish(prepared, outputs))):
            samples = harness.time_calls(call, calls, warmup=calls // 10)
            for metric, q in (("p50_us", 50), ("p99_us", 99)):
                run.add(name, metric, round(1e6 * harness.percentile(samples, q), 1), "us",
                        length=requests.length, tokens=requests.tokens, requests=len(samples))
    run.write()


# ----------------------------------------------------------------------------------------------
# Answers and targets


def check_answers(run: Run) -> None:
    """Batching must not change an answer; the other engines report their drift from omnigraph's."""
    reference = run.answers.get(OFF)
    if reference is None:
        return
    if ON in run.answers:
        same = run.answers[ON]["answers"] == reference["answers"]
        run.add(f"{ON} vs off", "equal_answers", int(same), "bool")
    for case in (LAYA_CUDA, LAYA_BATCH):
        if case in run.answers:
            drift = harness.compare_answers([reference], [run.answers[case]])["max_prob_drift"]
            run.add(f"{case} vs {OFF}", "max_prob_drift", round(drift, 6), "probability")
    run.write()


def _value(rows: list[dict], case: str, metric: str, concurrency: int) -> float | None:
    return next((row["value"] for row in rows if row["case"] == case and row["metric"] == metric
                 and row.get("concurrency") == concurrency), None)


def targets(rows: list[dict], device: str) -> list[dict]:
    """Issue 9's targets for the device: measured value, goal, met / missed / not measured."""
    out = []

    def add(name: str, value: float | None, goal: float, unit: str, lower_is_better: bool, detail: str) -> None:
        met = value is not None and (value <= goal if lower_is_better else value >= goal)
        out.append({"case": "target", "metric": name, "value": None if value is None else round(value, 3),
                    "unit": unit, "goal": goal, "status": "not measured" if value is None else
                    ("met" if met else "missed"), "device": device, "detail": detail})

    on64 = _value(rows, ON, "decisions_per_s", 64)
    if device == "cpu":
        on32, off32 = _value(rows, ON, "decisions_per_s", 32), _value(rows, OFF, "decisions_per_s", 32)
        add(f"batching on / off decisions/s at c=32 >= {TARGET_CPU_SPEEDUP_AT_32}x",
            None if on32 is None or off32 is None else on32 / off32, TARGET_CPU_SPEEDUP_AT_32, "x",
            lower_is_better=False, detail=f"on {on32}/s, off {off32}/s")
        p99_32, p99_1 = _value(rows, ON, "p99_ms", 32), _value(rows, ON, "p99_ms", 1)
        add(f"batching on p99 c=32 / p99 c=1 <= {TARGET_CPU_P99_OVER_C1}x",
            None if p99_32 is None or p99_1 is None else p99_32 / p99_1, TARGET_CPU_P99_OVER_C1, "x",
            lower_is_better=True, detail=f"p99 {p99_32} ms at c=32, {p99_1} ms at c=1")
        return out
    add(f"batching on decisions/s at c=64 >= {TARGET_GPU_DECISIONS_PER_S_AT_64:g}", on64,
        TARGET_GPU_DECISIONS_PER_S_AT_64, "1/s", lower_is_better=False, detail="AsyncOmni, fast bundle, CUDA graphs")
    for case, stated, metric_concurrency in ((LAYA_CUDA, BAR_LAYA_CUDA_BATCH_ENGINE, 64),
                                             (LAYA_BATCH, BAR_LAYA_PREDICT_BATCH_64, PREDICT_BATCH)):
        measured = _value(rows, case, "decisions_per_s", metric_concurrency)
        source = "measured in this run" if measured is not None else "the issue's stated bar"
        baseline = measured if measured is not None else stated
        add(f"batching on at c=64 / {case} decisions/s > 1x", None if on64 is None else on64 / baseline, 1.0, "x",
            lower_is_better=False, detail=f"baseline {baseline}/s, {source}")
    return out


def report_lines(rows: list[dict]) -> list[str]:
    """The table: one line per case and concurrency, then statuses, answer checks and targets."""
    first = rows[0]
    lines = [f"{first.get('gpu') or first['cpu']} ({first['cores']} cores) | {first['checkpoint']} | {first['date']}"]
    header = f"{'case':<26} {'c':>3} {'decisions/s':>12} {'p50 ms':>9} {'p99 ms':>9} {'cpu us/dec':>11}"
    lines.append(header)
    points = dict.fromkeys((row["case"], row["concurrency"]) for row in rows if row["metric"] == "decisions_per_s")
    for case, concurrency in points:
        values = [_value(rows, case, metric, concurrency)
                  for metric in ("decisions_per_s", "p50_ms", "p99_ms", "cpu_us_per_decision")]
        lines.append(f"{case:<26} {concurrency:>3} {values[0]:>12} {values[1]:>9} {values[2]:>9} {values[3]:>11}")
    for row in rows:
        if row["metric"] == "p50_us":
            p99 = next(r["value"] for r in rows if r["case"] == row["case"] and r["metric"] == "p99_us"
                       and r["length"] == row["length"])
            lines.append(f"{row['case']:<14} {row['tokens']:>4} tokens: p50 {row['value']} us, p99 {p99} us per request")
        elif row["metric"] in ("status", "equal_answers", "max_prob_drift") and row["value"] != "ok":
            lines.append(f"{row['case']}: {row['metric']} {row['value']} {row.get('detail', '')}".rstrip())
        elif row["case"] == "target":
            lines.append(f"{row['status']:>12}  {row['metric']:<58} {row['value']!s:>9} {row['unit']:<4} ({row['detail']})")
    return lines


# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", default=None, help="synthetic checkpoint size (default: small on CPU, full on CUDA)")
    parser.add_argument("--seed", type=int, default=0, help="synthetic checkpoint seed")
    parser.add_argument("--checkpoint", type=Path, default=None, help="a Laya checkpoint folder (default: synthetic)")
    parser.add_argument("--bundle", type=harness._bundle_arg, action="append", default=[], metavar="NAME=PATH",
                        help="a prebuilt bundle (fp32 serves CPU, fast serves CUDA); else built into the cache")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--tokens", type=int, default=108, help="nominal row length of the request")
    parser.add_argument("--seconds", type=float, default=8.0, help="timed load per case and concurrency")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="untimed load before each timed one")
    parser.add_argument("--max-batch-rows", type=int, default=None,
                        help="batching on: rows per merged call (default: what the laya pipeline declares, 32)")
    parser.add_argument("--batch-wait-us", type=int, default=None, help="batching on: the stage's batch wait")
    parser.add_argument("--replicas", type=int, default=1, help="omnigraph's worker replicas (num_replicas)")
    parser.add_argument("--intra-op-threads", type=int, default=None,
                        help="omnigraph's worker route: ONNX Runtime threads (default: ORT's); on the 2-core VM, 1 "
                             "leaves the controller a core of its own, as on a GPU host")
    parser.add_argument("--host-calls", type=int, default=2000, help="timed calls of prepare and of finish")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a worker to load")
    parser.add_argument("--json", type=Path, default=None, help="write the rows and targets here")
    parser.add_argument("--report", type=Path, default=None, metavar="JSON", help="only print an earlier run's report")
    args = parser.parse_args(argv)
    if min(args.concurrency) < 1 or args.replicas < 1 or (args.max_batch_rows is not None and args.max_batch_rows < 1) \
            or args.seconds <= 0 or args.warmup_s < 0:
        parser.error("--concurrency, --max-batch-rows and --replicas must be >= 1, --seconds > 0, --warmup-s >= 0")
    args.size = args.size or ("full" if args.device == "cuda" else "small")
    if args.max_batch_rows is None:  # the pipeline's own declaration, for omnigraph and laya-cuda alike
        from omnigraph.pipelines.registry import get_pipeline

        args.max_batch_rows = get_pipeline("laya").stages[0].max_batch_rows
    args.strict_placement = False  # laya_gpu.py's plan: CUDA nodes, CPU fallback allowed and reported
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.report is not None:
        print("\n".join(report_lines(json.loads(args.report.read_text()))))
        return 0
    if args.device == "cuda":
        import torch  # before onnxruntime: loads the CUDA libraries onnxruntime-gpu needs

        if not torch.cuda.is_available():
            print("--device cuda but torch sees no CUDA device", file=sys.stderr)
            return 2
    run = Run(args, argv)

    from omnigraph.pipelines.laya.synth import cached_checkpoint

    checkpoint = args.checkpoint or cached_checkpoint(args.size, seed=args.seed)
    timed, long = harness.build_requests(checkpoint, (args.tokens, HOST_COST_TOKENS))
    run.add("request", "tokens", timed.tokens, "tokens", length=timed.length)
    bundle_run = SimpleNamespace(args=args, bundle_failures={}, add=run.add)
    bundle_name = "fast" if args.device == "cuda" else "fp32"

    for case in [c for c in CASES if c in args.cases]:
        started = time.perf_counter()
        print(f"[{case}] starting", file=sys.stderr, flush=True)
        try:
            if case == "omnigraph":
                case_omnigraph(run, harness.resolve_bundle(bundle_run, bundle_name, checkpoint), timed.timed)
            elif case == "laya-cuda":
                case_laya_cuda(run, checkpoint, timed.timed, timed.tokens)
            elif case == "laya":
                case_laya_predict_batch(run, checkpoint, timed.timed)
            else:
                case_host(run, harness.resolve_bundle(bundle_run, bundle_name, checkpoint), [timed, long])
            run.add(case, "status", "ok", "", seconds=round(time.perf_counter() - started, 1))
        except harness.CaseSkipped as skipped:
            run.add(case, "status", "skipped", "", detail=str(skipped))
        except Exception as error:
            run.add(case, "status", "error", "", detail=harness._describe(error))
            traceback.print_exc()
        print(f"[{case}] {run.rows[-1]['value']} in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        run.write()
    check_answers(run)

    print("\n".join(report_lines(run.rows + targets(run.rows, args.device))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
