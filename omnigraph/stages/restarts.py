"""RestartBudget: how many replacement starts a stage may still make (deploy key `restart`).

A sliding window: at most `max_restarts` starts within any `window_s` seconds. A stage whose
replicas keep dying (a bad bundle, a host out of memory) thus stops replacing them and fails for
good instead of cycling workers forever.
"""

from __future__ import annotations

import time
from collections import deque


class RestartBudget:
    """Counts replacement starts; `spend` says whether one more is allowed now."""

    def __init__(self, max_restarts: int, window_s: float) -> None:
        if max_restarts < 0 or not window_s > 0:
            raise ValueError(f"need max_restarts >= 0 and window_s > 0, got {max_restarts}, {window_s}")
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.spent = 0
        self._starts: deque[float] = deque()

    def spend(self, now: float | None = None) -> bool:
        """Record one start and return True, or False (nothing recorded) when the window is full."""
        now = time.monotonic() if now is None else now
        while self._starts and now - self._starts[0] >= self.window_s:
            self._starts.popleft()
        if len(self._starts) >= self.max_restarts:
            return False
        self._starts.append(now)
        self.spent += 1
        return True

    def describe(self) -> str:
        return f"{self.max_restarts} restarts per {self.window_s:g} s"
