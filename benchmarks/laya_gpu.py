"""Laya decision latency on one GPU (issue 7): the laya reference, laya-cuda and omnigraph's bundles.

Every case answers the same batch-1 requests: one `noul` question whose state text is repeated
until the row holds about 64, 176 and 512 tokens (the actual counts are reported). Per length:
`--warmup` requests, then `--requests` timed ones, one at a time; rows give p50 and p99 (nearest
rank) of the caller's wall clock. Every call returns host data, so it has synchronised the GPU.

Cases (`--cases`), in the order they run:
  laya            `laya.load(DIR, device=...)`: on CUDA under its bf16 autocast (LAYA_CUDA_AMP=bf16),
                  on CPU its eager fp32; times `agent.system_one(state, questions)`. The same agent,
                  autocast off, is the fp32 reference every case's probabilities are compared with.
  laya-cuda       `laya_cuda.Engine(DIR)` (its defaults: fp16 weights, one CUDA graph per shape
                  class); times `Engine.predict`, and reports its CUDA-event `gpu_ms` too.
  ort-fast-graph  the `fast` bundle (omnigraph custom ops) on a CUDA route with `enable_cuda_graph`.
  ort-fast        the `fast` bundle on a CUDA route.
  ort-fast16-graph  the `fast` bundle built with FP16 activations (`--precision fp16 --fast`), CUDA
                  graphs on: the same kernels in their FP16 instantiation (laya-cuda's precision).
  ort-bf16        the standard-op bf16 bundle (`bundle build --precision bf16`).
  ort-fp32        the standard-op fp32 bundle.
Each `ort-*` case is timed three ways:
  engine  a graph worker (`WorkerClient` on the route) running tensors that `LayaProcessor.prepare`
          made beforehand: the wire both ways plus the worker's ORT run (IOBinding on CUDA, CUDA
          graph replay where enabled); no tokenization, no decoding.
  loop    the engine path's calls sent from an asyncio event loop, the reply waking the loop itself
          (the worker's socket in `loop.add_reader`, so the route has no mailbox): the floor of an
          engine whose batch-1 call crosses no thread hand-off (issue 20), on the real model.
  e2e     `AsyncOmni` on a one-stage plan with the same route: `generate(request)` from the request
          dict to the finished answer (validation, tokenization, admission, worker, decoding).
  http    `omnigraph serve --deploy-config` on that plan, in its own process on 127.0.0.1: a
          `POST /v1/systemone` of the request's JSON over one keep-alive connection (the standard
          library's http.client, the leanest client at hand), from the first byte sent to the
          answer's JSON parsed. Beside it, "http floor": the same client against a bare ASGI app
          under uvicorn that parses the body and sends it back (benchmarks/http_echo.py): what
          HTTP costs on this machine with no framework and no engine.
The worker route allows CPUExecutionProvider beside CUDA and refuses nothing on placement (rows
report the real fraction of nodes on CUDA), unless `--strict-placement` asks for the deploy
defaults (CUDA only, every node on it).

Drift: each case also answers a noul + choice + score request at each length; rows give the largest
|p - p_fp32| over every option and the decision flips where the fp32 margin between the top two
options exceeds 0.01.

Cases are independent: a failing case records its error, the run goes on, and the JSON (rows plus
the targets table) is rewritten after every case, so a run cut short keeps what it measured.
`--device cpu --size tiny --requests 5` runs the harness on a CPU-only machine (the CUDA-only
cases are skipped with the reason).

    python benchmarks/laya_gpu.py --json $OUT/laya_gpu.json                      # on the H200
    python benchmarks/laya_gpu.py --device cpu --size tiny --requests 5 --json /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import datetime
import gc
import http.client
import importlib.metadata
import itertools
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterator, Mapping

try:
    from benchmarks.http_echo import DELAY_HEADER, SPIN_HEADER
    from benchmarks.machine import cpu_name
    from benchmarks.processes import stop_process_group
except ImportError:  # run as a script: this folder is sys.path[0]
    from http_echo import DELAY_HEADER, SPIN_HEADER
    from machine import cpu_name
    from processes import stop_process_group

if TYPE_CHECKING:
    from omnigraph.pipelines.deploy import DeployConfig

# The lengths and the numbers to beat there (p50 ms, batch 1, same H200 class).
LENGTHS = (64, 176, 512)
BAR_LAYA_REFERENCE_MS = {64: 40.1, 176: 40.1, 512: 26.2}
BAR_LAYA_CUDA_MS = {64: 1.75, 176: 2.75, 512: 4.56}  # published at 64 / 174 / 512 tokens
TARGET_E2E_P50_MS = {64: 0.6, 176: 0.9, 512: 1.5}
TARGET_FAST_OVER_STANDARD_AT_512 = 1.5
TARGET_OVER_LAYA_REFERENCE = 3.0
TARGET_OVER_LAYA_CUDA = 1.0
TARGET_MAX_DRIFT = 0.002
DECISIVE_MARGIN = 0.01
PRODUCT = "ort-fast-graph e2e"  # the configuration the targets are about
# Issue 20's host-cost bounds (ms, at 64 tokens): AsyncOmni's cost over the engine's worker call, and
# HTTP's over AsyncOmni, both p50 of the product's configuration measured in the same run.
TARGET_E2E_OVER_ENGINE_MS = 0.150
TARGET_HTTP_OVER_E2E_MS = 0.200

CASES = ("laya", "laya-cuda", "ort-fast-graph", "ort-fast16-graph", "ort-fast", "ort-bf16", "ort-fp32")
# ort case -> (bundle, enable_cuda_graph)
ORT_CASES = {
    "ort-fast-graph": ("fast", True),
    "ort-fast16-graph": ("fast16", True),
    "ort-fast": ("fast", False),
    "ort-bf16": ("bf16", False),
    "ort-fp32": ("fp32", False),
}
BUNDLES = {"bf16": {"precision": "bf16", "fast": False},
           "fast": {"precision": "bf16", "fast": True},
           "fast16": {"precision": "fp16", "fast": True},
           "fp32": {"precision": "fp32", "fast": False}}

STATE_TEXT = ("Hi, I was charged twice for my March invoice. Please refund the duplicate charge and tell "
              "me when the money will be back on my card. I have attached the receipt from the bank.")
TIMED_QUESTIONS = {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}
DRIFT_QUESTIONS = {
    **TIMED_QUESTIONS,
    "team": {"type": "choice", "instructions": "Which team should handle this?",
             "criteria": {"billing": "payments and invoices", "support": "product problems",
                          "sales": "new purchases"}},
    "urgency": {"type": "score", "instructions": "How urgent is this?",
                "criteria": ["not urgent", "somewhat urgent", "urgent"]},
}


class CaseSkipped(Exception):
    """The case cannot run here (no CUDA, a bundle that cannot be built); the message says why."""


# ----------------------------------------------------------------------------------------------
# Requests


@dataclass(frozen=True)
class LengthRequests:
    """The requests of one nominal length: the timed one (noul) and the drift one (3 questions)."""

    length: int
    tokens: int          # the timed request's row length, as omnigraph tokenizes it
    timed: dict
    drift: dict


def _request(state: str, questions: Mapping[str, Any]) -> dict:
    return {"state": state, "questions": copy.deepcopy(dict(questions))}


def build_requests(checkpoint: Path, lengths: tuple[int, ...]) -> list[LengthRequests]:
    """For each length, the state (STATE_TEXT's words, cycled) whose timed row comes closest to it."""
    from omnigraph.pipelines.system_one.request import parse_request
    from omnigraph.pipelines.laya.sequence import LayaTokenizer, build_row

    tokenizer = LayaTokenizer(checkpoint / "tokenizer" / "tokenizer.json",
                              checkpoint / "tokenizer" / "tokenizer_config.json")
    agent_config = json.loads((checkpoint / "rl_agent_config.json").read_text())
    words = STATE_TEXT.split()

    def row_tokens(state: str) -> int:
        decision = parse_request(_request(state, TIMED_QUESTIONS))
        row = build_row(tokenizer, decision.questions[0], tokenizer.encode(decision.state_text),
                        truncate_left=decision.truncate_left, max_len=agent_config["max_len"],
                        head_max_len=agent_config["head_max_len"])
        return len(row.ids)

    def state_of(count: int) -> str:
        return " ".join(words[i % len(words)] for i in range(count))

    requests = []
    for length in lengths:
        best: tuple[int, int] | None = None  # (distance, word count)
        previous = -1
        for count in range(1, 8 * length):
            tokens = row_tokens(state_of(count))
            if best is None or abs(tokens - length) < best[0]:
                best = (abs(tokens - length), count)
            if tokens >= length or tokens == previous == agent_config["max_len"]:
                break
            previous = tokens
        state = state_of(best[1])
        requests.append(LengthRequests(length=length, tokens=row_tokens(state),
                                       timed=_request(state, TIMED_QUESTIONS),
                                       drift=_request(state, DRIFT_QUESTIONS)))
    return requests


# ----------------------------------------------------------------------------------------------
# Timing and comparison


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 100]) of a non-empty sample."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def time_calls(call: Callable[[], Any], requests: int, warmup: int) -> list[float]:
    """Seconds per call of `requests` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(requests):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


async def time_calls_async(call: Callable[[], Awaitable[Any]], requests: int, warmup: int) -> list[float]:
    """`time_calls` for coroutines, timed inside the running event loop."""
    for _ in range(warmup):
        await call()
    samples = []
    for _ in range(requests):
        started = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - started)
    return samples


def answer_probabilities(answer: Mapping[str, Any]) -> list[float]:
    """The option probabilities of one answer, in option order (noul: [false, true])."""
    if "probabilities" in answer:
        return [float(p) for p in answer["probabilities"].values()]
    return [1.0 - float(answer["noul"]), float(answer["noul"])]


def compare_answers(reference: list[dict], candidate: list[dict]) -> dict[str, float]:
    """Largest probability drift and decisive flips of `candidate` responses against `reference`."""
    drift, flips, decisive = 0.0, 0, 0
    for ref_response, response in zip(reference, candidate, strict=True):
        for qid, ref_answer in ref_response["answers"].items():
            ref_p = answer_probabilities(ref_answer)
            p = answer_probabilities(response["answers"][qid])
            if len(p) != len(ref_p):
                raise ValueError(f"question {qid!r}: {len(p)} probabilities, the reference has {len(ref_p)}")
            drift = max(drift, max(abs(a - b) for a, b in zip(p, ref_p)))
            top = sorted(ref_p, reverse=True)
            if top[0] - top[1] > DECISIVE_MARGIN:
                decisive += 1
                flips += int(p.index(max(p)) != ref_p.index(max(ref_p)))
    return {"max_prob_drift": drift, "decision_flips": flips, "decisive_questions": decisive}


# ----------------------------------------------------------------------------------------------
# The run: identity, rows, partial JSON


class Run:
    """Rows of one benchmark run, the fp32 reference answers, and the JSON written after each case."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        self.args = args
        self.rows: list[dict[str, Any]] = []
        self.reference: list[dict] | None = None   # fp32 answers to each length's drift request
        self.reference_name = "not measured"
        self.bundle_failures: dict[str, str] = {}  # bundle name -> why it cannot be built
        self.started = time.monotonic()
        self.identity = {
            "device": args.device,
            "checkpoint": str(args.checkpoint) if args.checkpoint else f"synthetic {args.size} seed {args.seed}",
            "versions": _versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.argv[0]).name, *argv]),
        }

    def add(self, case: str, metric: str, value: Any, unit: str, **fields: Any) -> None:
        self.rows.append({"case": case, "metric": metric, "value": value, "unit": unit, **fields,
                          **self.identity})

    def add_latency(self, case: str, requests: LengthRequests, samples: list[float], **fields: Any) -> None:
        for metric, value in (("p50_ms", percentile(samples, 50)), ("p99_ms", percentile(samples, 99))):
            self.add(case, metric, round(1000 * value, 4), "ms", length=requests.length,
                     tokens=requests.tokens, requests=len(samples), **fields)

    def add_drift(self, case: str, answers: list[dict]) -> None:
        if self.reference is None:
            self.add(case, "max_prob_drift", None, "probability", detail="no fp32 reference (the laya case did not run)")
            return
        for metric, value in compare_answers(self.reference, answers).items():
            unit = "probability" if metric == "max_prob_drift" else "count"
            self.add(case, metric, round(value, 6), unit, reference=self.reference_name)

    def seconds_left(self) -> float | None:
        if self.args.time_budget is None:
            return None
        return self.args.time_budget - (time.monotonic() - self.started)

    def write(self) -> None:
        if self.args.json is not None:
            write_json(self.args.json, self.rows + targets(self.rows, self.identity))


