"""The engine's counters as small frozen records, for `/metrics` and anyone else who reads them.

`StageRuntime.metrics()` builds one `EngineMetrics` from the stages', replicas' and ledger's own
attributes (not from `describe()`, whose dicts are the execution plan's, for people): per stage its
state, live replicas, restarts spent, retirements and each replica's calls, items and fenced calls, plus the
batching statistics of a graph stage; per ledger constraint its capacity and charges. Everything
here is a plain value: reading it takes no lock and cannot change under the reader.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class HistogramMetrics:
    """Cumulative counts below upper bounds (the last bound is +inf), as Prometheus exports them."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return self.cumulative[-1] if self.cumulative else 0

    @property
    def buckets(self) -> list[tuple[float, int]]:
        """(upper bound, cumulative count) pairs."""
        return list(zip(self.bounds, self.cumulative))

    @classmethod
    def from_stats(cls, histogram: Mapping[str, Any]) -> HistogramMetrics:
        """From one histogram of `BatchStats.snapshot()` (`{"buckets": [[bound, count], ...], "sum"}`)."""
        bounds, cumulative = zip(*histogram["buckets"])  # the last bound is "+Inf"
        return cls(bounds=(*bounds[:-1], math.inf), cumulative=cumulative, sum=histogram["sum"])


@dataclass(frozen=True, slots=True)
class BatchMetrics:
    """A graph stage's batching statistics (stages/batching.py `BatchStats`): totals, padding
    efficiency (None before the first call) and the three histograms."""

    calls: int
    rows: int
    padded_rows: int
    tokens: int
    padded_tokens: int
    padding_efficiency: float | None
    batch_rows: HistogramMetrics
    batch_requests: HistogramMetrics
    queue_wait_seconds: HistogramMetrics

    @classmethod
    def from_stats(cls, snapshot: Mapping[str, Any]) -> BatchMetrics:
        """From `BatchStats.snapshot()`, the one consistent copy the statistics give out."""
        histograms = snapshot["histograms"]
        return cls(calls=snapshot["calls"], rows=snapshot["rows"], padded_rows=snapshot["padded_rows"],
                   tokens=snapshot["tokens"], padded_tokens=snapshot["padded_tokens"],
                   padding_efficiency=snapshot["padding_efficiency"],
                   batch_rows=HistogramMetrics.from_stats(histograms["batch_rows"]),
                   batch_requests=HistogramMetrics.from_stats(histograms["batch_requests"]),
                   queue_wait_seconds=HistogramMetrics.from_stats(histograms["queue_wait_seconds"]))


@dataclass(frozen=True, slots=True)
class ReplicaMetrics:
    """One replica slot's current occupant. `generation` is its graph worker's (None for a native
    engine); `calls` are graph worker calls (a native engine counts each pooled item as one);
    `fenced_calls` are calls whose results were discarded after a cancellation fenced them."""

    replica: int
    generation: int | None
    state: str  # "serving" | "retired"
    restarts: int
    calls: int
    items: int
    fenced_calls: int


@dataclass(frozen=True, slots=True)
class StageMetrics:
    """One stage: its state ("ok" | "degraded" | "recovering" | "unavailable" | "failed", as
    `GraphStage.status`), replicas, restarts spent (replacement starts, from the restart budget),
    a graph stage's batching statistics, and how many of its replicas retired since the start
    (`retirements`: a worker that died, broke the wire or hung; a native engine is never retired)."""

    stage_id: int
    execution_type: str
    state: str
    state_reason: str | None
    num_replicas: int
    live_replicas: int
    restarts: int
    replicas: tuple[ReplicaMetrics, ...]
    batching: BatchMetrics | None
    retirements: int = 0

    @property
    def calls(self) -> int:
        """Calls of the replicas now in the slots (a replaced replica's calls left with it)."""
        return sum(replica.calls for replica in self.replicas)

    @property
    def items(self) -> int:
        return sum(replica.items for replica in self.replicas)

    @property
    def fenced_calls(self) -> int:
        return sum(replica.fenced_calls for replica in self.replicas)


@dataclass(frozen=True, slots=True)
class LedgerConstraintMetrics:
    """One ledger constraint: its capacity and what is charged to it."""

    name: str
    capacity: int
    held: int
    quarantined: int
    free: int


@dataclass(frozen=True, slots=True)
class LedgerMetrics:
    """The ledger's constraints (sorted by name) and how many reservations are live (held or quarantined)."""

    constraints: tuple[LedgerConstraintMetrics, ...]
    reservations: int

    @classmethod
    def from_snapshot(cls, snapshot: Mapping[str, Any]) -> LedgerMetrics:
        """From `ResourceLedger.snapshot()`, the one consistent copy the ledger gives out."""
        constraints = tuple(LedgerConstraintMetrics(name, amounts["capacity"], amounts["held"],
                                                    amounts["quarantined"], amounts["free"])
                            for name, amounts in sorted(snapshot["constraints"].items()))
        return cls(constraints=constraints, reservations=len(snapshot["reservations"]))


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """Every stage in chain order, and the ledger."""

    stages: tuple[StageMetrics, ...]
    ledger: LedgerMetrics

    def batching(self) -> dict[int, BatchMetrics]:
        """Each batching (graph) stage's statistics by stage id."""
        return {stage.stage_id: stage.batching for stage in self.stages if stage.batching is not None}
