"""Prometheus metrics of one server: its own registry, so two apps in one process never collide.

Every `omnigraph_*` series carries `model_name` (the served model's name, as vLLM labels its own);
per-stage series carry `stage` (the stage's name, `StagePipelineConfig.model_stage`), per-replica
series also `replica`. Counters and histograms are updated by the routes and the app's middleware
(requests by route and status, request outcomes by reason, prompt tokens, latency, stage times,
disconnects); queue depth, running and waiting requests, reservations, restarts, retirements,
replicas and each stage's batching statistics are read from the engine at scrape time (collectors),
so they are never stale: typed records (stages/metrics.py, `StageRuntime.metrics()`), never the
execution plan's `describe()` dicts.

Under `omnigraph serve` the registry also holds the `process_*` and `python_*` collectors, and the
`vllm:*` families of an in-process vLLM engine (which registers them in prometheus_client's default
registry). Inside `vllm serve` the metrics join vLLM's own registry, which has those already. The
HTTP, outcome and prompt-token counters are updated by `RequestMetrics` (plugin/api/app.py) under
both servers; inside `vllm serve` it counts omnigraph's routes only, vLLM's routes are vLLM's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from omnigraph.stages.metrics import EngineMetrics, HistogramMetrics, LedgerMetrics, StageMetrics
from omnigraph.stages.request_state import Phase

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

#: Routes whose requests are decisions: counted in `omnigraph_request_outcomes_total`.
DECISION_ROUTES = frozenset({"/v1/systemone", "/v1/systemone/batch", "/v1/chat/completions"})

#: Outcomes exported at zero from the start wherever they are counted (`ServerMetrics.count_outcomes`),
#: so a rate over them exists before the first one happens: "ok" and the `ApiError` codes of the
#: decision routes' common failures. Any other code a route answers with (an OpenAI route's own, say)
#: appears once it happened.
KNOWN_OUTCOMES = ("ok", "invalid_json", "invalid_utf8", "unsupported_media_type", "request_too_large",
                  "invalid_request", "model_not_found", "not_ready", "stage_recovering", "pipeline_failed",
                  "queue_full", "deadline_exceeded", "cancelled", "client_disconnected", "unauthorized",
                  "internal_error")


def _none() -> None:
    return None


@dataclass(frozen=True)
class EngineReadings:
    """What the collectors read from the engine when Prometheus scrapes; each returns None before
    the engine started. `DecisionService` has them all (`queue_depth`, `metrics`,
    `requests_by_phase`, `stage_names`)."""

    queue_depth: Callable[[], int | None] = _none
    engine: Callable[[], EngineMetrics | None] = _none
    requests_by_phase: Callable[[], Mapping[Phase, int] | None] = _none
    stage_names: Callable[[], Mapping[int, str] | None] = _none


class StageNames:
    """Each stage's `stage` label by stage id: its name (`model_stage`), read once the engine has
    started (names never change while it serves); a name two stages share gets `-<stage id>`;
    the stage id itself before the engine started."""

    def __init__(self, source: Callable[[], Mapping[int, str] | None]) -> None:
        self._source = source
        self._labels: dict[int, str] | None = None

    def labels(self) -> dict[int, str]:
        if self._labels is None:
            names = self._source()
            if names is None:
                return {}
            taken = list(names.values())
            self._labels = {stage_id: name if taken.count(name) == 1 else f"{name}-{stage_id}"
                            for stage_id, name in names.items()}
        return self._labels

    def label(self, stage_id: int | str) -> str:
        return self.labels().get(stage_id, str(stage_id)) if isinstance(stage_id, int) else stage_id


class _EngineCollector(Collector):
    """Everything read from the engine at scrape time, from one `EngineMetrics` per scrape."""

    def __init__(self, model_name: str, readings: EngineReadings, stage_names: StageNames) -> None:
        self._model = model_name
        self._readings = readings
        self._stage_names = stage_names

    def collect(self) -> Iterable[Metric]:
        engine = self._readings.engine()
        yield from self._requests()
        yield from self._ledger(_NO_LEDGER if engine is None else engine.ledger)
        stages = [] if engine is None else [(self._stage_names.label(stage.stage_id), stage)
                                            for stage in engine.stages]
        yield from self._stages(stages)
        yield from self._replicas(stages)
        yield from self._batching(stages)

    def _requests(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily("omnigraph_queue_depth",
                                  "Requests admitted and not yet finished, plus queue slots held for them",
                                  labels=["model_name"])
        value = self._readings.queue_depth()
        if value is not None:
            depth.add_metric([self._model], value)
        running = GaugeMetricFamily("omnigraph_requests_running",
                                    "Admitted requests a worker call is running for now", labels=["model_name"])
        waiting = GaugeMetricFamily("omnigraph_requests_waiting",
                                    "Admitted requests waiting in a stage's queue", labels=["model_name"])
        phases = self._readings.requests_by_phase()
        if phases is not None:
            running.add_metric([self._model], phases.get(Phase.RUNNING, 0))
            waiting.add_metric([self._model], phases.get(Phase.QUEUED, 0))
        yield from (depth, running, waiting)

    def _ledger(self, ledger: LedgerMetrics) -> Iterator[Metric]:
        capacity = GaugeMetricFamily("omnigraph_ledger_capacity", "Ledger capacity, by resource",
                                     labels=["model_name", "resource"])
        charged = GaugeMetricFamily("omnigraph_ledger_reserved", "Ledger units reserved, by resource and state",
                                    labels=["model_name", "resource", "state"])
        for constraint in ledger.constraints:
            capacity.add_metric([self._model, constraint.name], constraint.capacity)
            charged.add_metric([self._model, constraint.name, "held"], constraint.held)
            charged.add_metric([self._model, constraint.name, "quarantined"], constraint.quarantined)
        reservations = GaugeMetricFamily("omnigraph_ledger_reservations", "Live ledger reservations",
                                         labels=["model_name"])
        reservations.add_metric([self._model], ledger.reservations)
        yield from (capacity, charged, reservations)

    def _stages(self, stages: list[tuple[str, StageMetrics]]) -> Iterator[Metric]:
        labels = ["model_name", "stage"]
        live = GaugeMetricFamily("omnigraph_stage_live_replicas", "Replicas of the stage serving now", labels=labels)
        restarts = CounterMetricFamily("omnigraph_worker_restarts",
                                       "Replacement workers started for the stage (its restart budget spent)",
                                       labels=labels)
        deaths = CounterMetricFamily("omnigraph_worker_deaths",
                                     "Replicas of the stage retired: their worker died, broke the wire or hung",
                                     labels=labels)
        for name, stage in stages:
            live.add_metric([self._model, name], stage.live_replicas)
            restarts.add_metric([self._model, name], stage.restarts)
            deaths.add_metric([self._model, name], stage.retirements)
        yield from (live, restarts, deaths)

    def _replicas(self, stages: list[tuple[str, StageMetrics]]) -> Iterator[Metric]:
        labels = ["model_name", "stage", "replica"]
        calls = CounterMetricFamily("omnigraph_replica_calls",
                                    "Calls of the replica now in the slot (a replacement starts from zero; "
                                    "a native engine counts each pooled item)", labels=labels)
        fenced = CounterMetricFamily("omnigraph_replica_fenced_calls",
                                     "Calls of the replica now in the slot whose result a cancellation discarded",
                                     labels=labels)
        for name, stage in stages:
            for replica in stage.replicas:
                calls.add_metric([self._model, name, str(replica.replica)], replica.calls)
                fenced.add_metric([self._model, name, str(replica.replica)], replica.fenced_calls)
        yield from (calls, fenced)

    _HISTOGRAMS = (("batch_rows", "omnigraph_batch_rows", "Request rows per worker call (padding excluded)"),
                   ("batch_requests", "omnigraph_batch_requests", "Requests per worker call"),
                   ("queue_wait_seconds", "omnigraph_batch_queue_wait_seconds",
                    "Time a work item waited in its stage's queue"))

    def _batching(self, stages: list[tuple[str, StageMetrics]]) -> Iterator[Metric]:
        """Each graph stage's `BatchMetrics`: three histograms, and the tokens its calls carried
        (real ones, and the padding added to them, separately)."""
        batching = [(name, stage.batching) for name, stage in stages if stage.batching is not None]
        labels = ["model_name", "stage"]
        for key, metric, documentation in self._HISTOGRAMS:
            family = HistogramMetricFamily(metric, documentation, labels=labels)
            for name, batch in batching:
                histogram: HistogramMetrics = getattr(batch, key)
                buckets = [(floatToGoString(bound), count) for bound, count in histogram.buckets]
                family.add_metric([self._model, name], buckets, histogram.sum)
            yield family
        tokens = CounterMetricFamily("omnigraph_batch_tokens", "Real tokens sent to workers (padding excluded)",
                                     labels=labels)
        padding = CounterMetricFamily("omnigraph_batch_padding_tokens",
                                      "Padding tokens sent to workers beside the real ones", labels=labels)
        for name, batch in batching:
            tokens.add_metric([self._model, name], batch.tokens)
            padding.add_metric([self._model, name], batch.padded_tokens - batch.tokens)
        yield from (tokens, padding)


_NO_LEDGER = LedgerMetrics(constraints=(), reservations=0)


class VllmFamilies(Collector):
    """The `vllm:*` families of another registry (prometheus_client's default one, where an
    in-process vLLM engine registers its own), re-exported as they are; nothing without them."""

    def __init__(self, source: CollectorRegistry = REGISTRY) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        return [family for family in self._source.collect() if family.name.startswith("vllm:")]


class ServerMetrics:
    """The metrics one app exports at `GET /metrics` (inside vLLM: in vLLM's own registry, given
    as `registry`). `readings` says how to read the engine at scrape time (`EngineReadings`)."""

    def __init__(self, model_name: str, readings: EngineReadings, registry: CollectorRegistry | None = None) -> None:
        own = registry is None
        self.registry = registry = CollectorRegistry() if registry is None else registry
        self.model_name = model_name
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], Any] = {}
        self.requests = Counter("omnigraph_http_requests", "HTTP requests answered, by route and status",
                                ["model_name", "route", "status"], registry=registry)
        self.outcomes = Counter("omnigraph_request_outcomes",
                                "Decision requests answered, by outcome: ok, or the error code of the answer",
                                ["model_name", "outcome"], registry=registry)
        self.prompt_tokens = Counter("omnigraph_prompt_tokens", "Input tokens of the decisions answered",
                                     ["model_name"], registry=registry)
        self.request_latency = Histogram("omnigraph_http_request_duration_seconds",
                                         "Time from request start to response, by route", ["model_name", "route"],
                                         buckets=_LATENCY_BUCKETS, registry=registry)
        self.stage_latency = Histogram("omnigraph_stage_duration_seconds", "Time a request spent in each stage",
                                       ["model_name", "stage"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.disconnects = Counter("omnigraph_client_disconnects", "Requests aborted because their client went away",
                                   ["model_name"], registry=registry).labels(model_name=model_name)
        self.stage_names = StageNames(readings.stage_names)
        self.registry.register(_EngineCollector(model_name, readings, self.stage_names))
        if own:  # vLLM's registry has these already
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            GCCollector(registry=self.registry)
            self.registry.register(VllmFamilies())

    def _labelled(self, metric: MetricWrapperBase, *values: str) -> Any:
        """`metric`'s child for this model and `values`, made once: `labels` validates its
        arguments and takes a lock on every call (a few us, five times a request), and a child
        lives as long as its metric. Every label set here is bounded (routes, statuses, outcomes,
        stages)."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(self.model_name, *values)
        return child

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self._labelled(self.requests, route, str(status)).inc()
        self._labelled(self.request_latency, route).observe(seconds)

    def count_outcomes(self) -> None:
        """Export the outcomes (`KNOWN_OUTCOMES`) and prompt tokens at zero: called where something
        counts them (`omnigraph serve`'s middleware), so a server that does not shows no zeros."""
        self.prompt_tokens.labels(model_name=self.model_name)
        for outcome in KNOWN_OUTCOMES:
            self.outcomes.labels(model_name=self.model_name, outcome=outcome)

    def observe_outcome(self, outcome: str) -> None:
        """One decision request answered: "ok", or its error's code."""
        self._labelled(self.outcomes, outcome).inc()

    def observe_prompt_tokens(self, tokens: int) -> None:
        """The input tokens of one decision the engine answered."""
        self._labelled(self.prompt_tokens).inc(tokens)

    def observe_stages(self, durations: Mapping[int | str, float]) -> None:
        for stage, seconds in durations.items():
            self._labelled(self.stage_latency, self.stage_names.label(stage)).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
