"""Soak under faults: many keep-alive clients against a real `omnigraph serve` while workers die.

The script starts `omnigraph serve` on 127.0.0.1 (the embedded demo Laya; with `--replicas 2`,
the default, through a deploy YAML that runs its bundle as two single-threaded worker replicas,
restart budgets left at their defaults) with a `TMPDIR` of its own, so every worker process and
`omnigraph-worker-*` folder it finds belongs to this server. It then

1. answers a fixed, seeded set of distinct decision requests (choice / score / noul questions,
   string / object / list states, a few long ones) sequentially, twice: the first pass is the
   reference, the second checks that a quiet server repeats itself;
2. runs `--clients` closed-loop clients for `--seconds`, each on its own keep-alive connection,
   sending requests from that set; every 200 is checked bit for bit against the reference for its
   request (the parsed body: answers, usage and audit; question ids carry a per-send nonce, so an
   answer delivered to the wrong request or twice is seen). A 503 is retried after its
   `Retry-After` (at most 1 s), as a well-behaved client would;
3. meanwhile SIGKILLs one graph worker (a child of the server) every `--kill-every` seconds, and
   lets `--hangup-fraction` of the requests hang up, each on one of the set's long requests: half
   of them close the connection after the whole body (mid-call, up to 0.5 s later if no answer has
   come), half after half the body (mid-body);
4. samples the server's RSS, open fds and threads before and after the load, polls `/health` and
   `/ready` throughout, sends one request after the load, then stops the server with SIGTERM and
   counts the worker processes and `omnigraph-worker-*` folders left behind (and kills / removes
   them).

Lost: a request whose whole body was sent on a connection the client did not hang up, which got
no answer and no error status (a reset, a closed connection, or no answer within
`--client-timeout`). Exit status 1 if any request was lost, duplicated or answered wrong.

    .venv/bin/python benchmarks/soak.py --json benchmarks/results/soak-cpu.json
    .venv/bin/python benchmarks/soak.py --replicas 1                   # plain `omnigraph serve`
    .venv/bin/python benchmarks/soak.py --seconds 5 --clients 4        # a smoke run

Figures and the fault matrix they belong to: RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import importlib.metadata
import json
import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

try:
    from benchmarks import laya_gpu as harness
except ImportError:  # run as a script: this folder is sys.path[0]
    import laya_gpu as harness

REPO = Path(__file__).resolve().parent.parent
ROUTE = "/v1/systemone"
WORKER_MODULE = "omnigraph.workers.worker"
WORKER_DIR_PREFIX = "omnigraph-worker-"
NONCE_SEPARATOR = "@"
MAX_RETRY_AFTER_SLEEP_S = 1.0
MID_CALL_HANGUP_S = (0.002, 0.5)  # how long a mid-call hang-up waits for its answer before closing
MID_BODY_HANGUP_S = (0.0, 0.05)    # how long a mid-body hang-up holds its half body before closing
LONG_QUESTIONS = 16                 # every eighth request of the set has 16-32 questions
SETTLE_S = 3.0                      # after the load, before the end sample: let replacements start
RECOVERY_POLL_S = 0.5               # how often /health is asked while waiting for recovery after the load

REPLICA_PLAN = """\
pipeline: laya
stages:
  - stage_id: 0
    num_replicas: {replicas}
    backend:
      name: external.graph.v1
      manifest: {manifest}
      route: {{name: local-cpu, interpreter: {python}, ep: cpu, intra_op_num_threads: 1}}
