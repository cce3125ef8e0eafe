"""What the engine adds per request: AsyncOmni end to end on a trivial one-stage graph, against the
bare in-process InferenceSession.run and the bare WorkerClient.run (the worker wire alone).

    python benchmarks/overhead.py [--json PATH] [--requests N] [--spin-wait-us US]

Cases: concurrency 1 (one request at a time) and concurrency 32 (32 requests kept in flight on one
replica; latency then includes queueing behind the others, so throughput is the figure to read),
the latter also with cross-request batching (`batching: {max_batch_rows: 32}`: a free replica
merges every queued request into one worker call).
`--compare A=TREE B=TREE` instead compares two code trees (each a folder holding an `omnigraph`
package, e.g. `git archive REV | tar -x -C TREE`) on one AsyncOmni case (`--concurrency`,
`--max-batch-rows`; `--in-process`: the replicas call an in-process session, so the engine is
measured without the wire): one long-lived process per tree, alternating blocks of requests round
by round, so both see the same moments of a shared machine; rows give each tree's medians and the
paired change (B - A) with the number of rounds in which B was lower / higher. `TREE@US` runs that
tree's worker route with `spin_wait_us` US (one tree twice compares two spin settings).

    python benchmarks/overhead.py --compare before=/tmp/before after=. --concurrency 32 --max-batch-rows 32

`--spin-wait-us` sets the worker route's `spin_wait_us` (how long the worker and its client poll
the socket before sleeping) for the worker cases; without it the route's default applies.
Target (issue 20): AsyncOmni adds at most 50 us (median, concurrency 1) over the bare session on
the 2-core CPU machine; the table splits that into the wire's share and this engine's share, and
gives two references: the loop -> thread -> loop hand-off alone (what a call through a replica's
thread costs with no work, as calls under load are made), and a loop-driven worker call through
the socket (how the batch-1 path waits for a call longer than the route's spin window; a lone
request's shorter call, as here, is polled for by the loop through the mailbox).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort

from omnigraph import AsyncOmni
from omnigraph.bundles import pack_bundle
from omnigraph.pipelines.deploy import GRAPH_BACKEND, DeployConfig, validate_deploy_config
from omnigraph.workers.client import WorkerClient
from omnigraph.workers.route import WorkerRoute

try:
    from benchmarks.machine import cpu_name
except ImportError:  # run as a script: this folder is sys.path[0]
    from machine import cpu_name

TARGET_ADDED_MEDIAN_US = 50.0  # issue 20
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


def route_fields(spin_wait_us: int | None) -> dict[str, Any]:
    """The benchmark's worker route (one ORT thread), with `spin_wait_us` where given."""
    fields: dict[str, Any] = {"name": "bench", "interpreter": sys.executable, "intra_op_num_threads": 1}
    if spin_wait_us is not None:
        fields["spin_wait_us"] = spin_wait_us
    return fields


def bare_worker(manifest: Path, requests: int, spin_wait_us: int | None, *,
                socket_only: bool = False) -> dict[str, float]:
    """WorkerClient.run back to back: the wire alone (`socket_only`: a route without the mailbox)."""
    route = WorkerRoute(**route_fields(spin_wait_us), **({"mailbox_bytes": 0} if socket_only else {}))
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
        case = "bare WorkerClient.run c=1" + (" socket route" if socket_only else "")
        return stats(case, samples, time.perf_counter() - started, time.process_time() - cpu)


async def loop_driven_worker(manifest: Path, requests: int) -> dict[str, float]:
    """The floor of a design without the replica thread: the event loop sends each call itself and
    its reply wakes the loop (the worker's socket in `loop.add_reader`; a mailbox doorbell is a
    semaphore no loop can wait on, so the route has none). No engine work at all: the wire, one
    loop wake-up and a future."""
    loop = asyncio.get_running_loop()
    feed = {"x": np.zeros((1, 16), np.float32)}
    with WorkerClient.start(WorkerRoute(**route_fields(None), mailbox_bytes=0), generation=1) as client:
        client.load(manifest)
        waiting: list[asyncio.Future] = []

        def reply_ready() -> None:
            outputs = client.result(time.monotonic())
            if outputs is not None:
                waiting.pop().set_result(outputs)

        loop.add_reader(client._sock.fileno(), reply_ready)
        try:
            async def one(request_id: str) -> float:
                start = time.perf_counter_ns()
                waiting.append(loop.create_future())
                client.submit(feed, request_id=request_id, stage_id=0, epoch=0)
                await waiting[0]
                return (time.perf_counter_ns() - start) / 1000.0

            for i in range(200):
                await one(f"w{i}")
            started, cpu = time.perf_counter(), time.process_time()
            samples = np.array([await one(f"r{i}") for i in range(requests)])
            return stats("loop-driven WorkerClient call c=1 socket route", samples, time.perf_counter() - started,
                         time.process_time() - cpu)
        finally:
            loop.remove_reader(client._sock.fileno())