def write_json(path: Path, payload: Any) -> None:
    """`payload` as indented JSON at `path` (its folder made), swapped in whole: a run cut short,
    or a reader meanwhile, never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    temporary.replace(path)


def _versions() -> dict[str, str]:
    import onnxruntime

    versions = {"python": platform.python_version()}
    for dist in ("omnigraph", "laya", "laya-cuda", "torch", "transformers", "cupy-cuda13x", "numpy"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    # The module that imports, not a distribution's metadata: the GPU machine holds the CPU
    # onnxruntime in site-packages and onnxruntime-gpu first on PYTHONPATH.
    versions["onnxruntime"] = f"{onnxruntime.__version__} ({', '.join(onnxruntime.get_available_providers())})"
    return versions


def _device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return cpu_name()


# ----------------------------------------------------------------------------------------------
# Cases


def case_laya(run: Run, checkpoint: Path, lengths: list[LengthRequests]) -> None:
    """The laya reference: timed in its device's default precision, then the fp32 reference."""
    if run.args.device == "cuda":
        os.environ["LAYA_CUDA_AMP"] = "bf16"
    import laya
    import torch

    started = time.perf_counter()
    agent = laya.load(str(checkpoint), device=run.args.device)
    run.add("laya", "load_s", round(time.perf_counter() - started, 3), "s")
    try:
        precision = str(agent.dtype_for(1)).removeprefix("torch.")
        for requests in lengths:
            samples = time_calls(lambda: agent.system_one(requests.timed["state"], requests.timed["questions"]),
                                 run.args.requests, run.args.warmup)
            usage = agent.system_one(requests.timed["state"], requests.timed["questions"])["usage"]
            run.add_latency("laya", requests, samples, precision=precision, usage_tokens=usage["input_tokens"])
        answers = [agent.system_one(r.drift["state"], r.drift["questions"]) for r in lengths]
        # The fp32 reference: the same agent with its autocast off (on CPU it is already off).
        # Why the attribute: laya has no public switch back to fp32 on CUDA; `dtype_for` proves it took.
        agent.amp_enabled = False
        if agent.dtype_for(1) != torch.float32:
            raise RuntimeError(f"laya still runs {agent.dtype_for(1)} with autocast off")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        run.reference = [agent.system_one(r.drift["state"], r.drift["questions"]) for r in lengths]
        run.reference_name = f"laya {laya.__version__} fp32 on {run.args.device}"
        run.add_drift("laya", answers)
    finally:
        del agent
        gc.collect()
        if run.args.device == "cuda":
            torch.cuda.empty_cache()


