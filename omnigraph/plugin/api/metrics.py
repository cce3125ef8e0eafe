"""Prometheus metrics of one server: its own registry, so two apps in one process never collide.

Counters and histograms are updated by the routes; queue depth, reservations and each stage's
batching statistics (rows and requests per call, time queued, padding efficiency) are read from the
engine at scrape time (collectors), so they are never stale: typed records (stages/metrics.py,
`StageRuntime.metrics()`), never the execution plan's `describe()` dicts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from omnigraph.stages.metrics import BatchMetrics, HistogramMetrics, LedgerMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineGauges(Collector):
    """Queue depth and ledger reservations, read from the engine's typed counters when Prometheus scrapes."""

    def __init__(self, queue_depth: Callable[[], int | None], ledger: Callable[[], LedgerMetrics | None]) -> None:
        self._queue_depth = queue_depth
        self._ledger = ledger

    def collect(self) -> Iterable[GaugeMetricFamily]:
        depth = GaugeMetricFamily("omnigraph_queue_depth", "Requests admitted and not yet finished")
        value = self._queue_depth()
        if value is not None:
            depth.add_metric([], value)
        yield depth
        ledger = self._ledger() or _NO_LEDGER
        capacity = GaugeMetricFamily("omnigraph_ledger_capacity", "Ledger capacity, by resource", labels=["resource"])
        charged = GaugeMetricFamily("omnigraph_ledger_reserved", "Ledger units reserved, by resource and state",
                                    labels=["resource", "state"])
        for constraint in ledger.constraints:
            capacity.add_metric([constraint.name], constraint.capacity)
            charged.add_metric([constraint.name, "held"], constraint.held)
            charged.add_metric([constraint.name, "quarantined"], constraint.quarantined)
        reservations = GaugeMetricFamily("omnigraph_ledger_reservations", "Live ledger reservations")
        reservations.add_metric([], ledger.reservations)
        yield from (capacity, charged, reservations)


_NO_LEDGER = LedgerMetrics(constraints=(), reservations=0)

#: Each stage's batching statistics by stage id: typed (`BatchMetrics`), or a `BatchStats.snapshot()`
#: dict, which is read through `BatchMetrics.from_stats`.
BatchStatsSource = Callable[[], Mapping[int, BatchMetrics | Mapping[str, Any]] | None]


class _BatchingMetrics(Collector):
    """Each stage's `BatchMetrics` (stages/metrics.py), as Prometheus histograms and gauges."""

    _HISTOGRAMS = (("batch_rows", "omnigraph_batch_rows", "Request rows per worker call (padding excluded)"),
                   ("batch_requests", "omnigraph_batch_requests", "Requests per worker call"),
                   ("queue_wait_seconds", "omnigraph_batch_queue_wait_seconds",
                    "Time a work item waited in its stage's queue"))

    def __init__(self, batch_stats: BatchStatsSource) -> None:
        self._batch_stats = batch_stats

    def collect(self) -> Iterable[HistogramMetricFamily | GaugeMetricFamily | CounterMetricFamily]:
        stages = [(str(stage), stats if isinstance(stats, BatchMetrics) else BatchMetrics.from_stats(stats))
                  for stage, stats in sorted((self._batch_stats() or {}).items())]
        for key, name, documentation in self._HISTOGRAMS:
            family = HistogramMetricFamily(name, documentation, labels=["stage"])
            for stage, batching in stages:
                histogram: HistogramMetrics = getattr(batching, key)
                buckets = [(floatToGoString(bound), count) for bound, count in histogram.buckets]
                family.add_metric([stage], buckets, histogram.sum)
            yield family
        efficiency = GaugeMetricFamily("omnigraph_batch_padding_efficiency",
                                       "Real over padded tokens of the calls so far (rows for graphs without tokens)",
                                       labels=["stage"])
        tokens = CounterMetricFamily("omnigraph_batch_tokens", "Tokens sent to workers, real or padded",
                                     labels=["stage", "kind"])
        for stage, batching in stages:
            if batching.padding_efficiency is not None:
                efficiency.add_metric([stage], batching.padding_efficiency)
            tokens.add_metric([stage, "real"], batching.tokens)
            tokens.add_metric([stage, "padded"], batching.padded_tokens)
        yield from (efficiency, tokens)


class ServerMetrics:
    """The metrics one app exports at `GET /metrics` (inside vLLM: in vLLM's own registry).
    `ledger` returns the engine's `LedgerMetrics` and `batch_stats` each graph stage's `BatchMetrics`
    by stage id (both None before start): typed records of stages/metrics.py."""

    def __init__(self, queue_depth: Callable[[], int | None], ledger: Callable[[], LedgerMetrics | None],
                 registry: CollectorRegistry | None = None, *,
                 batch_stats: BatchStatsSource | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        self.requests = Counter("omnigraph_http_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.request_latency = Histogram("omnigraph_http_request_duration_seconds",
                                         "Time from request start to response, by route", ["route"],
                                         buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.stage_latency = Histogram("omnigraph_stage_duration_seconds", "Time a request spent in each stage",
                                       ["stage"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.disconnects = Counter("omnigraph_client_disconnects", "Requests aborted because their client went away",
                                   registry=self.registry)
        self.registry.register(_EngineGauges(queue_depth, ledger))
        if batch_stats is not None:
            self.registry.register(_BatchingMetrics(batch_stats))

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
        self.request_latency.labels(route=route).observe(seconds)

    def observe_stages(self, durations: Mapping[int | str, float]) -> None:
        for stage, seconds in durations.items():
            self.stage_latency.labels(stage=str(stage)).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