"""

STATES: list[Any] = [
    "Hi, I was charged twice for my March invoice. Please refund the duplicate charge.",
    "The app crashes every time I open the settings page on my phone.",
    "Can I upgrade my plan to the team edition before the end of the month?",
    "My package says delivered but nothing arrived. The tracking number is 88213.",
    "I forgot my password and the reset email never comes.",
    "Please cancel my subscription, I am moving abroad and will not need it.",
    "Your support agent was very helpful yesterday, thank you!",
    "The invoice shows the wrong company address; we need a corrected copy for accounting.",
    {"ticket": 4411, "channel": "email", "text": "The export to CSV drops every row after 10,000."},
    {"customer": {"tier": "gold", "since": 2019}, "message": "Where is my refund? It has been three weeks."},
    ["user: hello, is anyone there?", "agent: yes, how can I help?", "user: my card was declined twice"],
    ["user: I want to buy 40 seats", "agent: for which product?", "user: the analytics suite, yearly"],
]
NOUL_QUESTIONS = [
    "Does the customer ask for a refund?", "Is the customer angry?", "Does the message mention a bug?",
    "Does the customer want to buy something?", "Is a human follow-up needed?", "Is this spam?",
]
CHOICE_QUESTIONS = [
    ("Which team should handle this?", {"billing": "payments and invoices", "support": "product problems",
                                        "sales": "new purchases", "logistics": "deliveries",
                                        "accounts": "logins and passwords", "none": "nothing to do"}),
    ("What is the best next action?", {"reply": "answer directly", "escalate": "hand to a specialist",
                                       "close": "nothing more to do", "refund": "start a refund"}),
    ("Which channel fits the answer?", ["email", "phone", "chat"]),
]
SCORE_QUESTIONS = [
    ("How urgent is this?", ["not urgent", "somewhat urgent", "urgent", "very urgent", "critical"]),
    ("How satisfied is the customer?", ["very unhappy", "unhappy", "neutral", "happy", "delighted"]),
    ("How complex is the request?", ["trivial", "simple", "involved", "hard"]),
]


# ----------------------------------------------------------------------------------------------
# The request set


def build_requests(count: int, seed: int) -> list[dict]:
    """`count` distinct decision requests, the same for the same seed; every eighth one is long."""
    rng = random.Random(seed)
    requests: list[dict] = []
    seen: set[str] = set()
    while len(requests) < count:
        long_one = len(requests) % 8 == 7
        questions: dict[str, dict] = {}
        for q in range(rng.randint(16, 32) if long_one else rng.randint(1, 4)):
            kind = rng.choice(("choice", "score", "noul"))
            if kind == "noul":
                questions[f"q{q}"] = {"type": "noul", "instructions": rng.choice(NOUL_QUESTIONS)}
            elif kind == "choice":
                text, criteria = rng.choice(CHOICE_QUESTIONS)
                if isinstance(criteria, dict):
                    keep = rng.sample(sorted(criteria), rng.randint(2, len(criteria)))
                    criteria = {label: criteria[label] for label in keep}
                questions[f"q{q}"] = {"type": "choice", "instructions": text, "criteria": criteria}
            else:
                text, levels = rng.choice(SCORE_QUESTIONS)
                questions[f"q{q}"] = {"type": "score", "instructions": text,
                                      "criteria": levels[:rng.randint(3, len(levels))]}
        request = {"state": rng.choice(STATES), "questions": questions}
        key = json.dumps(request, sort_keys=True)
        if key not in seen:
            seen.add(key)
            requests.append(request)
    return requests


def with_nonce(request: dict, nonce: str) -> bytes:
    """The request's body with every question id suffixed by `nonce` (ids do not reach the model)."""
    questions = {f"{qid}{NONCE_SEPARATOR}{nonce}": q for qid, q in request["questions"].items()}
    return json.dumps({"state": request["state"], "questions": questions}).encode()


def strip_nonce(value: Any, suffix: str) -> Any:
    """`value` with `suffix` taken off every object key that ends with it (answers, audit ids)."""
    if isinstance(value, dict):
        return {(k[: -len(suffix)] if isinstance(k, str) and k.endswith(suffix) else k): strip_nonce(v, suffix)
                for k, v in value.items()}
    if isinstance(value, list):
        return [strip_nonce(v, suffix) for v in value]
    return value


def answered_nonce(body: Any) -> str | None:
    """The nonce the answer's question ids carry (None if the body has no such answers)."""
    answers = body.get("answers") if isinstance(body, dict) else None
    if not isinstance(answers, dict) or not answers:
        return None
    nonces = {k.rpartition(NONCE_SEPARATOR)[2] for k in answers if isinstance(k, str) and NONCE_SEPARATOR in k}
    return nonces.pop() if len(nonces) == 1 else None


