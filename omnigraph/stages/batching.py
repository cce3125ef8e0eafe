"""Cross-request batching of a graph stage: its queue, what may share a call, merge and split.

A free replica takes the oldest queued work item and, when the stage declares `max_batch_rows` > 1,
every other queued item compatible with it (same input names and dtypes, identical shapes except
axis 0) while the rows fit. The merged inputs are concatenated along axis 0 for ONE worker call
and every output is split back along axis 0, so each request only ever sees its own rows. That is
only sound when every input and output leads with the same symbolic batch dim and nowhere else
uses it: `batch_axis_problem` checks that once, from the loaded bundle's declared I/O.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Hashable

import numpy as np

from omnigraph.workers.reports import LoadReport, TensorSpec

STOP = object()  # queued once per serving replica at shutdown


def batch_key(tensors: Mapping[str, np.ndarray]) -> tuple[int, Hashable] | None:
    """(rows, what must match) of a work item, or None when its inputs disagree on axis 0."""
    rows = None
    parts = []
    for name in sorted(tensors):
        array = tensors[name]
        if array.ndim == 0 or (rows is not None and array.shape[0] != rows):
            return None
        rows = array.shape[0]
        parts.append((name, array.dtype.str, array.shape[1:]))
    return (rows, tuple(parts)) if rows is not None else None


def merge_inputs(items: Sequence[Any]) -> dict[str, np.ndarray]:
    """The items' inputs concatenated along axis 0, in item order."""
    first = items[0].tensors
    if len(items) == 1:
        return dict(first)
    return {name: np.concatenate([item.tensors[name] for item in items]) for name in first}


def split_outputs(outputs: Mapping[str, np.ndarray], rows: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """Each item's share of a merged call's outputs (copies: no request holds another's rows)."""
    if len(rows) == 1:
        return [dict(outputs)]
    total = sum(rows)
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != total:
            raise ValueError(f"output {name!r} has shape {list(array.shape)}; a merged call of {total} rows needs axis 0 = {total}")
    bounds = np.cumsum((0, *rows))
    return [{name: array[start:stop].copy() for name, array in outputs.items()}
            for start, stop in zip(bounds[:-1], bounds[1:])]


def batch_axis_problem(report: LoadReport) -> str | None:
    """Why the bundle's calls cannot be merged along axis 0 (None when they can): every input
    and output must lead with one shared symbolic dim that appears nowhere else."""
    specs: tuple[TensorSpec, ...] = (*report.inputs, *report.outputs)
    leading = {spec.shape[0] if spec.shape else None for spec in specs}
    if len(leading) != 1 or not isinstance(symbol := leading.pop(), str):
        described = ", ".join(f"{spec.name}{list(spec.shape)}" for spec in specs)
        return f"its inputs and outputs do not all lead with one symbolic batch dim: {described}"
    for spec in specs:
        if symbol in spec.shape[1:]:
            return f"{spec.name}{list(spec.shape)} uses the batch dim {symbol!r} beyond axis 0"
    return None


class StageQueue:
    """The stage's FIFO of work items, shared by its replicas; `take` hands out whole batches."""

    def __init__(self, max_batch_rows: int = 1, batch_wait_us: int = 0) -> None:
        self.max_batch_rows = max_batch_rows
        self.batch_wait_s = batch_wait_us / 1e6
        self._items: deque[Any] = deque()
        self._ready = threading.Condition(threading.Lock())

    def put(self, item: Any) -> None:
        with self._ready:
            self._items.append(item)
            self._ready.notify()

    def drain(self) -> list[Any]:
        """Remove and return every queued work item (shutdown markers stay)."""
        with self._ready:
            items = [item for item in self._items if item is not STOP]
            self._items = deque(item for item in self._items if item is STOP)
            return items

    def take(self) -> list[Any] | object:
        """Block for the oldest entry: `STOP`, or a batch of work items led by it."""
        with self._ready:
            while not self._items:
                self._ready.wait()
            first = self._items.popleft()
            if first is STOP:
                return STOP
            if self.max_batch_rows <= 1:
                return [first]
            key = batch_key(first.tensors)
            if key is None or key[0] >= self.max_batch_rows:
                return [first]
            batch, rows = [first], key[0]
            deadline = time.monotonic() + self.batch_wait_s
            while True:
                rows = self._gather_locked(batch, rows, key[1])
                remaining = deadline - time.monotonic()
                if rows >= self.max_batch_rows or remaining <= 0:
                    return batch
                self._ready.wait(remaining)

    def _gather_locked(self, batch: list[Any], rows: int, signature: Hashable) -> int:
        """Move queued items matching `signature` into `batch` while the rows fit; the new row count."""
        kept: deque[Any] = deque()
        for item in self._items:
            key = None if item is STOP or not item.is_live() else batch_key(item.tensors)
            if key is not None and key[1] == signature and rows + key[0] <= self.max_batch_rows:
                batch.append(item)
                rows += key[0]
            elif item is STOP or item.is_live():
                kept.append(item)
        self._items = kept
        return rows
