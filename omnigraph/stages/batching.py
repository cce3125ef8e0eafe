"""Cross-request batching of a graph stage: its queue, what may share a call, limits, statistics.

Every queued work item of a stage is bound for the same loaded bundle (one identity, precision and
layout per stage), so what decides whether two items may share a worker call is the stage's
*batch adapter*: its `group` of an item (e.g. Laya's length class: same input names and dtypes,
sequence lengths within one power-of-two class) must match, and the packed call's padded size
(`BatchShape`: rows, tokens, bytes) must stay within the stage's `BatchLimits`, declared by the
pipeline (`StagePipelineConfig.max_batch_*`) and overridable per stage in the deploy YAML
(`batching:`). Those limits speak only of what every model has: rows, tokens and bytes. A cap
that only one model knows (Laya's marker slots per call) is its adapter's own (`fits`), kept in
the model's folder. The adapter packs the items' inputs into one call (padding rows, lengths and
its own axes to its buckets) and unpacks the outputs back to each item, so a request only ever
sees its own rows. A model names its adapter by a dotted string (`StagePipelineConfig.batch_adapter`; the
engine never imports a model); without one, `AxisZeroAdapter` merges items whose inputs are
identical except along axis 0. Both are only sound when the graph's every input and output leads
with one symbolic batch dim used nowhere else: `batch_axis_problem` checks that once, from the
loaded bundle's declared I/O.

A free replica takes the oldest queued item, gathers every compatible item that fits, and while
the call is not full and more admitted requests exist than it holds (`StageQueue.admitted_requests`,
the orchestrator's count) waits up to `wait_us` for more to arrive (`DEFAULT_BATCH_WAIT_US`): a
lone request never waits for batch-mates that cannot come.
"""

from __future__ import annotations

import bisect
import enum
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol

import numpy as np

from omnigraph.workers.reports import LoadReport, TensorSpec

if TYPE_CHECKING:
    from omnigraph.pipelines.config import StagePipelineConfig
    from omnigraph.pipelines.deploy import BatchingConfig

class Stop(enum.Enum):
    """The shutdown marker's type (an enum member, so that `entry is STOP` narrows a queue entry)."""

    STOP = "stop"


STOP: Final = Stop.STOP  # queued once per serving replica at shutdown

# Why 500: closed-loop clients resubmit within a few hundred microseconds of their answers (the
# answer's hand-off, prepare, admission), so a free replica that waits this long gathers most of them
# into its call; waiting longer barely grows the calls. (A lone request does not wait at all.)
# Measured 2026-11-29 on the 2-core CPU development machine (shared, loaded), tiny checkpoint, one
# 1-row noul request per client, 16 closed-loop AsyncOmni clients, max_batch_rows 32, 3 s per point,
# interleaved rounds: requests per call 7.8-8.0 at 0 us, 9.1-9.4 at 250, 10.5-12.2 at 500,
# 11.2-12.5 at 1000, 11.8-12.5 at 2000 (decisions/s too noisy on that machine to rank the waits).
# The sweep script is in the batching report of issue 9; benchmarks/throughput.py --batch-wait-us W
# drives the same load.
DEFAULT_BATCH_WAIT_US = 500


class BatchShape(NamedTuple):
    """The padded size of one packed call, which the stage's limits bound, and its real content.
    (A named tuple, as `Footprint`: built for every queued item a replica considers, so it must
    be cheap to build; a frozen dataclass takes several times as long.)"""

    rows: int              # rows of the packed call (axis 0, padding included)
    tokens: int            # rows x padded sequence length (0 for a graph without a sequence axis)
    bytes: int             # bytes of every packed input
    real_rows: int         # rows that belong to a request
    real_tokens: int       # tokens that belong to a request (attention mask set)


class Footprint(NamedTuple):
    """What one queued item adds to a call; items combine by adding rows and tokens and taking
    the widest length, row size and adapter widths (`combine`)."""

    rows: int
    tokens: int = 0        # real tokens of its rows
    length: int = 0        # the sequence length its rows are padded to
    row_bytes: int = 0     # input bytes per row at its own shape
    widths: tuple[int, ...] = ()  # the widths of the adapter's own padded axes (Laya: marker slots)

    def combine(self, other: Footprint) -> Footprint:
        widths = self.widths if self.widths == other.widths else tuple(map(max, self.widths, other.widths))
        return Footprint(self.rows + other.rows, self.tokens + other.tokens, max(self.length, other.length),
                         max(self.row_bytes, other.row_bytes), widths)