# ----------------------------------------------------------------------------------------------
# The server and its processes


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def worker_pids(marker: str) -> list[int]:
    """Live graph workers whose command line names `marker` (the server's own TMPDIR)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        cmdline = _read(f"/proc/{entry}/cmdline")
        if cmdline and WORKER_MODULE in cmdline and marker in cmdline:
            stat = _read(f"/proc/{entry}/stat")
            if stat and stat.rpartition(")")[2].split()[0] != "Z":
                found.append(int(entry))
    return sorted(found)


def process_sample(pid: int) -> dict[str, float] | None:
    """RSS (MiB), open fds and threads of `pid`, or None once it is gone."""
    status = _read(f"/proc/{pid}/status")
    if status is None:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024.0, "open_fds": fds,
            "threads": int(fields["Threads"].strip())}


@dataclass
class Server:
    process: subprocess.Popen
    base: str
    port: int
    tmpdir: Path
    log: Path


def start_server(args: argparse.Namespace, work: Path) -> Server:
    tmpdir = work / "tmp"
    tmpdir.mkdir()
    command = [sys.executable, "-m", "omnigraph.plugin.cli", "serve"]
    if args.replicas > 1:
        from omnigraph.pipelines.laya.export import default_bundle

        plan = work / "soak-plan.yaml"
        plan.write_text(REPLICA_PLAN.format(replicas=args.replicas, manifest=default_bundle() / "manifest.json",
                                            python=sys.executable))
        command += ["--deploy-config", str(plan)]
    port = _free_port()
    command += ["--host", "127.0.0.1", "--port", str(port)]
    log = work / "server.log"
    with log.open("wb") as log_file:
        process = subprocess.Popen(command, env={**os.environ, "TMPDIR": str(tmpdir)}, stdin=subprocess.DEVNULL,
                                   stdout=log_file, stderr=subprocess.STDOUT)
    server = Server(process, f"http://127.0.0.1:{port}", port, tmpdir, log)
    deadline = time.monotonic() + args.startup_timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"omnigraph serve exited with {process.returncode} before it was ready; see {log}")
        try:
            if httpx.get(f"{server.base}/ready", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            stop_server(server, 10)
            raise RuntimeError(f"omnigraph serve was not ready after {args.startup_timeout:g} s; see {log}")
        time.sleep(0.25)


def stop_server(server: Server, timeout: float) -> tuple[float, int | None]:
    """SIGTERM, then wait; SIGKILL past `timeout`. Returns (seconds to exit, exit status or None if killed)."""
    started = time.monotonic()
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
    try:
        code: int | None = server.process.wait(timeout)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
        code = None
    return time.monotonic() - started, code


# ----------------------------------------------------------------------------------------------
# The load


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    refused: collections.Counter = field(default_factory=collections.Counter)  # "503", "504"
    refused_without_retry_after: int = 0
    reasons: collections.Counter = field(default_factory=collections.Counter)  # "503: queue full (...)"
    other_status: collections.Counter = field(default_factory=collections.Counter)
    lost: collections.Counter = field(default_factory=collections.Counter)  # by exception kind
    connect_failed: int = 0
    duplicated: int = 0
    wrong: int = 0
    wrong_examples: list[str] = field(default_factory=list)
    hangups: collections.Counter = field(default_factory=collections.Counter)
    latencies: list[float] = field(default_factory=list)
    answered_nonces: set[str] = field(default_factory=set)
    kills: int = 0
    kills_skipped: int = 0
    workers_seen: set[int] = field(default_factory=set)
    health: collections.Counter = field(default_factory=collections.Counter)
    peak: dict[str, float] = field(default_factory=dict)


def check_answer(tally: Tally, response: httpx.Response, nonce: str, reference: dict) -> None:
    try:
        body = response.json()
    except ValueError:
        tally.wrong += 1
        _example(tally, f"{nonce}: 200 with a body that is not JSON: {response.content[:120]!r}")
        return
    carried = answered_nonce(body)
    if carried != nonce:
        if carried is not None and carried in tally.answered_nonces:
            tally.duplicated += 1
            _example(tally, f"{nonce}: answered with the answer of {carried}, already delivered")
        else:
            tally.wrong += 1
            _example(tally, f"{nonce}: answered with question ids of {carried!r}")
        return
    tally.answered_nonces.add(nonce)
    if strip_nonce(body, NONCE_SEPARATOR + nonce) != reference:
        tally.wrong += 1
        _example(tally, f"{nonce}: differs from the reference: {json.dumps(body)[:300]}")


def _example(tally: Tally, text: str) -> None:
    if len(tally.wrong_examples) < 5:
        tally.wrong_examples.append(text)


async def hang_up(host: str, port: int, body: bytes, kind: str, rng: random.Random, tally: Tally) -> None:
    """One request on a fresh connection that is closed before its answer (or before its body ends)."""
    head = (f"POST {ROUTE} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        tally.connect_failed += 1
        return
    try:
        if kind == "mid_body":
            writer.write(head + body[: len(body) // 2])
            await writer.drain()
            await asyncio.sleep(rng.uniform(*MID_BODY_HANGUP_S))
        else:
            writer.write(head + body)
            await writer.drain()
            try:
                first = await asyncio.wait_for(reader.read(1), rng.uniform(*MID_CALL_HANGUP_S))
                if first:
                    kind = "answered_before_hangup"
            except TimeoutError:
                pass
        tally.hangups[kind] += 1
    except OSError:
        tally.hangups[f"{kind}_reset"] += 1
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        except (OSError, TimeoutError):
            pass


async def client(index: int, http: httpx.AsyncClient, server: Server, requests: list[dict], references: list[dict],
                 stop_at: float, args: argparse.Namespace, tally: Tally) -> None:
    rng = random.Random(args.seed * 100_003 + index)
    async with http:
        sequence = 0
        while time.monotonic() < stop_at:
            which = rng.randrange(len(requests))
            nonce = f"c{index}.{sequence}"
            sequence += 1
            body = with_nonce(requests[which], nonce)
            if rng.random() < args.hangup_fraction:
                # A hang-up takes one of the long requests (when the set has any): its call runs longest.
                long_ones = [i for i, r in enumerate(requests) if len(r["questions"]) >= LONG_QUESTIONS]
                body = with_nonce(requests[rng.choice(long_ones) if long_ones else which], nonce)
                kind = "mid_call" if rng.random() < 0.5 else "mid_body"
                await hang_up("127.0.0.1", server.port, body, kind, rng, tally)
                continue
            started = time.monotonic()
            try:
                response = await http.post(ROUTE, content=body, headers={"content-type": "application/json"})
            except httpx.ConnectError:
                tally.connect_failed += 1
                await asyncio.sleep(0.1)
                continue
            except httpx.TimeoutException:
                tally.sent += 1
                tally.lost["timeout"] += 1
                continue
            except httpx.TransportError as exc:
                tally.sent += 1
                tally.lost[type(exc).__name__] += 1
                continue
            tally.sent += 1
            status = response.status_code
            if status == 200:
                tally.answered += 1
                tally.latencies.append(time.monotonic() - started)
                check_answer(tally, response, nonce, references[which])
            elif status in (503, 504):
                tally.refused[str(status)] += 1
                tally.reasons[f"{status}: {_reason(response)}"] += 1
                retry_after = response.headers.get("retry-after")
                if status == 503:
                    if retry_after is None:
                        tally.refused_without_retry_after += 1
                    else:
                        try:
                            await asyncio.sleep(min(float(retry_after), MAX_RETRY_AFTER_SLEEP_S))
                        except ValueError:
                            tally.refused_without_retry_after += 1
            else:
                tally.other_status[str(status)] += 1
                tally.reasons[f"{status}: {_reason(response)}"] += 1


def _reason(response: httpx.Response) -> str:
    """An error body's message with its numbers blanked, so refusals group by cause."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    text = detail if isinstance(detail, str) else response.text
    text = re.sub(r"\b(sys|req)-\S+", "ID", text)
    return re.sub(r"\d+(\.\d+)?", "N", text)[:120]