def case_laya_cuda(run: Run, checkpoint: Path, lengths: list[LengthRequests]) -> None:
    """laya-cuda's Engine with its own defaults; wall time of predict plus its CUDA-event gpu_ms."""
    if run.args.device != "cuda":
        raise CaseSkipped("laya-cuda needs CUDA (--device cuda)")
    import laya_cuda

    started = time.perf_counter()
    engine = laya_cuda.Engine(str(checkpoint))
    run.add("laya-cuda", "load_s", round(time.perf_counter() - started, 3), "s")
    try:
        for requests in lengths:
            gpu_ms: list[float] = []

            def predict(r: LengthRequests = requests) -> None:
                engine.predict(r.timed["state"], r.timed["questions"])
                gpu_ms.append(engine.last_metrics["gpu_ms"])

            samples = time_calls(predict, run.args.requests, run.args.warmup)
            timed_gpu = gpu_ms[run.args.warmup:]
            run.add_latency("laya-cuda", requests, samples, precision=engine.last_metrics.get("precision"),
                            usage_tokens=engine.last_metrics["tokens_per_question"][0])
            run.add("laya-cuda", "gpu_p50_ms", round(percentile(timed_gpu, 50), 4), "ms", length=requests.length,
                    tokens=requests.tokens, requests=len(timed_gpu), detail="CUDA events around the graph launch")
        run.add_drift("laya-cuda", [engine.predict(r.drift["state"], r.drift["questions"]) for r in lengths])
    finally:
        engine.close()