class BatchAdapter(Protocol):
    """A model's knowledge of how its work items share a call, constructed with the stage's
    `VerifiedBundle` and `WorkerRoute` (a route running fixed shapes may need padded buckets)."""

    def group(self, tensors: Mapping[str, np.ndarray]) -> Hashable | None:
        """Items of equal groups may share a call; None: this item always runs alone."""

    def footprint(self, tensors: Mapping[str, np.ndarray]) -> Footprint:
        """The item's size as the limits count it (called once, when it is queued)."""

    def padded(self, total: Footprint) -> BatchShape:
        """The packed call's size for items whose footprints combine to `total`."""

    def fits(self, total: Footprint) -> bool:
        """Whether items whose footprints combine to `total` may share one call as far as the
        model's own caps go, beyond the stage's rows, tokens and bytes (the default: always)."""

    def pack(self, items: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """One call's inputs for `items`, in order, padded to the adapter's buckets."""

    def unpack(self, outputs: Mapping[str, np.ndarray],
               items: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """Each item's outputs, shaped as if it had run alone (copies: no item keeps another's rows)."""


def _leading_rows(tensors: Mapping[str, np.ndarray]) -> int | None:
    """The rows every input shares along axis 0, or None when they disagree (or one is a scalar)."""
    rows = {array.shape[0] if array.ndim else None for array in tensors.values()}
    return rows.pop() if len(rows) == 1 and None not in rows else None


class AxisZeroAdapter:
    """The default: items whose inputs agree in names, dtypes and every axis but the first are
    concatenated along axis 0, and outputs are split back by rows. Nothing is padded."""

    def group(self, tensors: Mapping[str, np.ndarray]) -> Hashable | None:
        if _leading_rows(tensors) is None:
            return None
        return tuple((name, tensors[name].dtype.str, tensors[name].shape[1:]) for name in sorted(tensors))

    def footprint(self, tensors: Mapping[str, np.ndarray]) -> Footprint:
        rows = _leading_rows(tensors) or 0
        row_bytes = sum(array.nbytes // rows for array in tensors.values()) if rows else 0
        return Footprint(rows=rows, row_bytes=row_bytes)

    def padded(self, total: Footprint) -> BatchShape:
        return BatchShape(rows=total.rows, tokens=0, bytes=total.rows * total.row_bytes,
                          real_rows=total.rows, real_tokens=0)

    def fits(self, total: Footprint) -> bool:
        return True

    def pack(self, items: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        if len(items) == 1:
            return dict(items[0])
        return {name: np.concatenate([item[name] for item in items]) for name in items[0]}

    def unpack(self, outputs: Mapping[str, np.ndarray],
               items: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        if len(items) == 1:
            return [dict(outputs)]
        return split_rows(outputs, [_leading_rows(item) or 0 for item in items])


def split_rows(outputs: Mapping[str, np.ndarray], rows: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """Each item's share of a merged call's outputs: consecutive `rows` along axis 0 (copies);
    rows past their sum (padding) are dropped."""
    total = sum(rows)
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] < total:
            raise ValueError(f"output {name!r} has shape {list(array.shape)}; a merged call of {total} rows "
                             f"needs axis 0 >= {total}")
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


@dataclass(frozen=True)
class BatchLimits:
    """What one call of a stage may hold: at most `max_rows` rows (1: every item runs alone) and,
    where set, `max_tokens`, `max_bytes` of its padded shape; a free replica waits
    up to `wait_us` for more work while the call has room. An item beyond a limit on its own still
    runs (alone): limits bound merging, the processor bounds a request. Built by `for_stage` from
    values the pipeline declaration and the deploy YAML have already validated."""

    max_rows: int = 1
    max_tokens: int | None = None
    max_bytes: int | None = None
    wait_us: int = DEFAULT_BATCH_WAIT_US

    @classmethod
    def for_stage(cls, declared: StagePipelineConfig, deployed: BatchingConfig) -> BatchLimits:
        """The deploy YAML's `batching:` values over the pipeline's declared ones."""
        def pick(name: str) -> Any:
            value = getattr(deployed, name)
            return getattr(declared, name) if value is None else value

        wait = pick("batch_wait_us")
        return cls(max_rows=pick("max_batch_rows"), max_tokens=pick("max_batch_tokens"),
                   max_bytes=pick("max_batch_bytes"), wait_us=DEFAULT_BATCH_WAIT_US if wait is None else wait)

    def admits(self, shape: BatchShape) -> bool:
        """True when a call of `shape` is within every limit."""
        return (shape.rows <= self.max_rows
                and (self.max_tokens is None or shape.tokens <= self.max_tokens)
                and (self.max_bytes is None or shape.bytes <= self.max_bytes))

    def to_dict(self) -> dict[str, int | None]:
        """The deploy YAML's keys and their values in force."""
        return {"max_batch_rows": self.max_rows, "max_batch_tokens": self.max_tokens,
                "max_batch_bytes": self.max_bytes, "batch_wait_us": self.wait_us}


class Queued:
    """A queued work item with what batching reads of it (computed once, at `put`) and, once a
    replica takes it, how long it waited."""

    __slots__ = ("item", "group", "footprint", "queued_at", "waited_s")

    def __init__(self, item: Any, group: Hashable | None, footprint: Footprint) -> None:
        self.item = item
        self.group = group
        self.footprint = footprint
        self.queued_at = time.monotonic()
        self.waited_s = 0.0


def combined(entries: Sequence[Queued]) -> Footprint:
    """The footprint of a call holding `entries`."""
    total = entries[0].footprint
    for entry in entries[1:]:
        total = total.combine(entry.footprint)
    return total


class StageQueue:
    """The stage's FIFO of work items, shared by its replicas; `take` hands out whole batches."""

    def __init__(self, limits: BatchLimits, adapter: BatchAdapter) -> None:
        self.limits = limits
        self.adapter = adapter
        # How many requests are admitted and not yet acknowledged (set by the orchestrator; None:
        # unknown, always wait): a replica waits for batch-mates only while more exist than its batch
        # holds. A request whose caller has not yet taken its result counts: under closed-loop load
        # that caller is about to send the next one (counting only unfinished requests made the
        # batches of `benchmarks/overhead.py` at c=32 smaller, 6% fewer requests/s).
        self.admitted_requests: Callable[[], int] | None = None
        self._entries: deque[Queued | Stop] = deque()
        self._ready = threading.Condition(threading.Lock())

    def entry(self, item: Any) -> Queued:
        """`item` as this queue holds it (what `put` queues and a call is made of)."""
        # the group only decides merging: a stage that never merges skips it
        group = self.adapter.group(item.tensors) if self.limits.max_rows > 1 else None
        return Queued(item, group, self.adapter.footprint(item.tensors))

    def is_empty(self) -> bool:
        return not self._entries

    def put(self, item: Any) -> None:
        entry = self.entry(item)
        with self._ready:
            self._entries.append(entry)
            self._ready.notify_all()

    def requeue(self, entries: Sequence[Queued]) -> None:
        """Put entries a replica took but could not call back at the front, in their order."""
        with self._ready:
            self._entries.extendleft(reversed(entries))
            self._ready.notify_all()

    def stop_one(self) -> None:
        """Queue a shutdown marker: the replica that takes it stops serving."""
        with self._ready:
            self._entries.append(STOP)
            self._ready.notify_all()

    def wake_all(self) -> None:
        """Wake every waiting replica to check its `stop_when` and `wake_when` (a replica retired
        while idle; a call an event loop handed to it)."""
        with self._ready:
            self._ready.notify_all()

    def drain(self) -> list[Any]:
        """Remove and return every queued work item (shutdown markers stay)."""
        with self._ready:
            items = [entry.item for entry in self._entries if entry is not STOP]
            self._entries = deque(entry for entry in self._entries if entry is STOP)
            return items

    def take(self, stop_when: Callable[[], bool] = lambda: False,
             wake_when: Callable[[], bool] = lambda: False) -> list[Queued] | Stop:
        """Block for the oldest entry: `STOP`, or the entries of one call led by it. Also `STOP`
        once `stop_when()` holds, and no entries once `wake_when()` holds, while nothing is queued:
        both are checked again at every `wake_all`."""
        with self._ready:
            while not self._entries:
                if stop_when():
                    return STOP
                if wake_when():
                    return []
                self._ready.wait()
            first = self._entries.popleft()
            if first is STOP:
                return STOP
            batch: list[Queued] = [first]
            total = first.footprint
            if self.limits.max_rows > 1 and first.group is not None:
                deadline = time.monotonic() + self.limits.wait_us / 1e6
                while True:
                    total = self._gather_locked(batch, total)
                    remaining = deadline - time.monotonic()
                    if total.rows >= self.limits.max_rows or remaining <= 0 or not self._more_expected(batch):
                        break
                    self._ready.wait(remaining)
        now = time.monotonic()
        for entry in batch:
            entry.waited_s = now - entry.queued_at
        return batch

    def _more_expected(self, batch: list[Queued]) -> bool:
        """Whether admitted requests beyond the batch's own may still bring work."""
        return self.admitted_requests is None or self.admitted_requests() > len({e.item.request_id for e in batch})

    def _gather_locked(self, batch: list[Queued], total: Footprint) -> Footprint:
        """Move queued items of the batch's group into it while the padded call stays within the
        limits and the adapter's own caps; cancelled items leave the queue unseen. The batch's
        combined footprint."""
        group = batch[0].group
        kept: deque[Queued | Stop] = deque()
        for entry in self._entries:
            if entry is STOP:
                kept.append(entry)
                continue
            if not entry.item.is_live():
                continue
            if entry.group == group:
                combined = total.combine(entry.footprint)
                if self.adapter.fits(combined) and self.limits.admits(self.adapter.padded(combined)):
                    batch.append(entry)
                    total = combined
                    continue
            kept.append(entry)
        self._entries = kept
        return total


class _Histogram:
    """Cumulative counts below fixed upper bounds, as Prometheus histograms export them."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def to_dict(self) -> dict[str, Any]:
        cumulative = np.cumsum(self.counts).tolist()
        return {"buckets": [[bound, count] for bound, count in zip((*self.bounds, "+Inf"), cumulative)],
                "count": cumulative[-1], "sum": self.sum}


_SIZE_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_WAIT_BOUNDS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 10.0)


class BatchStats:
    """What a stage's calls held: rows and requests per call, time queued, padding. Read by the
    execution plan and exported as Prometheus histograms and counters (plugin/api/metrics.py)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows = _Histogram(_SIZE_BOUNDS)
        self._requests = _Histogram(_SIZE_BOUNDS)
        self._queue_wait = _Histogram(_WAIT_BOUNDS)
        self._totals = dict.fromkeys(("calls", "rows", "padded_rows", "tokens", "padded_tokens"), 0)

    def record_waits(self, queue_wait_s: Sequence[float]) -> None:
        """How long each item of a taken batch waited in the queue."""
        with self._lock:
            for seconds in queue_wait_s:
                self._queue_wait.observe(seconds)

    def record_call(self, shape: BatchShape, requests: int) -> None:
        """One worker call of `shape` serving `requests` requests."""
        with self._lock:
            self._rows.observe(shape.real_rows)
            self._requests.observe(requests)
            for key, value in (("calls", 1), ("rows", shape.real_rows), ("padded_rows", shape.rows),
                               ("tokens", shape.real_tokens), ("padded_tokens", shape.tokens)):
                self._totals[key] += value

    def snapshot(self) -> dict[str, Any]:
        """Totals, padding efficiency (real / padded tokens, or rows for graphs without tokens;
        None before the first call) and the three histograms."""
        with self._lock:
            totals = dict(self._totals)
            histograms = {"batch_rows": self._rows.to_dict(), "batch_requests": self._requests.to_dict(),
                          "queue_wait_seconds": self._queue_wait.to_dict()}
        real, padded = ((totals["tokens"], totals["padded_tokens"]) if totals["padded_tokens"]
                        else (totals["rows"], totals["padded_rows"]))
        return {**totals, "padding_efficiency": real / padded if padded else None, "histograms": histograms}
