"""HTTP throughput and latency: `omnigraph serve` against `laya-serve` on the same checkpoint.

The servers run on 127.0.0.1 at once, over the same synthetic checkpoint (`small` by default):
`omnigraph serve --bundle` on its exported bundle, the same bundle as two single-threaded
replicas through a deploy YAML ("omnigraph 2x1"), and `laya-serve` on the checkpoint folder
through `LAYA_EXTRA_MODELS`. For each concurrency, closed-loop clients send the same decision
request to each server in turn, for a fixed time each. Rows: median / p99 latency and requests/s
per server, each omnigraph / laya-serve throughput ratio, and whether the servers gave equal
answers (probabilities within 1e-3).

    python benchmarks/http_load.py --json benchmarks/results/http-load-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Iterator

import httpx

try:
    from benchmarks.machine import cpu_name
    from benchmarks.processes import stop_process_group
except ImportError:  # run as a script: this folder is sys.path[0]
    from machine import cpu_name
    from processes import stop_process_group

REQUEST = {
    "state": "Hi, I was charged twice for my March invoice. Please refund the duplicate charge "
             "and tell me when the money will be back on my card.",
    "questions": {
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        "team": {"type": "choice", "instructions": "Which team should handle this?",
                 "criteria": {"billing": "payments and invoices", "support": "product problems",
                              "sales": "new purchases"}},
        "urgency": {"type": "score", "instructions": "How urgent is this?",
                    "criteria": ["not urgent", "somewhat urgent", "urgent"]},
    },
}
ANSWER_TOLERANCE = 1e-3
# "omnigraph 2x1": the same bundle as two single-threaded worker replicas (ORT's default is one
# session using every core, which oversubscribes a 2-core machine once requests overlap).
TUNED_PLAN = """\
pipeline: laya
max_queued_requests: 64
stages:
  - stage_id: 0
    num_replicas: 2
    backend:
      name: external.graph.v1
      manifest: {manifest}
      route: {{name: local-cpu, interpreter: {python}, ep: cpu, intra_op_num_threads: 1}}