def ort_plan(run: Run, case: str, bundle: Path) -> DeployConfig:
    """The one-stage deploy plan of an ort case; its engine path runs that plan's worker route."""
    from omnigraph.pipelines.deploy import validate_deploy_config

    return validate_deploy_config(ort_plan_fields(run, case, bundle))


def ort_plan_fields(run: Run, case: str, bundle: Path) -> dict[str, Any]:
    """ort_plan's deploy YAML fields (the http path writes them for `omnigraph serve`)."""
    from omnigraph.pipelines.deploy import GRAPH_BACKEND

    _, cuda_graph = ORT_CASES[case]
    if run.args.device == "cpu":
        route = {"name": f"bench-{case}", "interpreter": sys.executable, "ep": "cpu"}
        placement = {"allowed_providers": ["CPUExecutionProvider"], "min_fraction_on_target": 1.0}
    else:
        route = {"name": f"bench-{case}", "interpreter": sys.executable, "ep": "cuda", "device_id": 0,
                 "enable_cuda_graph": cuda_graph}
        placement = ({"allowed_providers": ["CUDAExecutionProvider"], "min_fraction_on_target": 1.0}
                     if run.args.strict_placement else
                     {"allowed_providers": ["CUDAExecutionProvider", "CPUExecutionProvider"],
                      "min_fraction_on_target": 0.0})
    return {
        "pipeline": "laya",
        "stages": [{"stage_id": 0,
                    "backend": {"name": GRAPH_BACKEND, "manifest": str(bundle), "route": route, **placement}}],
    }


def case_ort(run: Run, case: str, bundle: Path, lengths: list[LengthRequests]) -> None:
    """One bundle on one route: engine-only through a graph worker, end to end through AsyncOmni,
    then over HTTP through `omnigraph serve`."""
    plan = ort_plan(run, case, bundle)
    failed = []
    paths: tuple[tuple[str, Callable[[], None]], ...] = (
        ("engine", lambda: _ort_engine(run, f"{case} engine", plan, lengths)),
        ("loop", lambda: _ort_loop(run, f"{case} loop", plan, lengths)),
        ("e2e", lambda: _ort_e2e(run, f"{case} e2e", plan, lengths)),
        ("http", lambda: _ort_http(run, f"{case} http", ort_plan_fields(run, case, bundle), lengths)),
    )
    for path, measure in paths:
        name = f"{case} {path}"
        try:
            measure()
            run.add(name, "status", "ok", "")
        except Exception as error:  # one path failing leaves the other to run
            failed.append(path)
            run.add(name, "status", "error", "", detail=_describe(error))
            traceback.print_exc()
        run.write()
    if failed:
        raise RuntimeError(f"{' and '.join(failed)} failed (see the '{case} <path>' status rows)")


