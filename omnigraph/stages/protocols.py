"""The engine's small typed interfaces: what the orchestrator hands a stage, and what every stage
(graph_stage.py, native_stage.py) offers the runtime and the orchestrator.

The orchestrator and the runtime speak only these; which kind of stage runs a step is the
runtime's business when it builds the chain, nobody else's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from omnigraph.pipelines.deploy import StageDeployConfig
from omnigraph.stages.ledger import Reservation, ResourceLedger
from omnigraph.stages.metrics import StageMetrics
from omnigraph.stages.monitor import StageMonitor
from omnigraph.stages.tensors import InputSpec

if TYPE_CHECKING:
    from omnigraph.bundles import VerifiedBundle

# (outputs of earlier stages by stage id, the request's own tensors) -> {"tensors": {...}} for the next
HandoffFunc = Callable[[Mapping[int, Mapping[str, np.ndarray]], Mapping[str, np.ndarray]], Mapping[str, Any]]


class WorkItem(Protocol):
    """One request's work at one stage: the orchestrator's unit, run by a replica."""

    request_id: str
    tensors: Mapping[str, np.ndarray]

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop its request finishes on (None: a blocking caller's request). A stage may
        run the item's call from that loop when it is submitted there (graph_stage.py)."""
        ...

    def is_live(self) -> bool:
        """Whether its request still wants it (not failed, cancelled or past its deadline)."""
        ...

    def dispatched(self) -> None:
        """A call carrying it starts (where its request is, for the deadline's message)."""
        ...

    def complete(self, outputs: dict[str, np.ndarray], seconds: float) -> None: ...
    def fail(self, error: BaseException) -> None: ...

    def keep_admission(self) -> Callable[[], None]:
        """The request is gone but its call still runs (fenced): keep a queue slot for it until the
        call ends, so admission counts what the workers are busy with; returns what gives it back."""
        ...


class Stage(Protocol):
    """A started stage of the chain: takes work items, says whether it can serve, stops."""

    stage_id: int
    input_specs: dict[str, InputSpec]
    handoff: HandoffFunc

    @property
    def max_io_bytes(self) -> int:
        """The largest tensor payload one call may carry (what a raw-tensor processor checks)."""
        ...

    def submit(self, item: WorkItem) -> None:
        """Queue `item`; raises StageUnavailable when the stage cannot serve now."""
        ...

    def check_available(self) -> None:
        """Raise StageUnavailable (with its Retry-After) unless the stage can take work now."""
        ...

    def interrupt(self, request_id: str, reason: str) -> None:
        """The request is gone (cancelled, aborted): stop its work where the stage can."""
        ...

    def count_requests(self, admitted: Callable[[], int], in_flight: Callable[[], int]) -> None:
        """How many requests are admitted and not yet acknowledged (a batcher waits for mates only
        while others are), and how many of them are in flight, their outputs not all in (a lone
        one may be called from its event loop)."""
        ...

    def status(self) -> tuple[str, str | None]:
        """(ok | degraded | recovering | unavailable | failed, why)."""
        ...

    def describe(self) -> dict[str, Any]: ...

    def stop_replacing(self) -> None: ...

    def stop(self, timeout: float) -> None: ...


class ServingStage(Stage, Protocol):
    """What the runtime does with a stage from its start to its shutdown (graph_stage.GraphStage,
    native_stage.NativeStage); the orchestrator sees only `Stage`. The runtime calls, in order:
    `bind` for every stage, `start_replica` for every replica of every stage (all reserved at
    once beforehand), `loaded` for every stage, `check_consumer` for every stage but the last,
    then `start_serving`; `abort_start` when any of it failed."""

    deploy: StageDeployConfig

    @property
    def bundle(self) -> VerifiedBundle | None:
        """The verified bundle the stage runs (None: it runs none of its own)."""
        ...

    def bind(self, verified: Sequence[VerifiedBundle]) -> None:
        """Before any start: every graph stage's verified bundle (where a native stage's model is)."""
        ...

    def start_replica(self, replica: int, reservation: Reservation, ledger: ResourceLedger,
                      launched: list[Any]) -> None:
        """Start one replica under its reservation; a worker process started joins `launched` (to
        be unwound if the start fails)."""
        ...

    def loaded(self) -> None:
        """Every replica started: settle what the loaded replicas say (inputs, batching)."""
        ...

    def check_consumer(self, following: Stage) -> None:
        """Refuse a next stage whose inputs cannot take this stage's outputs."""
        ...

    def abort_start(self, timeout: float) -> None:
        """The start failed: stop what this stage started that the runtime does not unwind."""
        ...

    def start_serving(self, monitor: StageMonitor) -> None:
        """Take work from now on, the monitor watching what needs watching."""
        ...

    def metrics(self) -> StageMetrics:
        """The stage's counters as a typed record (what `/metrics` exports)."""
        ...
