"""Laya on the CPU (issue 4): omnigraph's pipeline end to end against laya's own predict path.

Both answer the same batch-1 requests on the same synthetic checkpoint (default `small`): one `noul`
question whose state is repeated until the row holds about 48 and 512 tokens (the actual counts are
reported). omnigraph runs `Omni(model="laya", bundle=...)` on its fp32 bundle (validation,
tokenization, admission, the graph worker, decoding); laya runs `agent.system_one(state, questions)`
(torch eager fp32). A third case runs the bundle's graph alone in an ONNX Runtime session of this
process (default options, as the worker's) on tensors of the request's shape, so the pipeline's
own cost is the difference. The three take turns in blocks of calls, so load from other processes
on the machine falls on all alike; rows give the median and p99 of each and the ratio of the
medians, and the answers of laya and omnigraph are compared after rounding.

The roofline rows say how far the graph can go: the multiply-accumulates it does at each length
(counted from the checkpoint's shapes) and ONNX Runtime's float32 MatMul rate on this machine
(a projection-shaped MatMul, same threads), whose ratio is the graph's floor.

    python benchmarks/laya_cpu.py --json benchmarks/results/laya-cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

try:
    from benchmarks import laya_gpu as harness
except ImportError:  # run as a script: this folder is sys.path[0]
    import laya_gpu as harness

TARGET_SPEEDUP = 2.0
ROUNDS = 4
# The MatMul timed for the machine's float32 rate: an encoder projection's shape at 512 tokens.
PEAK_MATMUL_SHAPE = (512, 384, 1536)


def graph_macs(config: Any, length: int, markers: int) -> int:
    """Multiply-accumulates of the decision graph (graph.DecisionGraph as exported) for one row of
    `length` tokens and `markers` option slots: projections, attention scores and context (local
    layers block-banded), the two head layers (the last for CLS and the markers only), the heads."""
    encoder = config.encoder
    d, width = encoder.hidden_size, encoder.intermediate_size
    half = encoder.sliding_window
    macs = 0
    for layer_type in encoder.layer_types:
        keys = length if layer_type == "full_attention" else min(length, 3 * half)
        rows = length if layer_type == "full_attention" else -(-length // half) * half
        macs += length * d * (3 * d + d + 2 * width) + length * width * d + 2 * rows * keys * d
    rows = 1 + markers
    full_layer = length * d * 3 * d + 2 * length * length * d + length * d * d + 2 * length * d * 4 * d
    last_layer = length * d * 2 * d + rows * d * d + 2 * rows * length * d + rows * d * d + 2 * rows * d * 4 * d
    heads = markers * (d * d + d) + (d + 4) * 256 + 256 * config.n_act
    return macs + (config.head_layers - 1) * full_layer + last_layer + heads


def matmul_rate(threads: int | None = None, repeats: int = 30) -> float:
    """ONNX Runtime's float32 MatMul rate (multiply-accumulates per second, the best of `repeats`)
    on PEAK_MATMUL_SHAPE, a constant right-hand side as the graph's weights are."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    m, k, n = PEAK_MATMUL_SHAPE
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((k, n), dtype=np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "matmul",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], [weight])
    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((m, k), dtype=np.float32)
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        session.run(None, {"x": x})
        best = min(best, time.perf_counter() - started)
    return m * k * n / best