def _ort_engine(run: Run, name: str, plan: DeployConfig, lengths: list[LengthRequests]) -> None:
    from omnigraph.bundles import verify_bundle
    from omnigraph.pipelines.laya.processor import LayaProcessor
    from omnigraph.stages.graph_stage import worker_route
    from omnigraph.workers.client import WorkerClient

    (stage,) = plan.stages
    verified = verify_bundle(stage.backend.manifest)
    processor = LayaProcessor({0: verified})
    started = time.perf_counter()
    client = WorkerClient.start(worker_route(stage), generation=1, startup_timeout=run.args.startup_timeout)
    try:
        report = client.load(verified.manifest_path, timeout=run.args.startup_timeout)
        run.add(name, "load_s", round(time.perf_counter() - started, 3), "s",
                providers=list(report.session_providers), onnxruntime=client.hello.onnxruntime_version)
        placement = report.placement
        run.add(name, "fraction_on_target", round(placement.fraction_on_target, 4), "fraction",
                nodes_by_provider=dict(placement.nodes_by_provider), target=placement.target_provider)
        calls = itertools.count(1)

        def forward(work: Mapping[str, Any]) -> dict:
            return client.run(work, request_id=f"bench-{next(calls)}", stage_id=0, epoch=0)

        for requests in lengths:
            prepared = processor.prepare(requests.timed)
            (work,) = prepared.calls
            samples = time_calls(lambda: forward(work), run.args.requests, run.args.warmup)
            run.add_latency(name, requests, samples, precision=verified.manifest.metadata.precision)
        drift_answers = []
        for requests in lengths:
            prepared = processor.prepare(requests.drift)
            drift_answers.append(processor.finish(prepared, [forward(work) for work in prepared.calls]))
        run.add_drift(name, drift_answers)
    finally:
        client.close()


def _ort_loop(run: Run, name: str, plan: DeployConfig, lengths: list[LengthRequests]) -> None:
    from omnigraph.bundles import verify_bundle
    from omnigraph.pipelines.laya.processor import LayaProcessor
    from omnigraph.stages.graph_stage import worker_route
    from omnigraph.workers.client import WorkerClient
    from omnigraph.workers.route import WorkerRoute

    (stage,) = plan.stages
    verified = verify_bundle(stage.backend.manifest)
    processor = LayaProcessor({0: verified})
    route = WorkerRoute.from_dict({**worker_route(stage).to_dict(), "mailbox_bytes": 0})
    client = WorkerClient.start(route, generation=1, startup_timeout=run.args.startup_timeout)
    try:
        client.load(verified.manifest_path, timeout=run.args.startup_timeout)
        calls = itertools.count(1)

        async def measure() -> None:
            loop = asyncio.get_running_loop()
            waiting: list[asyncio.Future] = []

            def reply_ready() -> None:
                outputs = client.result(time.monotonic())
                if outputs is not None:
                    waiting.pop().set_result(outputs)

            async def forward(work: Mapping[str, Any]) -> dict:
                waiting.append(loop.create_future())
                client.submit(work, request_id=f"bench-{next(calls)}", stage_id=0, epoch=0)
                return await waiting[0]

            loop.add_reader(client._sock.fileno(), reply_ready)
            try:
                for requests in lengths:
                    (work,) = processor.prepare(requests.timed).calls
                    samples = await time_calls_async(lambda: forward(work), run.args.requests, run.args.warmup)
                    run.add_latency(name, requests, samples)
            finally:
                loop.remove_reader(client._sock.fileno())

        asyncio.run(measure())
    finally:
        client.close()


def _ort_e2e(run: Run, name: str, plan: DeployConfig, lengths: list[LengthRequests]) -> None:
    from omnigraph.plugin.omni import AsyncOmni

    started = time.perf_counter()
    omni = AsyncOmni(model="laya", deploy_config=plan, startup_timeout=run.args.startup_timeout)
    run.add(name, "load_s", round(time.perf_counter() - started, 3), "s")
    try:
        async def answer(request: dict) -> dict:
            async for output in omni.generate(request):
                return output.custom_output
            raise RuntimeError("AsyncOmni.generate finished without an output")

        async def measure() -> list[dict]:
            for requests in lengths:
                samples = await time_calls_async(lambda: answer(requests.timed), run.args.requests, run.args.warmup)
                usage = (await answer(requests.timed))["usage"]
                run.add_latency(name, requests, samples, usage_tokens=usage["input_tokens"])
            return [await answer(requests.drift) for requests in lengths]

        run.add_drift(name, asyncio.run(measure()))
    finally:
        omni.shutdown()


