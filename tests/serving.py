"""Real server processes for end-to-end tests: start one, wait until it is ready, stop it after.

Servers (`omnigraph serve`, `vllm serve` with the plugin) run as `python ARGS...` in their own
process group with their output in a log file, so a test that fails shows the log's end, and
stopping a server also stops the engine and worker processes it started. Imported by the test
folders' modules (`from ..serving import ServerProcess, free_port, running_server`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

#: A CPU vLLM engine takes minutes to load and profile on a busy 2-core machine; the first
#: `omnigraph serve` builds the demo bundle into the cache.
STARTUP_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60
LOG_TAIL_CHARS = 3000


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def is_ready(url: str) -> bool:
    """Whether `url` answers 200 (a refused or dropped connection is not ready yet)."""
    try:
        return httpx.get(url, timeout=10).status_code == 200
    except httpx.TransportError:
        return False


class ServerProcess:
    """`python ARGS...` (or `EXECUTABLE ARGS...`), a server that listens on 127.0.0.1:`port`; `url` is
    its base URL."""

    def __init__(self, args: Sequence[str], *, port: int, log: Path, env: Mapping[str, str] | None = None,
                 executable: str = sys.executable) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = Path(log)
        self._log_file = self.log.open("w")
        self.process = subprocess.Popen([executable, *args], env={**os.environ, **(env or {})},
                                        stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True)

    def check_alive(self) -> None:
        """Raise RuntimeError with the end of the log if the server has exited."""
        if self.process.poll() is not None:
            raise RuntimeError(f"server exited with {self.process.returncode}:\n"
                               f"{self.log.read_text()[-LOG_TAIL_CHARS:]}")

    def wait_ready(self, path: str = "/ready", timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Wait until `GET <url><path>` answers 200; TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not is_ready(f"{self.url}{path}"):
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url}{path} not ready in {timeout_s:g} s; log {self.log}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it if it outlives `STOP_TIMEOUT_S`; close the log."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log_file.close()


@contextmanager
def running_server(args: Sequence[str], *, port: int, log_path: Path, ready_path: str = "/ready",
                   env: Mapping[str, str] | None = None) -> Iterator[str]:
    """`python ARGS...` (listening on `port`) ready for the block, stopped after it; yields its URL."""
    server = ServerProcess(args, port=port, log=log_path, env=env)
    try:
        server.wait_ready(ready_path)
        yield server.url
    finally:
        server.stop()