def _sample_peak(tally: Tally, server: Server) -> None:
    sample = process_sample(server.process.pid)
    for key, value in (sample or {}).items():
        tally.peak[key] = max(tally.peak.get(key, value), value)


async def injector(server: Server, stop_at: float, args: argparse.Namespace, tally: Tally) -> None:
    """SIGKILL one worker every `--kill-every` s; poll /health, /ready and the server's resources meanwhile."""
    rng = random.Random(args.seed + 7)
    marker = str(server.tmpdir)
    next_kill = time.monotonic() + args.kill_every if args.kill_every > 0 else float("inf")
    async with httpx.AsyncClient(base_url=server.base, timeout=5) as http:
        while time.monotonic() < stop_at:
            pids = worker_pids(marker)
            tally.workers_seen.update(pids)
            _sample_peak(tally, server)
            if time.monotonic() >= next_kill:
                next_kill += args.kill_every
                if pids:
                    try:
                        os.kill(rng.choice(pids), signal.SIGKILL)
                        tally.kills += 1
                    except ProcessLookupError:
                        tally.kills_skipped += 1
                else:
                    tally.kills_skipped += 1
            for path in ("/health", "/ready"):
                try:
                    tally.health[f"{path[1:]}_{(await http.get(path)).status_code}"] += 1
                except httpx.HTTPError as exc:
                    tally.health[f"{path[1:]}_{type(exc).__name__}"] += 1
            await asyncio.sleep(0.5)