def _ort_http(run: Run, name: str, plan: Mapping[str, Any], lengths: list[LengthRequests]) -> None:
    import yaml

    with tempfile.TemporaryDirectory(prefix="laya-gpu-http-") as folder:
        config = Path(folder) / "deploy.yaml"
        config.write_text(yaml.safe_dump(dict(plan)))
        serve = ["-m", "omnigraph.plugin.cli", "serve", "--deploy-config", str(config)]
        started = time.perf_counter()
        with _http_server(serve, "/ready", Path(folder) / "serve.log", run.args.startup_timeout) as post:
            run.add(name, "load_s", round(time.perf_counter() - started, 3), "s")
            for requests in lengths:
                samples = time_calls(lambda: post(requests.timed), run.args.requests, run.args.warmup)
                usage = post(requests.timed)["usage"]
                run.add_latency(name, requests, samples, usage_tokens=usage["input_tokens"])
            run.add_drift(name, [post(requests.drift) for requests in lengths])
        echo = ["-m", "uvicorn", "benchmarks.http_echo:app", "--http", "httptools", "--no-access-log"]
        with _http_server(echo, "/", Path(folder) / "echo.log", run.args.startup_timeout) as post:
            for requests in lengths:
                samples = time_calls(lambda: post(requests.timed), run.args.requests, run.args.warmup)
                run.add_latency(f"{name} floor", requests, samples, detail="bare ASGI echo under uvicorn")
            for suffix, poll, detail in ((" +e2e", {}, "the echo answering after the e2e p50, woken from a thread"),
                                         (" +e2e polled", {SPIN_HEADER.decode(): "1"},
                                          "the echo answering after the e2e p50, its event loop polling")):
                for requests in lengths:
                    e2e_ms = _value(run.rows, name.replace(" http", " e2e"), "p50_ms", requests.length)
                    if e2e_ms is None:
                        continue
                    headers = {DELAY_HEADER.decode(): str(round(1000 * e2e_ms)), **poll}
                    samples = time_calls(lambda: post(requests.timed, headers), run.args.requests, run.args.warmup)
                    run.add_latency(f"{name} floor{suffix}", requests, samples, delay_ms=e2e_ms, detail=detail)


