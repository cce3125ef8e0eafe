"""What the engine adds per request: AsyncOmni end to end on a trivial one-stage graph, against the
bare in-process InferenceSession.run and the bare WorkerClient.run (the worker wire alone).

    python benchmarks/overhead.py [--json PATH] [--requests N]

Cases: concurrency 1 (one request at a time) and concurrency 32 (32 requests kept in flight on one
replica; latency then includes queueing behind the others, so throughput is the figure to read),
the latter also with cross-request batching (`batching: {max_batch_rows: 32}`: a free replica
merges every queued request into one worker call).
Target: AsyncOmni adds at most 100 us (median, concurrency 1) over the bare session on the 2-core
CPU machine; the table splits that into the wire's share and this engine's share.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort

from omnigraph import AsyncOmni
from omnigraph.bundles import pack_bundle
from omnigraph.pipelines.deploy import GRAPH_BACKEND, validate_deploy_config
from omnigraph.workers.client import WorkerClient
from omnigraph.workers.route import WorkerRoute

TARGET_ADDED_MEDIAN_US = 100.0
CONCURRENCY = 32


def trivial_bundle(folder: Path) -> Path:
    """y = x + 1 on a float32 [b, 16] tensor (sent as [1, 16]): the graph costs next to nothing, the
    path is all that is measured; its batch dim b lets requests be merged."""
    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["b", 16])
    y = oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["b", 16])
    one = onnx.numpy_helper.from_array(np.float32(1), "one")
    graph = oh.make_graph([oh.make_node("Add", ["x", "one"], ["y"])], "trivial", [x], [y], initializer=[one])
    folder.mkdir()
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=9), folder / "graph.onnx")
    np.savez(folder / "inputs.npz", x=np.zeros((1, 16), np.float32))
    return pack_bundle(folder, component="bench.trivial", example_inputs_file="inputs.npz").manifest_path


def stats(case: str, samples_us: np.ndarray, seconds: float, cpu_seconds: float) -> dict[str, float]:
    """Latency percentiles, throughput, and this process's CPU time per request (all its threads;
    not the worker process's): a figure that, unlike wall time, barely moves with machine load."""
    return {"case": case, "median_us": float(np.median(samples_us)), "p99_us": float(np.percentile(samples_us, 99)),
            "throughput_rps": len(samples_us) / seconds, "cpu_us": cpu_seconds / len(samples_us) * 1e6,
            "requests": len(samples_us)}


def bare_session(manifest: Path, requests: int, concurrency: int) -> dict[str, float]:
    session_options = ort.SessionOptions()
    session_options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(manifest.parent / "graph.onnx"), session_options, providers=["CPUExecutionProvider"])
    feed = {"x": np.zeros((1, 16), np.float32)}
    for _ in range(200):
        session.run(None, feed)
    samples = np.empty(requests)
    per_thread = requests // concurrency

    def worker(offset: int) -> None:
        for i in range(per_thread):
            start = time.perf_counter_ns()
            session.run(None, feed)
            samples[offset + i] = (time.perf_counter_ns() - start) / 1000.0

    started, cpu = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=worker, args=(t * per_thread,)) for t in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return stats(f"bare InferenceSession.run c={concurrency}", samples[: per_thread * concurrency],
                 time.perf_counter() - started, time.process_time() - cpu)


def bare_worker(manifest: Path, requests: int) -> dict[str, float]:
    route = WorkerRoute(name="bench", interpreter=sys.executable, intra_op_num_threads=1)
    with WorkerClient.start(route, generation=1) as client:
        client.load(manifest)
        feed = {"x": np.zeros((1, 16), np.float32)}
        for i in range(200):
            client.run(feed, request_id=f"w{i}", stage_id=0, epoch=0)
        samples = np.empty(requests)
        started, cpu = time.perf_counter(), time.process_time()
        for i in range(requests):
            t0 = time.perf_counter_ns()
            client.run(feed, request_id=f"r{i}", stage_id=0, epoch=0)
            samples[i] = (time.perf_counter_ns() - t0) / 1000.0
        return stats("bare WorkerClient.run c=1", samples, time.perf_counter() - started, time.process_time() - cpu)


async def async_omni(manifest: Path, requests: int, concurrency: int, max_batch_rows: int = 1) -> dict[str, float]:
    plan = validate_deploy_config({
        "pipeline": "bench-trivial",
        "stages": [{"stage_id": 0, "model_stage": "trivial", "final_output": True, "final_output_type": "tensors",
                    "batching": {"max_batch_rows": max_batch_rows},
                    "backend": {"name": GRAPH_BACKEND, "manifest": str(manifest),
                                "route": {"name": "bench", "interpreter": sys.executable, "intra_op_num_threads": 1}}}],
    })
    prompt = {"tensors": {"x": np.zeros((1, 16), np.float32)}}
    async with AsyncOmni(deploy_config=plan, max_queued_requests=CONCURRENCY) as omni:
        async def one(request_id: str) -> float:
            start = time.perf_counter_ns()
            async for _ in omni.generate(prompt, request_id=request_id):
                pass
            return (time.perf_counter_ns() - start) / 1000.0

        for i in range(200):
            await one(f"warm{i}")
        samples: list[float] = []
        per_client = requests // concurrency

        async def client(c: int) -> None:
            for i in range(per_client):
                samples.append(await one(f"c{c}-{i}"))

        (replica,) = omni.execution_plan["stages"][0]["replicas"]
        calls_before = replica["calls"]
        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(client(c) for c in range(concurrency)))
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        (replica,) = omni.execution_plan["stages"][0]["replicas"]
        batched = f" batched (max_batch_rows={max_batch_rows})" if max_batch_rows > 1 else ""
        result = stats(f"AsyncOmni.generate c={concurrency}{batched}", np.array(samples), elapsed, cpu)
        result["requests_per_call"] = len(samples) / (replica["calls"] - calls_before)
        return result


