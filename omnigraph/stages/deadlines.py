"""The one place request deadlines are checked: a thread that sleeps until the earliest one.

Every admitted request with a deadline is watched from admission (the clock starts before its
input processing) to its end. When a deadline passes before the request ended, `expire` is called
once for it, on this thread; the orchestrator fails the request (DeadlineExceeded, saying where it
was) and interrupts its stages, exactly as an abort does. Stages never look at deadlines: they
only ask whether a request is still live.

A request that ends first is forgotten with `unwatch` (its caller has the answer): its entry drops
the request at once, so nothing the request holds outlives it, and the empty entry is skipped when
it comes due (removing it would cost a heap search per request); the heap is compacted when empty
entries dominate it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable

from omnigraph.stages.request_state import RequestState

# Why: a long deadline at a high request rate leaves many empty entries (about 150 bytes each);
# past this many, the heap is rebuilt without them once they are the majority.
COMPACT_ABOVE = 4096

# [deadline, admission order (ties; entries never compare further), the request or None once unwatched]
Entry = list


class DeadlineWatch:
    """Calls `expire(request)` when a watched request's deadline passes before it ended."""

    def __init__(self, expire: Callable[[RequestState], None], *, name: str = "omnigraph-deadlines") -> None:
        self._expire = expire
        self._heap: list[Entry] = []
        self._unwatched = 0
        self._order = itertools.count()  # ties keep admission order; RequestStates are never compared
        self._wake = threading.Condition(threading.Lock())
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, request: RequestState) -> Entry:
        """Watch `request` (its `deadline` set) until it ends; returns what `unwatch` takes."""
        assert request.deadline is not None
        entry: Entry = [request.deadline, next(self._order), request]
        with self._wake:
            heapq.heappush(self._heap, entry)
            if self._heap[0] is entry:  # earlier than the one the thread sleeps for
                self._wake.notify()
        return entry

    def unwatch(self, entry: Entry) -> None:
        """Forget a request that ended."""
        with self._wake:
            if entry[2] is None:
                return
            entry[2] = None
            self._unwatched += 1
            if len(self._heap) > COMPACT_ABOVE and self._unwatched * 2 > len(self._heap):
                self._heap = [kept for kept in self._heap if kept[2] is not None]
                heapq.heapify(self._heap)
                self._unwatched = 0

    def close(self) -> None:
        """Stop watching (shutdown fails every unfinished request by itself)."""
        with self._wake:
            self._closed = True
            self._heap.clear()
            self._unwatched = 0
            self._wake.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._closed:
                    if self._heap:
                        wait = self._heap[0][0] - time.monotonic()
                        if wait <= 0:
                            break
                    else:
                        wait = None
                    self._wake.wait(wait)
                if self._closed:
                    return
                due = heapq.heappop(self._heap)
                request, due[2] = due[2], None  # a later unwatch finds it gone
                if request is None:
                    self._unwatched -= 1
                    continue
            if not request.finished:
                self._expire(request)
