"""Real `omnigraph serve` processes on 127.0.0.1 for the HTTP tests, and ways to hurt their workers."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

from .. import serving
from ..serving import STARTUP_TIMEOUT_S, free_port

REFUND_REQUEST = {"state": "Please refund the duplicate charge.",
                  "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}}


class ServerProcess(serving.ServerProcess):
    """One `omnigraph serve` subprocess on a free port, with ways to reach its graph workers."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        port = free_port()
        super().__init__(["-m", "omnigraph.plugin.cli", "serve", *args, "--port", str(port)], port=port, log=log,
                         env=env)

    def wait_listening(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            self.check_alive()
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server did not listen; log {self.log}")
            time.sleep(0.02)

    def worker_pids(self) -> list[int]:
        """The graph worker processes this server started (its descendants running the worker module)."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry.name))
        pending, found = [self.process.pid], []
        while pending:
            pid = pending.pop()
            for child in children.get(pid, []):
                pending.append(child)
                try:
                    if b"omnigraph.workers.worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                        found.append(child)
                except OSError:
                    pass
        return found

    def signal_workers(self, sig: signal.Signals) -> list[int]:
        pids = self.worker_pids()
        assert pids, "the server has no graph worker"
        for pid in pids:
            os.kill(pid, sig)
        return pids

    def metric(self, name: str) -> float:
        """The value of the first Prometheus sample named `name`, whatever its labels (`model_name`)."""
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith((name + " ", name + "{")):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self) -> None:
        if self.process.poll() is None:
            for pid in self.worker_pids():  # a stopped worker must be able to die
                os.kill(pid, signal.SIGCONT)
        super().stop()


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Start `omnigraph serve [args]` with extra environment; every server is stopped after the test."""
    started: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None, ready: bool = True) -> ServerProcess:
        server = ServerProcess(list(args), env or {}, tmp_path / f"server-{len(started)}.log")
        started.append(server)
        if ready:
            server.wait_ready()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The embedded demo (`omnigraph serve` with no model), shared by the tests that do not hurt it."""
    server = ServerProcess([], {}, tmp_path_factory.mktemp("demo") / "server.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture
def demo_deploy_config(tmp_path: Path) -> Callable[..., Path]:
    """Write a deploy YAML serving the demo bundle on the CPU route, with `max_queued_requests`
    and, when given, a restart budget of `max_restarts` replacements a minute."""
    from omnigraph.pipelines.laya.export import default_bundle

    def write(max_queued_requests: int, max_restarts: int | None = None) -> Path:
        path = tmp_path / f"deploy-q{max_queued_requests}-r{max_restarts}.yaml"
        restart = "" if max_restarts is None else f"    restart: {{max_restarts: {max_restarts}, window_s: 60}}\n"
        path.write_text(
            "pipeline: laya\n"
            f"max_queued_requests: {max_queued_requests}\n"
            "stages:\n"
            "  - stage_id: 0\n"
            + restart +
            "    backend:\n"
            "      name: external.graph.v1\n"
            f"      manifest: {default_bundle() / 'manifest.json'}\n"
            f"      route: {{name: local-cpu, interpreter: {sys.executable}, ep: cpu}}\n"
            "    resource_budget:\n"
            "      capacities: {'machine:ram': 8589934592}\n"
            "      demands: {'machine:ram': 1073741824}\n")
        return path

    return write