def trivial_plan(manifest: Path, spin_wait_us: int | None, max_batch_rows: int) -> DeployConfig:
    """One stage on the trivial bundle, on the benchmark's route."""
    return validate_deploy_config({
        "pipeline": "bench-trivial",
        "stages": [{"stage_id": 0, "model_stage": "trivial", "final_output": True, "final_output_type": "tensors",
                    "batching": {"max_batch_rows": max_batch_rows},
                    "backend": {"name": GRAPH_BACKEND, "manifest": str(manifest),
                                "route": route_fields(spin_wait_us)}}],
    })


async def async_omni(manifest: Path, requests: int, concurrency: int, spin_wait_us: int | None,
                     max_batch_rows: int = 1) -> dict[str, float]:
    plan = trivial_plan(manifest, spin_wait_us, max_batch_rows)
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
    (call_soon_threadsafe), with no work in between: the two hops of a call through a replica's
    thread."""
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


async def serve_blocks(manifest: Path, concurrency: int, max_batch_rows: int, spin_wait_us: int | None,
                       in_process: bool) -> None:
    """A child of `--compare`: one AsyncOmni on the trivial bundle; for each line N read from
    stdin, N requests from `concurrency` closed-loop clients, answered by one JSON line
    [median latency us, requests/s, controller CPU us per request]. `in_process`: the replica
    calls an in-process InferenceSession instead of its worker (the engine without the wire)."""
    prompt = {"tensors": {"x": np.zeros((1, 16), np.float32)}}
    served = 0
    async with AsyncOmni(deploy_config=trivial_plan(manifest, spin_wait_us, max_batch_rows),
                         max_queued_requests=CONCURRENCY) as omni:
        if in_process:
            options = ort.SessionOptions()
            options.intra_op_num_threads = 1
            session = ort.InferenceSession(str(manifest.parent / "graph.onnx"), options,
                                           providers=["CPUExecutionProvider"])
            for replica in omni.runtime.stages[0].replicas:
                replica.client.run = lambda inputs, **_: {"y": session.run(None, dict(inputs))[0]}

        async def block(count: int) -> list[float]:
            nonlocal served
            latencies: list[float] = []

            async def client() -> None:
                nonlocal served
                for _ in range(count // concurrency):
                    served += 1
                    start = time.perf_counter_ns()
                    async for _ in omni.generate(prompt, request_id=f"r{served}"):
                        pass
                    latencies.append((time.perf_counter_ns() - start) / 1000.0)

            started, cpu = time.perf_counter(), time.process_time()
            await asyncio.gather(*(client() for _ in range(concurrency)))
            seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
            return [float(np.median(latencies)), len(latencies) / seconds, cpu / len(latencies) * 1e6]

        await block(300)
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
            print(json.dumps(await block(int(line))), flush=True)


def compare(trees: list[tuple[str, str]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Two code trees side by side: one long-lived `serve_blocks` child per tree (the tree first on PYTHONPATH),
    alternating blocks of `--block` requests for `--rounds` rounds (the order flips each round), so
    both see the same moments of a noisy machine; the rows compare them round by round."""
    command = [sys.executable, str(Path(__file__).resolve()), "--serve-blocks", "--concurrency", str(args.concurrency),
               "--max-batch-rows", str(args.max_batch_rows)]
    if args.in_process:
        command.append("--in-process")
    children = {}
    for label, tree in trees:
        tree, _, spin = tree.partition("@")  # TREE@US: this tree's route spins US microseconds
        spin = spin or (None if args.spin_wait_us is None else str(args.spin_wait_us))
        children[label] = subprocess.Popen(command + (["--spin-wait-us", spin] if spin else []), stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True, cwd="/",
                                           env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                               [str(Path(tree).resolve()), *filter(None, [os.environ.get("PYTHONPATH")])])})
    results: dict[str, list[list[float]]] = {label: [] for label in children}
    try:
        for label, child in children.items():
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the child for {label} did not start (exit status {child.wait()})")
        for round_ in range(args.rounds):
            for label in (list(children) if round_ % 2 == 0 else list(reversed(children))):
                children[label].stdin.write(f"{args.block}\n")
                children[label].stdin.flush()
                results[label].append(json.loads(children[label].stdout.readline()))
    finally:
        for child in children.values():
            child.stdin.close()
            child.wait()
    (a, tree_a), (b, tree_b) = trees
    case = (f"{b} vs {a} c={args.concurrency} max_batch_rows={args.max_batch_rows}"
            f"{' in-process session' if args.in_process else ''}")
    rows = []
    for label, tree in trees:
        blocks = np.array(results[label])
        for index, (metric, unit) in enumerate((("latency_median", "us"), ("throughput", "req/s"),
                                                ("controller_cpu", "us/req"))):
            rows.append({"case": f"{case}: {label}", "metric": metric, "value": round(float(np.median(blocks[:, index])), 1),
                         "unit": unit, "tree": tree, "rounds": args.rounds, "block": args.block})
    first, second = np.array(results[a]), np.array(results[b])
    for index, metric in ((0, "latency_median"), (2, "controller_cpu")):
        change = second[:, index] - first[:, index]
        rows.append({"case": case, "metric": f"paired_{metric}_change", "value": round(float(np.median(change)), 1),
                     "unit": "us", "rounds_lower": int((change < 0).sum()), "rounds": args.rounds})
    rows.append({"case": case, "metric": "paired_throughput_ratio",
                 "value": round(float(np.median(second[:, 1] / first[:, 1])), 3), "unit": "x",
                 "rounds_higher": int((second[:, 1] > first[:, 1]).sum()), "rounds": args.rounds})
    return rows


