"""The engine's small typed interfaces: what the orchestrator hands a stage, and what every stage
(graph_stage.py, native_stage.py) offers the runtime and the orchestrator.

The orchestrator and the runtime speak only these; which kind of stage runs a step is the
runtime's business when it builds the chain, nobody else's."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from omnigraph.stages.tensors import InputSpec

# (outputs of earlier stages by stage id, the request's own tensors) -> {"tensors": {...}} for the next
HandoffFunc = Callable[[Mapping[int, Mapping[str, np.ndarray]], Mapping[str, np.ndarray]], Mapping[str, Any]]


class WorkItem(Protocol):
    """One request's work at one stage: the orchestrator's unit, run by a replica."""

    request_id: str
    tensors: Mapping[str, np.ndarray]

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

    def count_admissions(self, admitted: Callable[[], int]) -> None:
        """How many requests the orchestrator has admitted (a batcher waits for mates only then)."""
        ...

    def status(self) -> tuple[str, str | None]:
        """(ok | degraded | recovering | unavailable | failed, why)."""
        ...

    def describe(self) -> dict[str, Any]: ...

    def stop_replacing(self) -> None: ...

    def stop(self, timeout: float) -> None: ...
