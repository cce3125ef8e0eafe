"""RestartBudget: how many replacement starts a stage may still make (deploy key `restart`).

A sliding window: at most `max_restarts` starts within any `window_s` seconds. A stage whose
replicas keep dying (a bad bundle, a host out of memory) thus stops cycling workers: it backs off,
each refusal in a row doubling the delay before it asks again (`backoff`), and recovers by itself
once the window allows a start. Clients' cancellations and deadlines never spend it: they fence a
call and leave the worker serving (graph_stage.py).
"""

from __future__ import annotations

import time
from collections import deque

# Why: the first retry comes about when a replacement would have been ready anyway; doubling caps
# at a minute, so a stage whose cause went away (memory freed, a file restored) is back within it.
BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 60.0


class RestartBudget:
    """Counts replacement starts; `spend` says whether one more is allowed now."""

    def __init__(self, max_restarts: int, window_s: float) -> None:
        if max_restarts < 0 or not window_s > 0:
            raise ValueError(f"need max_restarts >= 0 and window_s > 0, got {max_restarts}, {window_s}")
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.spent = 0
        self.refusals = 0  # refused in a row, since the last start
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
        self.refusals = 0
        return True

    def backoff(self) -> float:
        """Seconds to wait before asking again after a refusal (or a failed start): doubling with
        each in a row, from BACKOFF_BASE_S up to BACKOFF_MAX_S."""
        delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** self.refusals)
        self.refusals += 1
        return delay

    def describe(self) -> str:
        return f"{self.max_restarts} restarts per {self.window_s:g} s"