def report(rows: list[dict[str, Any]], args: argparse.Namespace, load_before: float) -> dict[str, Any]:
    """Add the run's identity to every row, print the table, write the JSON; the identity."""
    meta = {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)),
            "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "python": platform.python_version(),
            "onnxruntime": ort.__version__, "numpy": np.__version__,
            "spin_wait_us": WorkerRoute(**route_fields(args.spin_wait_us)).spin_wait_us,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join([Path(sys.executable).name, *sys.argv])}
    for row in rows:
        row.update(meta)
    print(f"{'case':<60} {'metric':<30} {'value':>10} unit")
    for row in rows:
        paired = next((f" ({row[key]}/{row['rounds']} rounds {key[7:]})" for key in ("rounds_lower", "rounds_higher")
                       if key in row), "")
        print(f"{row['case']:<60} {row['metric']:<30} {row['value']:>10} {row['unit']}{paired}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="write the rows here as JSON")
    parser.add_argument("--requests", type=int, default=5000, help="requests per case")
    parser.add_argument("--spin-wait-us", type=int, default=None,
                        help="the worker route's spin_wait_us (default: the route's default)")
    parser.add_argument("--compare", nargs=2, metavar="LABEL=TREE[@US]", default=None,
                        help="compare two code trees (folders holding an omnigraph package) in paired rounds")
    parser.add_argument("--concurrency", type=int, default=1, help="--compare: closed-loop clients")
    parser.add_argument("--max-batch-rows", type=int, default=1, help="--compare: the stage's max_batch_rows")
    parser.add_argument("--rounds", type=int, default=20, help="--compare: rounds (one block per tree each)")
    parser.add_argument("--block", type=int, default=1000, help="--compare: requests per block")
    parser.add_argument("--in-process", action="store_true",
                        help="--compare: replicas call an in-process session (the engine without the wire)")
    parser.add_argument("--serve-blocks", action="store_true", help=argparse.SUPPRESS)  # a --compare child
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="overhead-") as scratch:
        manifest = trivial_bundle(Path(scratch) / "trivial")
        if args.serve_blocks:
            asyncio.run(serve_blocks(manifest, args.concurrency, args.max_batch_rows, args.spin_wait_us,
                                     args.in_process))
            return 0
        if args.compare:
            trees = [tuple(spec.split("=", 1)) for spec in args.compare]
            if any(len(tree) != 2 for tree in trees):
                parser.error("--compare takes LABEL=TREE twice")
            report(compare(trees, args), args, load_before)  # type: ignore[arg-type]
            return 0
        results = [
            bare_session(manifest, args.requests, 1),
            bare_worker(manifest, args.requests, args.spin_wait_us),
            asyncio.run(async_omni(manifest, args.requests, 1, args.spin_wait_us)),
            asyncio.run(thread_round_trip(args.requests)),
            bare_worker(manifest, args.requests, args.spin_wait_us, socket_only=True),
            asyncio.run(loop_driven_worker(manifest, args.requests)),
            bare_session(manifest, args.requests, CONCURRENCY),
            asyncio.run(async_omni(manifest, args.requests, CONCURRENCY, args.spin_wait_us)),
            asyncio.run(async_omni(manifest, args.requests, CONCURRENCY, args.spin_wait_us, max_batch_rows=CONCURRENCY)),
        ]
    bare, wire, omni = results[0]["median_us"], results[1]["median_us"], results[2]["median_us"]
    added, wire_share = omni - bare, wire - bare
    loop_floor = results[5]["median_us"] - bare
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
        {"case": "floor without thread hand-offs (loop-driven socket call vs bare session) c=1",
         "metric": "added_median", "value": round(loop_floor, 1), "unit": "us"},
    ]
    meta = report(rows, args, load_before)
    print(f"target: AsyncOmni adds <= {TARGET_ADDED_MEDIAN_US:g} us median at c=1: "
          f"{'met' if added <= TARGET_ADDED_MEDIAN_US else 'MISSED'} (spin_wait_us {meta['spin_wait_us']}, "
          f"1-min load average {meta['load_average_1min']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
