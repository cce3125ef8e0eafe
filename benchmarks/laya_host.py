"""The host (CPU) cost of a Laya decision, stage by stage: what the controller spends per request
besides the graph (issues 5, 7, 9).

    python benchmarks/laya_host.py [--sizes tiny small] [--json PATH] [--calls N]

For each synthetic checkpoint's tokenizer and each state length (rows of about 64, 176 and 512
tokens, as benchmarks/laya_gpu.py builds them), two requests: `1q` (one noul question, the GPU
benchmarks' timed request) and `3q` (noul, 3-option choice and 3-level score). Each stage is
called many times in a row and the median call is reported (microseconds of wall time on one
thread; the calls are CPU-bound, so this is their CPU cost):

- `validate`: `parse_request` (the request checked whole, options rendered);
- `tokenize state`: `LayaTokenizer.encode` of the state text (`tokenize new state`: a state whose
  every word is new each call, a number appended, so no memo helps);
- `build rows`: `build_row` of each question (head and option texts from the tokenizer's memo; the
  processor also remembers whole question heads, so its own rows cost less);
- `collate`: `pack_batches` and `collate` of the rows into the request's work tensors;
- `prepare`: `LayaProcessor.prepare`, all of the above (`prepare cold`: every request asks a
  question text never seen before, so its head is tokenized too);
- `finish`: `LayaProcessor.finish` on graph-shaped outputs (decoding, the response);
- `adapter put`: the batch adapter's `group` + `footprint` of one work item (the stage queue's
  per-item cost); `adapter pack N` / `adapter unpack N`: one call of N one-row work items of the
  `1q` request (cpu: rows as they come; cuda-graph: rows padded to their power-of-two bucket), its
  cost per call and per row.

Stages run in the order above in blocks that take turns over several rounds, so other load on the
machine falls on all alike. Each row gives the median call's wall time (`median_us`) and the
process CPU time per call (`cpu_us`, the median over rounds of each round's mean), which moves less
when other processes share the cores. To compare two trees, run the script with each tree's
`omnigraph` first on `sys.path`, alternating (`omnigraph_path` in every row says which ran).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

try:
    from benchmarks import laya_gpu as harness
except ImportError:  # run as a script: this folder is sys.path[0]
    import laya_gpu as harness

import numpy as np

LENGTHS = (64, 176, 512)
PACK_ITEMS = (1, 8, 32)
ROUNDS = 5
WARMUP = 3  # untimed calls before each round of a stage



@dataclass
class Samples:
    """One stage's timings: each round's per-call wall times, and its process CPU time per call."""

    wall_us: list[list[float]] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)

    def time_round(self, call: Callable[[], Any], calls: int) -> None:
        """Time `calls` calls of `call`, after a few untimed ones."""
        for _ in range(WARMUP):
            call()
        samples = []
        clock = time.perf_counter_ns
        cpu_started = time.process_time_ns()
        for _ in range(calls):
            started = clock()
            call()
            samples.append((clock() - started) / 1000.0)
        self.cpu_us.append((time.process_time_ns() - cpu_started) / 1000.0 / calls)
        self.wall_us.append(samples)


def fake_outputs(work: list[dict[str, np.ndarray]], rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    """Graph-shaped outputs of each work item: random logits, -1e4 on padded marker slots."""
    outputs = []
    for item in work:
        logits = rng.normal(0, 2, item["marker_pos"].shape).astype(np.float32)
        logits[~item["marker_mask"]] = -1e4
        outputs.append({"logits": logits, "act_logits": rng.normal(0, 2, (len(item["qtype"]), 2)).astype(np.float32)})
    return outputs


def _letters(n: int) -> str:
    """n in base 26, as lower-case letters."""
    letters = ""
    while True:
        n, digit = divmod(n, 26)
        letters += chr(ord("a") + digit)
        if not n:
            return letters


def new_words(text: str, count: int) -> Iterator[str]:
    """`count` copies of `text`, each word of each copy new to the tokenizer's memos (letters of
    the copy's number appended to it, so every word is a new piece): the state tokenization's worst
    case."""
    words = text.split(" ")
    return iter([" ".join(f"{word}q{_letters(n)}" for word in words) for n in range(count)])


def stage_calls(size: str, seed: int, harness: Any,
                texts_per_case: int) -> list[tuple[dict[str, Any], Callable[[], Any]]]:
    """(row identity, call) of every stage for one checkpoint size; `texts_per_case`: how many
    calls a case gets in all (the new states are built before the timing)."""
    from omnigraph.bundles import verify_bundle
    from omnigraph.pipelines.laya.batching import LayaBatchAdapter
    from omnigraph.pipelines.laya.export import cached_bundle
    from omnigraph.pipelines.laya.processor import LayaProcessor
    from omnigraph.pipelines.system_one.request import parse_request
    from omnigraph.pipelines.laya.sequence import LayaTokenizer, build_row, collate, pack_batches
    from omnigraph.pipelines.laya.synth import cached_checkpoint
    from omnigraph.workers.route import WorkerRoute

    checkpoint = cached_checkpoint(size, seed=seed)
    bundle = verify_bundle(cached_bundle(checkpoint))
    processor = LayaProcessor({0: bundle})
    layout = processor.layout
    tokenizer = LayaTokenizer(bundle.file("tokenizer.json"), bundle.file("tokenizer_config.json"))
    # Each route with the bundle it serves: the fp32 bundle computes real tokens only, which a
    # CUDA-graph route refuses, so that route's adapter is built on the bf16 bundle (same layout).
    gpu_bundle = verify_bundle(cached_bundle(checkpoint, precision="bf16"))
    adapters = {route: LayaBatchAdapter(served, WorkerRoute(name=route, interpreter=sys.executable, **options))
                for route, served, options in (("cpu", bundle, {}),
                                               ("cuda-graph", gpu_bundle, {"ep": "cuda", "enable_cuda_graph": True}))}
    rng = np.random.default_rng(0)
    calls: list[tuple[dict[str, Any], Callable[[], Any]]] = []
    for requests in harness.build_requests(checkpoint, LENGTHS):
        for kind, request in (("1q", requests.timed), ("3q", requests.drift)):
            ident = {"size": size, "length": requests.length, "tokens": requests.tokens, "request": kind}
            decision = parse_request(request)
            state_ids = tokenizer.encode(decision.state_text)

            def rows(decision=decision, state_ids=state_ids) -> list:
                return [build_row(tokenizer, question, state_ids, truncate_left=decision.truncate_left,
                                  max_len=layout.max_len, head_max_len=layout.head_max_len)
                        for question in decision.questions]

            built = rows()

            def collated(built=built) -> list:
                return [collate([built[i] for i in batch], layout) for batch in pack_batches(built, layout)]

            fresh = iter(range(10**9))

            def prepare_cold(request=request) -> Any:
                questions = {qid: {**question, "instructions": f"{question['instructions']} #{next(fresh)}"}
                             for qid, question in request["questions"].items()}
                return processor.prepare({**request, "questions": questions})

            prepared = processor.prepare(request)
            outputs = fake_outputs(list(prepared.calls), rng)
            calls += [
                ({**ident, "case": "validate"}, lambda request=request: parse_request(request)),
                ({**ident, "case": "tokenize state"}, lambda text=decision.state_text: tokenizer.encode(text)),
                ({**ident, "case": "build rows"}, rows),
                ({**ident, "case": "collate"}, collated),
                ({**ident, "case": "prepare"}, lambda request=request: processor.prepare(request)),
                ({**ident, "case": "prepare cold"}, prepare_cold),
                ({**ident, "case": "finish"}, lambda prepared=prepared, outputs=outputs: processor.finish(prepared, outputs)),
            ]
            if kind != "1q":
                continue
            calls.append(({**ident, "case": "tokenize new state"},
                          lambda texts=new_words(decision.state_text, texts_per_case): tokenizer.encode(next(texts))))
            (item,) = prepared.calls
            for route, adapter in adapters.items():
                if route == "cpu":
                    calls.append(({**ident, "case": "adapter put", "route": route},
                                  lambda adapter=adapter, item=item: (adapter.group(item), adapter.footprint(item))))
                for n in PACK_ITEMS:
                    items = [item] * n
                    packed = adapter.pack(items)
                    graph_outputs = {"logits": rng.normal(0, 2, packed["marker_pos"].shape).astype(np.float32),
                                     "act_logits": rng.normal(0, 2, (len(packed["qtype"]), 2)).astype(np.float32)}
                    pack_ident = {**ident, "route": route, "items": n}
                    calls.append(({**pack_ident, "case": f"adapter pack {n}"},
                                  lambda adapter=adapter, items=items: adapter.pack(items)))
                    calls.append(({**pack_ident, "case": f"adapter unpack {n}"},
                                  lambda adapter=adapter, items=items, out=graph_outputs: adapter.unpack(out, items)))
    return calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], help="synthetic checkpoint sizes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calls", type=int, default=400, help="timed calls per stage and round")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import omnigraph

    texts_per_case = args.rounds * (args.calls + WARMUP)
    calls = [entry for size in args.sizes for entry in stage_calls(size, args.seed, harness, texts_per_case)]
    samples = [Samples() for _ in calls]
    for _ in range(args.rounds):
        for (_, call), stage in zip(calls, samples):
            stage.time_round(call, args.calls)
    identity = {
        "cpu": harness._device_name("cpu"), "cores": os.cpu_count(), "versions": harness._versions(),
        "omnigraph_path": str(Path(omnigraph.__file__).parent),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["benchmarks/laya_host.py", *(argv if argv is not None else sys.argv[1:])]),
        "python": platform.python_version(), "load_average": os.getloadavg()[0],
    }
    rows = []
    for (ident, _), stage in zip(calls, samples):
        value = float(np.median(np.concatenate(stage.wall_us)))
        cpu = float(np.median(stage.cpu_us))
        common = {"calls": sum(map(len, stage.wall_us)), "seed": args.seed, **identity}
        rows.append({**ident, "metric": "median_us", "value": round(value, 2), "unit": "us",
                     "round_median_us": [round(float(np.median(r)), 2) for r in stage.wall_us], **common})
        rows.append({**ident, "metric": "cpu_us", "value": round(cpu, 2), "unit": "us",
                     "round_cpu_us": [round(r, 2) for r in stage.cpu_us], **common})
        if "items" in ident:
            rows.append({**ident, "metric": "median_us_per_row", "value": round(value / ident["items"], 2),
                         "unit": "us", **common})

    print(f"{'size':<6} {'tokens':>6} {'req':<3} {'case':<18} {'route':<10} {'median_us':>10} {'cpu_us':>8} "
          f"{'per_row':>8}  rounds (median us)")
    cpu_of = {id(row): next_row["value"] for row, next_row in zip(rows, rows[1:]) if next_row["metric"] == "cpu_us"}
    for row in rows:
        if row["metric"] != "median_us":
            continue
        per_row = f"{row['value'] / row['items']:.2f}" if "items" in row else ""
        print(f"{row['size']:<6} {row['tokens']:>6} {row['request']:<3} {row['case']:<18} {row.get('route', ''):<10} "
              f"{row['value']:>10.2f} {cpu_of[id(row)]:>8.2f} {per_row:>8}  {row['round_median_us']}")
    if args.json is not None:
        harness.write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