@contextlib.contextmanager
def _http_server(arguments: list[str], ready_path: str, log: Path,
                 timeout: float) -> Iterator[Callable[..., dict]]:
    """Start `python ARGUMENTS --port P` in its own process group; yields a function that POSTs a
    request (with extra headers, if given) to /v1/systemone over one keep-alive connection and
    returns the parsed answer."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with log.open("w") as log_file:
        server = subprocess.Popen([sys.executable, *arguments, "--port", str(port)], stdout=log_file,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        connection = _await_ready(server, port, ready_path, timeout, log)

        def post(request: dict, headers: Mapping[str, str] = {}) -> dict:  # noqa: B006  # never changed
            connection.request("POST", "/v1/systemone", body=json.dumps(request),
                               headers={"Content-Type": "application/json", **headers})
            response = connection.getresponse()
            body = json.loads(response.read())
            if response.status != 200:
                raise RuntimeError(f"POST /v1/systemone: {response.status} {body}")
            return body

        yield post
        connection.close()
    finally:
        stop_process_group(server)


def _await_ready(server: subprocess.Popen, port: int, ready_path: str, timeout: float,
                 log: Path) -> http.client.HTTPConnection:
    """A keep-alive connection to the server once `ready_path` answers 200 (within `timeout` s)."""
    deadline = time.monotonic() + timeout
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}: {log.read_text()[-2000:]}")
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            connection.request("GET", ready_path)
            response = connection.getresponse()
            response.read()
            if response.status == 200:
                return connection
        except OSError:
            pass
        connection.close()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not ready within {timeout} s: {log.read_text()[-2000:]}")
        time.sleep(0.25)


def _describe(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(error).__name__}: {error}{where}"


# ----------------------------------------------------------------------------------------------
# Bundles


def resolve_bundle(run: Run, name: str, checkpoint: Path) -> Path:
    """`--bundle NAME=PATH`, or the bundle built once into the cache; CaseSkipped if it cannot be built."""
    if name in run.bundle_failures:
        raise CaseSkipped(run.bundle_failures[name])
    given = dict(run.args.bundle)
    if name in given:
        path = Path(given[name])
        if not (path / "manifest.json").is_file():
            raise CaseSkipped(f"--bundle {name}={path} has no manifest.json (did its build fail? see the log)")
        return path
    from omnigraph.pipelines.laya.export import cached_bundle

    started = time.perf_counter()
    try:
        out = cached_bundle(checkpoint, **BUNDLES[name])
    except Exception as error:
        run.bundle_failures[name] = f"the {name} bundle cannot be built: {_describe(error)}"
        raise CaseSkipped(run.bundle_failures[name]) from error
    run.add(f"bundle {name}", "build_s", round(time.perf_counter() - started, 3), "s",
            detail="seconds to build it, or to find it in the cache")
    return out


# ----------------------------------------------------------------------------------------------
# Targets


def _p50(rows: list[dict], case: str) -> dict[int, float]:
    return {row["length"]: row["value"] for row in rows if row["case"] == case and row["metric"] == "p50_ms"}


def targets(rows: list[dict], identity: Mapping[str, Any]) -> list[dict]:
    """The issue's bars and targets: measured value, goal, met / missed, and the margin
    (goal / value where lower is better, value / goal where higher is: >= 1 meets the goal)."""
    out: list[dict] = []

    def add(name: str, length: int | None, value: float | None, goal: float, unit: str, *, lower_is_better: bool,
            detail: str, strict: bool = False, vetoed: bool = False) -> None:
        margin = None if value is None else (goal / value if lower_is_better and value else
                                              math.inf if lower_is_better else value / goal)
        met = margin is not None and not vetoed and (margin > 1 if strict else margin >= 1)
        out.append({"case": "target", "metric": name, "value": None if value is None else round(value, 4),
                    "unit": unit, "goal": goal,
                    "margin": None if margin is None or math.isinf(margin) else round(margin, 3),
                    "status": "not measured" if value is None else ("met" if met else "missed"),
                    "length": length, "detail": detail, **identity})

    product = _p50(rows, PRODUCT)
    laya_measured, laya_cuda_measured = _p50(rows, "laya"), _p50(rows, "laya-cuda")
    for length in LENGTHS:
        mine = product.get(length)
        add(f"{PRODUCT} p50 <= {TARGET_E2E_P50_MS[length]} ms", length, mine, TARGET_E2E_P50_MS[length], "ms",
            lower_is_better=True, detail="AsyncOmni end to end, batch 1")
        for bar_name, measured, stated, goal in (
                ("laya reference", laya_measured, BAR_LAYA_REFERENCE_MS, TARGET_OVER_LAYA_REFERENCE),
                ("laya-cuda", laya_cuda_measured, BAR_LAYA_CUDA_MS, TARGET_OVER_LAYA_CUDA)):
            baseline = measured.get(length)
            source = "measured in this run" if baseline is not None else "the issue's stated bar"
            baseline = baseline if baseline is not None else stated[length]
            strict = goal == 1.0  # "faster than": a tie does not count
            add(f"{bar_name} p50 / {PRODUCT} p50 {'>' if strict else '>='} {goal}x", length,
                None if mine is None else baseline / mine, goal, "x", lower_is_better=False, strict=strict,
                detail=f"baseline {baseline} ms, {source}")
    paths = [f"{PRODUCT.removesuffix(' e2e')} {path}" for path in ("engine", "e2e", "http")]
    for (lower, upper), goal in zip(itertools.pairwise(paths), (TARGET_E2E_OVER_ENGINE_MS, TARGET_HTTP_OVER_E2E_MS)):
        below, above = _p50(rows, lower).get(64), _p50(rows, upper).get(64)
        add(f"{upper} p50 - {lower} p50 <= {goal} ms", 64, None if below is None or above is None else above - below,
            goal, "ms", lower_is_better=True, detail="issue 20: the host's cost, both measured in this run")
    standard, fast = _p50(rows, "ort-bf16 engine").get(512), _p50(rows, "ort-fast engine").get(512)
    add(f"ort-bf16 engine p50 / ort-fast engine p50 >= {TARGET_FAST_OVER_STANDARD_AT_512}x", 512,
        None if standard is None or fast is None else standard / fast, TARGET_FAST_OVER_STANDARD_AT_512, "x",
        lower_is_better=False, detail="custom ops vs standard ops, same route without CUDA graphs")
    for case in sorted({row["case"] for row in rows if row["metric"] == "max_prob_drift"}):
        drift = _value(rows, case, "max_prob_drift")
        flips = _value(rows, case, "decision_flips")
        add(f"{case} max |p - p_fp32| <= {TARGET_MAX_DRIFT}, no decisive flips", None, drift, TARGET_MAX_DRIFT,
            "probability", lower_is_better=True, vetoed=bool(flips),
            detail=f"{flips} flips where the fp32 margin > {DECISIVE_MARGIN}")
    return out


# ----------------------------------------------------------------------------------------------
# Report


def _value(rows: list[dict], case: str, metric: str, length: int | None = None) -> Any:
    return next((row["value"] for row in rows if row["case"] == case and row["metric"] == metric
                 and (length is None or row.get("length") == length)), None)


def report_lines(rows: list[dict]) -> Iterator[str]:
    """The compact report of a run's rows (measurements and targets, as the JSON holds them)."""
    if not rows:
        yield "no rows"
        return
    first = rows[0]
    yield (f"{first.get('gpu') or first.get('cpu')} | {first['checkpoint']} | {first['date']} | "
           + " ".join(f"{name} {version}" for name, version in first["versions"].items()))
    yield (f"bar, p50 ms at 64/176/512 tokens: laya reference {'/'.join(map(str, BAR_LAYA_REFERENCE_MS.values()))}, "
           f"laya-cuda {'/'.join(map(str, BAR_LAYA_CUDA_MS.values()))} (published at 174, not 176)")
    lengths = sorted({row["length"] for row in rows if row["case"] == "requests"})
    tokens = {length: _value(rows, "requests", "tokens", length) for length in lengths}
    header = "".join(f" {f'L{length} ({tokens[length]} tok)':>21}" for length in lengths)
    yield f"{'p50 / p99 ms, batch 1':<24}{header}{'load_s':>9}{'drift':>9}{'flips':>6}"
    timed = [row["case"] for row in rows if row["metric"] == "p50_ms"]
    for case in dict.fromkeys(timed):
        cells = ""
        for length in lengths:
            p50, p99 = _value(rows, case, "p50_ms", length), _value(rows, case, "p99_ms", length)
            cells += f" {'-' if p50 is None else f'{p50:.3f} / {p99:.3f}':>21}"
        load, drift, flips = (_value(rows, case, metric) for metric in ("load_s", "max_prob_drift", "decision_flips"))
        yield f"{case:<24}{cells}{'-' if load is None else load:>9}{'-' if drift is None else drift:>9}" \
              f"{'-' if flips is None else flips:>6}"
    for row in rows:
        if row["metric"] == "status" and row["value"] != "ok":
            yield f"{row['case']}: {row['value']}: {row.get('detail', '')}"
    for row in rows:
        if row["case"] == "target":
            value = "-" if row["value"] is None else row["value"]
            margin = "-" if row["margin"] is None else f"{row['margin']}x"
            yield (f"{row['status']:>12}  {row['metric']:<64} {'' if row['length'] is None else row['length']!s:>4} "
                   f"{value!s:>9} {row['unit']:<11} margin {margin:<8} ({row['detail']})")