async def run_load(server: Server, requests: list[dict], references: list[dict], args: argparse.Namespace,
                   tally: Tally) -> float:
    # Each client has its own connection; they are made before the clock starts, and share one TLS
    # context (httpx builds one per client otherwise: 3 s of CPU for 64 clients, unused over http).
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    tls = ssl.create_default_context()
    https = [httpx.AsyncClient(base_url=server.base, timeout=args.client_timeout, limits=limits, verify=tls)
             for _ in range(args.clients)]
    began = time.monotonic()
    stop_at = began + args.seconds
    await asyncio.gather(injector(server, stop_at, args, tally),
                         *(client(i, http, server, requests, references, stop_at, args, tally)
                           for i, http in enumerate(https)))
    return time.monotonic() - began


# ----------------------------------------------------------------------------------------------
# Report


def _metrics_value(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and labels in line and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] == name:
                total += float(value)
    return total


def _percentile(samples: list[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def _identity(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    versions = harness._versions()
    for dist in ("httpx", "uvicorn", "fastapi"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], check=False,
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "omnigraph"], check=False,
                           capture_output=True, text=True).stdout.strip()
    return {"cpu": harness._device_name("cpu"), "cores": os.cpu_count(), "versions": versions,
            "commit": commit or None, "uncommitted_engine_changes": bool(dirty), "load_average_1m": round(os.getloadavg()[0], 2),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join(["benchmarks/soak.py", *(argv if argv is not None else sys.argv[1:])]),
            "config": {"clients": args.clients, "seconds": args.seconds, "kill_every_s": args.kill_every,
                       "hangup_fraction": args.hangup_fraction, "replicas": args.replicas,
                       "requests": args.requests, "seed": args.seed}}


def good_after_load(rows: list[tuple[str, str, float, str]]) -> bool:
    return any(case == "after" and metric == "good_request_answered" and value == 1 for case, metric, value, _ in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64, help="concurrent keep-alive clients")
    parser.add_argument("--seconds", type=float, default=60.0, help="load time")
    parser.add_argument("--kill-every", type=float, default=10.0, help="SIGKILL a worker this often (0: never)")
    parser.add_argument("--hangup-fraction", type=float, default=0.02,
                        help="share of requests that hang up (half mid-call, half mid-body)")
    parser.add_argument("--replicas", type=int, default=2,
                        help="graph worker replicas (1: plain `omnigraph serve`, no deploy YAML)")
    parser.add_argument("--requests", type=int, default=24, help="distinct requests in the set")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client-timeout", type=float, default=60.0,
                        help="seconds a client waits for an answer before it counts the request lost")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--recovery-timeout", type=float, default=0.0,
                        help="after the load, wait up to this long for /health 200 (a crash loop backs off)")
    parser.add_argument("--keep-log", action="store_true", help="keep the server's log even if all went well")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.seconds <= 0 or not 0 <= args.hangup_fraction <= 1 or args.replicas < 1:
        parser.error("--clients and --replicas must be >= 1, --seconds > 0, --hangup-fraction in [0, 1]")

    requests = build_requests(args.requests, args.seed)
    work = Path(tempfile.mkdtemp(prefix="omnigraph-soak-"))
    try:
        server = start_server(args, work)
    except RuntimeError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    tally = Tally()
    rows: list[tuple[str, str, float, str]] = []
    clean = False
    try:
        # 1. The reference, and a second quiet pass that must repeat it.
        references: list[dict] = []
        unstable = 0
        with httpx.Client(base_url=server.base, timeout=args.client_timeout) as http:
            for index, request in enumerate(requests):
                nonce = f"ref{index}"
                response = http.post(ROUTE, content=with_nonce(request, nonce),
                                     headers={"content-type": "application/json"})
                if response.status_code != 200:
                    raise RuntimeError(f"reference request {index} got {response.status_code}: {response.text[:300]}")
                references.append(strip_nonce(response.json(), NONCE_SEPARATOR + nonce))
            for index, request in enumerate(requests):
                nonce = f"chk{index}"
                response = http.post(ROUTE, content=with_nonce(request, nonce),
                                     headers={"content-type": "application/json"})
                if response.status_code != 200 or strip_nonce(response.json(),
                                                               NONCE_SEPARATOR + nonce) != references[index]:
                    unstable += 1
        marker = str(server.tmpdir)
        workers_start = len(worker_pids(marker))
        start = process_sample(server.process.pid) or {}

        # 2-3. The load, with kills and hang-ups.
        elapsed = asyncio.run(run_load(server, requests, references, args, tally))

        # 4. After the load.
        time.sleep(SETTLE_S)
        end = process_sample(server.process.pid) or {}
        workers_end = len(worker_pids(marker))
        health_end = ready_end = -1  # -1: no answer (the server is gone)
        good_after = 0
        metrics = ""
        healthy_after_s = -1.0  # -1: not healthy within --recovery-timeout
        try:
            with httpx.Client(base_url=server.base, timeout=args.client_timeout) as http:
                settled = time.monotonic()
                health_end = http.get("/health").status_code
                while health_end != 200 and time.monotonic() - settled < args.recovery_timeout:
                    time.sleep(RECOVERY_POLL_S)
                    health_end = http.get("/health").status_code
                if health_end == 200:
                    healthy_after_s = round(time.monotonic() - settled, 1)
                ready_end = http.get("/ready").status_code
                after = http.post(ROUTE, content=with_nonce(requests[0], "after"),
                                  headers={"content-type": "application/json"})
                good_after = int(after.status_code == 200
                                 and strip_nonce(after.json(), NONCE_SEPARATOR + "after") == references[0])
                metrics = http.get("/metrics").text
        except httpx.HTTPError as exc:
            print(f"soak: after the load: {type(exc).__name__}: {exc}", file=sys.stderr)
        exit_s, exit_code = stop_server(server, 30)
        time.sleep(0.5)
        left_pids = worker_pids(marker)
        left_dirs = sorted(server.tmpdir.glob(f"{WORKER_DIR_PREFIX}*"))

        lost = sum(tally.lost.values())
        rows += [
            ("reference", "distinct_requests", len(requests), "count"),
            ("reference", "unstable_on_repeat", unstable, "count"),
            ("load", "sent", tally.sent, "count"),
            ("load", "answered", tally.answered, "count"),
            ("load", "answered_per_s", round(tally.answered / elapsed, 1), "1/s"),
            ("load", "p50_latency_ms", round(1000 * _percentile(tally.latencies, 50), 1), "ms"),
            ("load", "p99_latency_ms", round(1000 * _percentile(tally.latencies, 99), 1), "ms"),
            ("load", "refused_503", tally.refused["503"], "count"),
            ("load", "refused_504", tally.refused["504"], "count"),
            ("load", "refused_503_without_retry_after", tally.refused_without_retry_after, "count"),
            *[("load", f"status_{code}", n, "count") for code, n in sorted(tally.other_status.items())],
            ("load", "lost", lost, "count"),
            *[("load", f"lost_{kind}", n, "count") for kind, n in sorted(tally.lost.items())],
            ("load", "connect_failed", tally.connect_failed, "count"),
            ("load", "duplicated", tally.duplicated, "count"),
            ("load", "wrong", tally.wrong, "count"),
            *[("load", f"hangup_{kind}", n, "count") for kind, n in sorted(tally.hangups.items())],
            *[("reason", reason, n, "count") for reason, n in tally.reasons.most_common()],
            ("faults", "worker_kills", tally.kills, "count"),
            ("faults", "worker_kills_skipped", tally.kills_skipped, "count"),
            ("faults", "worker_pids_seen", len(tally.workers_seen), "count"),
            ("faults", "workers_replaced", len(tally.workers_seen) - workers_start, "count"),
            *[("faults", f"polls_{code}", n, "count") for code, n in sorted(tally.health.items())],
            ("after", "health_status", health_end, "http"),
            ("after", "seconds_to_healthy", healthy_after_s, "s"),
            ("after", "ready_status", ready_end, "http"),
            ("after", "good_request_answered", good_after, "bool"),
            ("after", "metrics_client_disconnects", _metrics_value(metrics, "omnigraph_client_disconnects_total"),
             "count"),
            ("after", "metrics_route_500s", _metrics_value(metrics, "omnigraph_http_requests_total",
                                                             'status="500"'), "count"),
        ]
        for key, unit in (("rss_mib", "MiB"), ("open_fds", "count"), ("threads", "count")):
            if key in start and key in end:
                rows += [("server", f"{key}_start", round(start[key], 1), unit),
                         ("server", f"{key}_end", round(end[key], 1), unit),
                         ("server", f"{key}_peak", round(tally.peak.get(key, end[key]), 1), unit),
                         ("server", f"{key}_drift", round(end[key] - start[key], 1), unit)]
        rows += [
            ("server", "workers_start", workers_start, "count"),
            ("server", "workers_end", workers_end, "count"),
            ("exit", "seconds_to_exit", round(exit_s, 2), "s"),
            ("exit", "exit_status", -1 if exit_code is None else exit_code, "code"),
            ("exit", "worker_processes_left", len(left_pids), "count"),
            ("exit", "worker_folders_left", len(left_dirs), "count"),
        ]
        clean = lost == 0 and tally.duplicated == 0 and tally.wrong == 0
    except (RuntimeError, httpx.HTTPError) as exc:
        stop_server(server, 30)
        print(f"soak: {exc}; server log: {server.log}", file=sys.stderr)
        return 2
    finally:
        stop_server(server, 30)
        for pid in worker_pids(str(server.tmpdir)):  # this server's leftovers (counted above), nobody else's
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        keep = args.keep_log or not clean or not good_after_load(rows)
        shutil.rmtree(server.tmpdir, ignore_errors=True)
        if not keep:
            shutil.rmtree(work, ignore_errors=True)

    identity = _identity(args, argv)
    print(f"soak: {args.clients} clients x {args.seconds:g} s, a worker SIGKILLed every {args.kill_every:g} s, "
          f"{args.hangup_fraction:.0%} hang-ups, {args.replicas} replica(s); {identity['cpu']}, "
          f"{identity['cores']} cores, {identity['date']}")
    print(f"{'case':<10} {'metric':<34} {'value':>10} unit")
    for case, metric, value, unit in rows:
        if case != "reason":
            print(f"{case:<10} {metric:<34} {value:>10} {unit}")
    for case, metric, value, _ in rows:
        if case == "reason":
            print(f"  {value:>6} x {metric}")
    for example in tally.wrong_examples:
        print(f"  {example}")
    if keep:
        print(f"server log: {server.log}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([{"case": case, "metric": metric, "value": value, "unit": unit, **identity}
                                         for case, metric, value, unit in rows], indent=2) + "\n")
    if rows and not good_after_load(rows):
        print("soak: the server did not answer a good request after the load (see `after` above)", file=sys.stderr)
    if not clean:
        print("soak: FAILED (lost, duplicated or wrong answers above)", file=sys.stderr)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