"""


@dataclass(frozen=True)
class ServerCase:
    """How to start one server under test; its port goes to `--port`, or to `port_env` when set."""

    command: tuple[str, ...]
    env: dict[str, str]
    ready_path: str
    body: dict
    port_env: str | None = None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _bundle_for(size: str) -> tuple[Path, Path]:
    """The synthetic checkpoint of `size` and its fp32 bundle, both built once into the cache."""
    from omnigraph.pipelines.laya.export import cached_bundle
    from omnigraph.pipelines.laya.synth import cached_checkpoint

    checkpoint = cached_checkpoint(size)
    return checkpoint, cached_bundle(checkpoint)


@contextmanager
def _server(command: list[str], env: dict[str, str], port: int, ready_path: str, log: Path) -> Iterator[str]:
    """Start a server, wait until `ready_path` answers 200, stop it afterwards."""
    base = f"http://127.0.0.1:{port}"
    with log.open("w") as log_file:
        process = subprocess.Popen(command, env={**os.environ, **env}, stdout=log_file, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"{command[0]} exited with {process.returncode}; see {log}")
                try:
                    if httpx.get(f"{base}{ready_path}", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{command[0]} did not become ready in 600 s; see {log}")
                time.sleep(0.5)
            yield base
        finally:
            stop_process_group(process)


async def _load(base: str, body: dict, concurrency: int, seconds: float) -> dict[str, float]:
    """Closed-loop load: `concurrency` clients, each sending the next request when its last one answered."""
    latencies: list[float] = []
    failures = 0
    stop_at = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        async def one_client() -> None:
            nonlocal failures
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                response = await client.post("/v1/systemone", json=body)
                if response.status_code == 200:
                    latencies.append(time.perf_counter() - started)
                else:
                    failures += 1

        began = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - began
    latencies.sort()
    return {"median_latency_ms": 1000 * statistics.median(latencies),
            "p99_latency_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "requests_per_s": len(latencies) / elapsed, "requests": len(latencies), "failures": failures}


def _core(answers: dict) -> dict:
    keep = ("type", "choice", "score", "noul", "probabilities")
    return {qid: {key: answer[key] for key in keep if key in answer} for qid, answer in answers.items()}


def _equal_answers(left: dict, right: dict) -> bool:
    def close(a: Any, b: Any) -> bool:
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            return abs(a - b) <= ANSWER_TOLERANCE
        return a == b
    return close(_core(left), _core(right))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=("tiny", "small"), help="synthetic checkpoint size")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--seconds", type=float, default=15.0, help="load time per server and concurrency")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)

    checkpoint, bundle = _bundle_for(args.size)
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    tuned_plan = logs / "bench-http-omnigraph-2x1.yaml"
    tuned_plan.write_text(TUNED_PLAN.format(manifest=bundle / "manifest.json", python=sys.executable))
    omnigraph = [sys.executable, "-m", "omnigraph.plugin.cli", "serve"]
    # laya-serve has no request deadline; omnigraph's gets the same room as the client's timeout.
    no_deadline = {"OMNIGRAPH_REQUEST_DEADLINE_S": "120"}
    cases = {
        "omnigraph": ServerCase((*omnigraph, "--bundle", str(bundle)), no_deadline, "/ready", REQUEST),
        "omnigraph 2x1": ServerCase((*omnigraph, "--deploy-config", str(tuned_plan)), no_deadline, "/ready", REQUEST),
        "laya-serve": ServerCase((str(Path(sys.executable).with_name("laya-serve")),),
                                 {"LAYA_EXTRA_MODELS": json.dumps({"english": str(checkpoint)}),
                                  "LAYA_MODELS": "english", "LAYA_HOST": "127.0.0.1", "LAYA_LOG_LEVEL": "warning",
                                  "LAYA_MAX_CONCURRENT": "256"},
                                 "/health", {**REQUEST, "model": "english"}, port_env="LAYA_PORT"),
    }
    measured: dict[str, dict[int, dict[str, float]]] = {name: {} for name in cases}
    answers: dict[str, dict] = {}
    with ExitStack() as running:
        bases = {}
        for name, case in cases.items():
            port = _free_port()
            command = [*case.command] if case.port_env else [*case.command, "--port", str(port)]
            env = {**case.env, case.port_env: str(port)} if case.port_env else case.env
            log = logs / f"bench-http-{name.replace(' ', '-')}.log"
            bases[name] = running.enter_context(_server(command, env, port, case.ready_path, log))
            answers[name] = httpx.post(f"{bases[name]}/v1/systemone", json=case.body,
                                       timeout=60).raise_for_status().json()["answers"]
            asyncio.run(_load(bases[name], case.body, 1, 2.0))  # warm the server and the client
        # All servers stay up and take turns per concurrency, so a busy machine weighs on each alike.
        for concurrency in args.concurrency:
            for name, case in cases.items():
                measured[name][concurrency] = asyncio.run(_load(bases[name], case.body, concurrency, args.seconds))

    identity = {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                "versions": {package: version(package) for package in ("omnigraph", "onnxruntime", "laya", "torch")},
                "load_average_1m": os.getloadavg()[0], "checkpoint": f"synthetic {args.size}",
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": " ".join(["python", sys.argv[0], *(argv if argv is not None else sys.argv[1:])])}
    rows = []
    units = {"median_latency_ms": "ms", "p99_latency_ms": "ms", "requests_per_s": "1/s", "requests": "count",
             "failures": "count"}
    for name, by_concurrency in measured.items():
        for concurrency, values in by_concurrency.items():
            for metric, value in values.items():
                rows.append({"case": f"{name} c={concurrency}", "metric": metric, "value": round(value, 3),
                             "unit": units[metric], **identity})
    equal = True
    for name in ("omnigraph", "omnigraph 2x1"):
        for concurrency in args.concurrency:
            ratio = measured[name][concurrency]["requests_per_s"] / measured["laya-serve"][concurrency]["requests_per_s"]
            rows.append({"case": f"{name}/laya-serve c={concurrency}", "metric": "throughput_ratio",
                         "value": round(ratio, 3), "unit": "x", **identity})
        same = _equal_answers(answers[name], answers["laya-serve"])
        rows.append({"case": f"{name} vs laya-serve", "metric": "equal_answers", "value": int(same), "unit": "bool",
                     **identity})
        equal = equal and same

    print(f"{'case':<34} {'metric':<18} {'value':>12} unit")
    for row in rows:
        print(f"{row['case']:<34} {row['metric']:<18} {row['value']:>12} {row['unit']}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
