"""OmniRequestOutput: what a finished request hands back (vllm-omni's name and fields)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class OmniRequestOutput:
    """One request's result.

    `custom_output` is the processor's finished response (for Laya: the decision response dict) or,
    for a raw graph pipeline, the final stage's tensors. `stage_durations` maps stage id -> seconds
    spent in that stage's worker calls (summed over the request's work items). `error` is set (and
    `custom_output` is None) when `Omni.generate` reports a failed prompt in its list.
    """

    request_id: str
    stage_id: int
    finished: bool
    final_output_type: str
    custom_output: Any
    stage_durations: dict[int, float] = field(default_factory=dict)
    error: str | None = None
    _release: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def acknowledge(self) -> None:
        """Acknowledge the result: the pipeline drops its hold on the request (and its admission slot).

        `AsyncOmni.generate` and `Omni.generate` do this themselves; callers of the orchestrator
        call it once they have consumed `custom_output`. Calling it again does nothing.
        """
        release, self._release = self._release, None
        if release is not None:
            release()
