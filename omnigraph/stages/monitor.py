"""StageMonitor: one background thread that notices, between requests, what would otherwise only be
found by the next request.

- A worker process that exits while its replica is idle (killed, out of memory, its node lost):
  its exit descriptor (`WorkerProcess.exit_fd`: a pidfd, or a remote worker's) turns readable at
  once, and the stage retires the replica and starts its replacement eagerly, so `/health` tells
  the truth at once and no request meets the dead worker.
- A bundle changed on disk under a running stage: each stage's `BundleWatch` is checked every
  `reverify_interval_s` (deploy key); a change turns the stage unavailable, naming the file, until
  the verified bytes are back.
"""

from __future__ import annotations

import logging
import os
import selectors
import threading
import time
from collections.abc import Callable

from omnigraph.workers.process import WorkerProcess

logger = logging.getLogger("omnigraph.stages")

# Why: the thread wakes at least this often to run due bundle checks and see its stop flag.
MAX_SLEEP_S = 1.0


class StageMonitor:
    """Watches worker processes (`watch_exit`) and runs periodic checks (`every`)."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._exits: dict[int, Callable[[], None]] = {}   # exit descriptor -> on_exit
        self._pending: list[tuple[WorkerProcess, Callable[[], None]]] = []
        self._checks: list[tuple[float, Callable[[], None], list[float]]] = []  # (interval, check, [next due])
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="omnigraph-stage-monitor", daemon=True)
        self._thread.start()

    def watch_exit(self, process: WorkerProcess, on_exit: Callable[[], None]) -> None:
        """Call `on_exit()` (on the monitor's thread) once `process` exits."""
        with self._lock:
            if self._stopped:
                return
            self._pending.append((process, on_exit))
        self._wake()

    def every(self, interval_s: float, check: Callable[[], None]) -> None:
        """Call `check()` (on the monitor's thread) every `interval_s` seconds."""
        with self._lock:
            self._checks.append((interval_s, check, [time.monotonic() + interval_s]))
        self._wake()

    def stop(self) -> None:
        """Stop the thread; nothing is called after this returns."""
        with self._lock:
            self._stopped = True
        self._wake()
        self._thread.join()
        for fd in self._exits:
            os.close(fd)
        self._exits.clear()
        self._selector.close()
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"x")
        except BlockingIOError:  # a wake-up is already pending
            pass

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stopped:
                    return
                pending, self._pending = self._pending, []
                checks = list(self._checks)
            for process, on_exit in pending:
                self._register(process, on_exit)
            now = time.monotonic()
            next_due = now + MAX_SLEEP_S
            for interval, check, due in checks:
                if due[0] <= now:
                    self._call(check)
                    due[0] = time.monotonic() + interval
                next_due = min(next_due, due[0])
            for key, _ in self._selector.select(max(0.0, next_due - time.monotonic())):
                if key.data is None:
                    os.read(self._wake_read, 4096)
                    continue
                fd = key.fd
                on_exit = self._exits.pop(fd)
                self._selector.unregister(fd)
                os.close(fd)
                self._call(on_exit)

    def _register(self, process: WorkerProcess, on_exit: Callable[[], None]) -> None:
        try:
            fd = process.exit_fd()
        except ProcessLookupError:  # already gone
            self._call(on_exit)
            return
        self._exits[fd] = on_exit
        self._selector.register(fd, selectors.EVENT_READ, fd)

    @staticmethod
    def _call(callback: Callable[[], None]) -> None:
        try:
            callback()
        except Exception:  # one stage's fault must not stop the monitor of every stage
            logger.exception("stage monitor: a callback failed")