async def thread_round_trip(requests: int) -> dict[str, float]:
    """The floor of any design that runs a blocking worker call off the event loop: the loop hands
    an item to a dedicated thread (SimpleQueue) and the thread hands the answer back
    (call_soon_threadsafe), with no work in between. The engine's path makes exactly these hops."""
    import queue

    loop = asyncio.get_running_loop()
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def serve() -> None:
        while (future := inbox.get()) is not None:
            loop.call_soon_threadsafe(future.set_result, None)

    thread = threading.Thread(target=serve)
    thread.start()

    async def one() -> float:
        start = time.perf_counter_ns()
        future = loop.create_future()
        inbox.put(future)
        await future
        return (time.perf_counter_ns() - start) / 1000.0

    for _ in range(200):
        await one()
    started, cpu = time.perf_counter(), time.process_time()
    samples = np.array([await one() for _ in range(requests)])
    result = stats("loop -> thread -> loop hand-off, no work c=1", samples, time.perf_counter() - started,
                   time.process_time() - cpu)
    inbox.put(None)
    thread.join()
    return result


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="write the rows here as JSON")
    parser.add_argument("--requests", type=int, default=5000, help="requests per case")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="overhead-") as scratch:
        manifest = trivial_bundle(Path(scratch) / "trivial")
        results = [
            bare_session(manifest, args.requests, 1),
            bare_worker(manifest, args.requests),
            asyncio.run(async_omni(manifest, args.requests, 1)),
            asyncio.run(thread_round_trip(args.requests)),
            bare_session(manifest, args.requests, CONCURRENCY),
            asyncio.run(async_omni(manifest, args.requests, CONCURRENCY)),
            asyncio.run(async_omni(manifest, args.requests, CONCURRENCY, max_batch_rows=CONCURRENCY)),
        ]
    bare, wire, omni = results[0]["median_us"], results[1]["median_us"], results[2]["median_us"]
    added, wire_share, hops = omni - bare, wire - bare, results[3]["median_us"]
    meta = {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)),
            "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "python": platform.python_version(),
            "onnxruntime": ort.__version__, "numpy": np.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join([Path(sys.executable).name, *sys.argv])}
    rows = []
    for result in results:
        rows += [{"case": result["case"], "metric": "latency_median", "value": round(result["median_us"], 1), "unit": "us"},
                 {"case": result["case"], "metric": "latency_p99", "value": round(result["p99_us"], 1), "unit": "us"},
                 {"case": result["case"], "metric": "throughput", "value": round(result["throughput_rps"], 1), "unit": "req/s"},
                 {"case": result["case"], "metric": "controller_cpu", "value": round(result["cpu_us"], 1), "unit": "us/req"}]
        if "requests_per_call" in result:
            rows.append({"case": result["case"], "metric": "requests_per_worker_call",
                         "value": round(result["requests_per_call"], 2), "unit": "req/call"})
    rows += [
        {"case": "AsyncOmni vs bare session c=1", "metric": "added_median", "value": round(added, 1), "unit": "us",
         "target": TARGET_ADDED_MEDIAN_US, "met": added <= TARGET_ADDED_MEDIAN_US},
        {"case": "worker wire (WorkerClient.run vs session) c=1", "metric": "added_median", "value": round(wire_share, 1), "unit": "us"},
        {"case": "engine (AsyncOmni vs WorkerClient.run) c=1", "metric": "added_median", "value": round(omni - wire, 1), "unit": "us"},
        {"case": "engine (AsyncOmni vs WorkerClient.run) c=1", "metric": "added_controller_cpu",
         "value": round(results[2]["cpu_us"] - results[1]["cpu_us"], 1), "unit": "us/req"},
        {"case": "engine beyond its two thread hand-offs c=1", "metric": "added_median",
         "value": round(omni - wire - hops, 1), "unit": "us"},
    ]
    for row in rows:
        row.update(meta)
    print(f"{'case':<52} {'metric':<24} {'value':>10} unit")
    for row in rows:
        print(f"{row['case']:<52} {row['metric']:<24} {row['value']:>10} {row['unit']}")
    print(f"target: AsyncOmni adds <= {TARGET_ADDED_MEDIAN_US:g} us median at c=1: "
          f"{'met' if added <= TARGET_ADDED_MEDIAN_US else 'MISSED'} (1-min load average {meta['load_average_1min']})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