# ----------------------------------------------------------------------------------------------


def _bundle_arg(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or name not in BUNDLES or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH with NAME one of {', '.join(BUNDLES)}, got {text!r}")
    return name, path


def parse_args(argv: list[str]) -> argparse.Namespace:
    from omnigraph.pipelines.laya.synth import SIZES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", choices=tuple(SIZES), default="full", help="synthetic checkpoint size")
    parser.add_argument("--seed", type=int, default=0, help="synthetic checkpoint seed")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a Laya checkpoint folder (default: the cached synthetic one of --size/--seed)")
    parser.add_argument("--bundle", type=_bundle_arg, action="append", default=[], metavar="NAME=PATH",
                        help=f"a prebuilt bundle ({', '.join(BUNDLES)}); the others are built into the cache")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS), help="nominal row lengths")
    parser.add_argument("--requests", type=int, default=200, help="timed requests per case and length")
    parser.add_argument("--warmup", type=int, default=20, help="untimed requests before them")
    parser.add_argument("--strict-placement", action="store_true",
                        help="CUDA routes allow only CUDAExecutionProvider with every node on it")
    parser.add_argument("--startup-timeout", type=float, default=120.0, help="seconds for a worker to load")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds after which no further case starts (it is recorded as skipped)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows and targets here")
    parser.add_argument("--report", type=Path, default=None, metavar="JSON",
                        help="only print the report of an earlier (possibly partial) run's JSON")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.warmup < 0:
        parser.error("--requests must be >= 1 and --warmup >= 0")
    if any(length < 8 for length in args.lengths):
        parser.error("--lengths must be >= 8 tokens")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.report is not None:
        for line in report_lines(json.loads(args.report.read_text())):
            print(line)
        return 0
    if args.device == "cuda":
        import torch  # before onnxruntime: loads the CUDA libraries onnxruntime-gpu needs

        if not torch.cuda.is_available():
            print("--device cuda but torch sees no CUDA device", file=sys.stderr)
            return 2
    run = Run(args, argv)
    run.identity["gpu" if args.device == "cuda" else "cpu"] = _device_name(args.device)

    from omnigraph.pipelines.laya.synth import cached_checkpoint

    checkpoint = args.checkpoint or cached_checkpoint(args.size, seed=args.seed)
    lengths = build_requests(checkpoint, tuple(args.lengths))
    for requests in lengths:
        run.add("requests", "tokens", requests.tokens, "tokens", length=requests.length)

    for case in [c for c in CASES if c in args.cases]:
        left = run.seconds_left()
        started = time.perf_counter()
        print(f"[{case}] starting", file=sys.stderr, flush=True)
        try:
            if left is not None and left <= 0:
                raise CaseSkipped(f"--time-budget {args.time_budget} s spent")
            if case == "laya":
                case_laya(run, checkpoint, lengths)
            elif case == "laya-cuda":
                case_laya_cuda(run, checkpoint, lengths)
            else:
                bundle_name, cuda_graph = ORT_CASES[case]
                if cuda_graph and args.device != "cuda":
                    raise CaseSkipped("enable_cuda_graph needs the CUDA route (--device cuda)")
                case_ort(run, case, resolve_bundle(run, bundle_name, checkpoint), lengths)
            run.add(case, "status", "ok", "", seconds=round(time.perf_counter() - started, 1))
        except CaseSkipped as skipped:
            run.add(case, "status", "skipped", "", detail=str(skipped))
        except Exception as error:
            run.add(case, "status", "error", "", detail=_describe(error))
            traceback.print_exc()
        print(f"[{case}] {run.rows[-1]['value']} in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        run.write()

    print()
    for line in report_lines(run.rows + targets(run.rows, run.identity)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
