"""The OS process behind a WorkerClient: where it runs, how it is reaped, killed and proven gone.

A local worker (`LocalWorkerProcess`) is a child of the controller with its log in a private
folder. A worker on another node (a Ray actor's child, stages/ray_cluster.py) is reached through
the same small interface, so the client's calls, deaths and fences read the same everywhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Protocol

from omnigraph.workers import procfs

# Why: quoting the end of the worker's log is enough to say why it died.
LOG_TAIL_BYTES = 4000
#: A remote worker's `--connect` value: `tcp:HOST:PORT`.
TCP_PREFIX = "tcp:"
#: Where a remote worker finds the one-time token it sends first (an environment variable, not
#: argv, which other users of its machine can read).
WORKER_TOKEN_ENV = "OMNIGRAPH_WORKER_TOKEN"
# Why: the token is the hex of this many random bytes, then a newline; 16 bytes cannot be guessed,
# and the controller reads no more than that from a stranger.
WORKER_TOKEN_BYTES = 16


class WorkerProcess(Protocol):
    """One worker's process, wherever it runs."""

    @property
    def pid(self) -> int:
        """Its pid on its own machine."""
        ...

    def poll(self) -> int | None:
        """Its exit status once reaped (negative: killed by that signal), else None."""
        ...

    def wait(self, timeout: float | None = None) -> int:
        """Reap it within `timeout` seconds: its exit status; subprocess.TimeoutExpired otherwise."""
        ...

    def kill(self) -> None:
        """SIGKILL it (no wait); nothing if it has exited."""
        ...

    def gone(self, start_ticks: int) -> bool:
        """Whether, once reaped, no process with its pid and `start_ticks` is left on its machine."""
        ...

    def exit_fd(self) -> int:
        """A new descriptor (the caller closes it) that turns readable once the process exited;
        ProcessLookupError when it is gone already."""
        ...

    @property
    def node(self) -> str:
        """The machine it runs on: `local`, or a Ray node id."""
        ...

    def log_tail(self) -> str:
        """`; its log ends:\\n...` with the end of its stdout and stderr, or '' when there is none."""
        ...

    def remove_files(self) -> None:
        """Remove what it left on its machine (its folder and log); idempotent."""
        ...


class LocalWorkerProcess:
    """A worker started by this process, its stdout and stderr in `private_dir/worker.log`."""

    def __init__(self, process: subprocess.Popen, private_dir: Path) -> None:
        self._process = process
        self.private_dir = private_dir

    @property
    def pid(self) -> int:
        return self._process.pid

    def poll(self) -> int | None:
        return self._process.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._process.wait(timeout)

    def kill(self) -> None:
        if self._process.poll() is None:
            try:
                self._process.kill()
            except ProcessLookupError:
                pass

    def gone(self, start_ticks: int) -> bool:
        if self._process.poll() is None:
            return False
        try:
            return procfs.process_start_ticks(self.pid) != start_ticks
        except FileNotFoundError:
            return True

    def exit_fd(self) -> int:
        return os.pidfd_open(self.pid)

    @property
    def node(self) -> str:
        return "local"

    def log_tail(self) -> str:
        return log_tail(self.private_dir / "worker.log")

    def remove_files(self) -> None:
        shutil.rmtree(self.private_dir, ignore_errors=True)


def log_tail(path: Path) -> str:
    """The end of the log at `path` as `; its log ends:\\n...`, or '' when it is empty or missing."""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - LOG_TAIL_BYTES))
            tail = log.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""
    return f"; its log ends:\n{tail}" if tail else ""