def time_in_blocks(calls: dict[str, Callable[[], Any]], requests: int, warmup: int,
                   rounds: int = ROUNDS) -> dict[str, list[float]]:
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

    import numpy as np
    import onnxruntime as ort

    from omnigraph import Omni
    from omnigraph.bundles import verify_bundle
    from omnigraph.pipelines.laya.export import cached_bundle
    from omnigraph.pipelines.laya.graph import DecisionGraphConfig
    from omnigraph.pipelines.laya.sequence import BatchLayout
    from omnigraph.pipelines.laya.synth import cached_checkpoint

    checkpoint = cached_checkpoint(args.size, seed=args.seed)
    bundle = cached_bundle(checkpoint)
    lengths = harness.build_requests(checkpoint, tuple(args.lengths))
    agent = laya.load(str(checkpoint), device="cpu")
    config = DecisionGraphConfig.from_checkpoint(checkpoint)
    verified = verify_bundle(bundle)
    layout = verified.manifest.metadata.layout
    buckets = BatchLayout(max_len=layout["max_len"], length_multiple=layout["length_multiple"],
                          length_multiple_above_256=layout["length_multiple_above_256"])
    session = ort.InferenceSession(str(verified.graph_path), providers=["CPUExecutionProvider"])
    identity = {
        "cpu": harness._device_name("cpu"), "cores": os.cpu_count(), "checkpoint": f"synthetic {args.size} seed {args.seed}",
        "versions": harness._versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["benchmarks/laya_cpu.py", *(argv if argv is not None else sys.argv[1:])]),
        "python": platform.python_version(),
    }
    rows: list[dict[str, Any]] = []
    rate = matmul_rate()
    rows.append({"case": "onnxruntime MatMul", "metric": "float32_gmac_per_s", "value": round(rate / 1e9, 2),
                 "unit": "GMAC/s", "shape": list(PEAK_MATMUL_SHAPE), "tokens": PEAK_MATMUL_SHAPE[0],
                 "load_average": os.getloadavg()[0], **identity})
    with Omni(model="laya", bundle=bundle) as omni:
        for requests in lengths:
            state, questions = requests.timed["state"], requests.timed["questions"]
            request = requests.timed

            def omnigraph_call() -> dict:
                output = omni.generate([request])[0]
                if output.error is not None:
                    raise RuntimeError(output.error)
                return output.custom_output

            # The graph's own inputs for this request's shape: one row in its length bucket, the
            # noul question's 2 markers in their bucket.
            length, slots = buckets.length_bucket(requests.tokens), buckets.markers_bucket(2)
            tensors = {"input_ids": np.full((1, length), layout["pad_id"], dtype=np.int64),
                       "attention_mask": np.zeros((1, length), dtype=np.int64),
                       "marker_pos": np.arange(1, slots + 1, dtype=np.int64)[None, :],
                       "marker_mask": np.arange(slots)[None, :] < 2,
                       "qtype": np.array([layout["qtypes"].index("noul")], dtype=np.int64)}
            tensors["input_ids"][0, :requests.tokens] = layout["sep_id"]
            tensors["attention_mask"][0, :requests.tokens] = 1

            samples = time_in_blocks({"laya": lambda: agent.system_one(state, questions),
                                      "omnigraph": omnigraph_call,
                                      "omnigraph graph": lambda: session.run(None, tensors)},
                                     args.requests, args.warmup)
            # The machine's 1-minute load average as this length's timing ends (other processes'
            # load lands on every case alike, but slows torch's thread team more than ORT's).
            load = {"load_average": os.getloadavg()[0]}
            reference, ours = agent.system_one(state, questions), omnigraph_call()
            same = reference["answers"] == ours["answers"]
            medians = {}
            for engine, values in samples.items():
                medians[engine] = harness.percentile(values, 50) * 1000
                # Each round's median: a round far off the others was disturbed by other load.
                block = len(values) // ROUNDS
                rounds = [round(harness.percentile(values[i * block:(i + 1) * block], 50) * 1000, 1)
                          for i in range(ROUNDS)]
                for metric, value in (("p50_ms", medians[engine]), ("p99_ms", harness.percentile(values, 99) * 1000)):
                    rows.append({"case": engine, "metric": metric, "value": round(value, 3), "unit": "ms",
                                 "length": requests.length, "tokens": requests.tokens, "requests": len(values),
                                 "round_p50_ms": rounds, **load, **identity})
            macs = graph_macs(config, length, markers=2)
            rows.append({"case": "omnigraph graph", "metric": "graph_gmac", "value": round(macs / 1e9, 3),
                         "unit": "GMAC", "length": requests.length, "tokens": requests.tokens, **identity})
            rows.append({"case": "omnigraph graph", "metric": "floor_ms", "value": round(macs / rate * 1000, 3),
                         "unit": "ms", "length": requests.length, "tokens": requests.tokens,
                         "detail": "graph_gmac at the MatMul rate", **identity})
            rows.append({"case": "omnigraph vs laya", "metric": "speedup_p50", "unit": "x",
                         "value": round(medians["laya"] / medians["omnigraph"], 3), "goal": TARGET_SPEEDUP,
                         "status": "met" if medians["laya"] / medians["omnigraph"] >= TARGET_SPEEDUP else "missed",
                         "answers_equal": same, "length": requests.length, "tokens": requests.tokens, **load,
                         **identity})

    print(f"{'case':<20} {'metric':<18} {'tokens':>6} {'value':>10}  unit    load    status")
    for row in rows:
        print(f"{row['case']:<20} {row['metric']:<18} {row['tokens']:>6} {row['value']:>10}  {row['unit']:<6}  "
              f"{row.get('load_average', ''):<6.4}  {row.get('status', '')}"
              f"{'' if row.get('answers_equal', True) else '  ANSWERS DIFFER'}"
              f"{'  rounds ' + str(row['round_p50_ms']) if row['metric'] == 'p50_ms' else ''}")
    if args.json is not None:
        harness.write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
