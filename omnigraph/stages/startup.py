"""Cancelling a pipeline's start from another thread (a signal while workers are starting).

A start runs in a thread for seconds per replica; a server told to stop meanwhile must not start
the rest. The starter binds what stops it (kill the workers being started); cancelling before the
bind runs the hook at bind time, so no ordering between the two threads matters."""

from __future__ import annotations

import threading
from collections.abc import Callable

from omnigraph.stages.errors import StartupCancelled


class StartCancel:
    """A one-way switch: `cancel()` once, from any thread; `check()` raises after it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._hooks: list[Callable[[], None]] = []

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Cancel the start: run every bound hook now (once), and every later one at bind time."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()

    def bind(self, hook: Callable[[], None]) -> None:
        """Run `hook` when the start is cancelled (at once if it already was)."""
        with self._lock:
            if not self._cancelled:
                self._hooks.append(hook)
                return
        hook()

    def check(self, progress: str) -> None:
        """Raise `StartupCancelled` (naming how far the start got) once cancelled."""
        if self._cancelled:
            raise StartupCancelled(f"the start was cancelled {progress}")
