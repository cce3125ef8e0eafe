"""The processor protocol: the model-specific ends of a pipeline.

A processor turns a user request into the first stage's input tensors (``prepare``) and the
last stage's output tensors back into the user's response (``finish``). The engine between them
never looks inside either: it only moves ``PreparedRequest.calls`` items through the stages and
hands their outputs back in the same order. That keeps every model's request schema, tokenizer,
calibration and response shape in its own folder, named by a dotted string in its
``PipelineConfig``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    pass

__all__ = ["PreparedRequest", "Processor", "ProcessorOutputInvalid", "RequestInvalid", "RequestTooLarge"]


class RequestInvalid(ValueError):
    """A request the processor refuses before any work reaches a stage.

    ``field`` is the dotted path of the offending part of the request, e.g.
    ``questions.refund.type``; the HTTP layer reports it with status 422.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class RequestTooLarge(RequestInvalid):
    """A request over one of the processor's size limits (the HTTP layer may answer 413)."""


class ProcessorOutputInvalid(RuntimeError):
    """Stage outputs that do not fit the prepared calls: a pipeline fault, not the caller's."""


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request: the forward calls it needs and what ``finish`` needs to answer it."""

    calls: tuple[dict[str, np.ndarray], ...]  # one forward call each: the first stage's inputs
    context: Any                              # whatever finish() needs (ids, order, usage)


class Processor(Protocol):
    """What every model's processor implements; the engine calls nothing else. A model's processor
    is built as `cls(bundles)`: its graph stages' verified bundles by stage id."""

    def prepare(self, request: Mapping[str, Any]) -> PreparedRequest:
        """Validate the whole request, then build its calls; raises ``RequestInvalid``."""
        ...

    def finish(self, prepared: PreparedRequest,
               outputs: Sequence[Mapping[str, np.ndarray]]) -> dict:
        """Build the response from one output mapping per ``prepared.calls`` item."""
        ...

    def warmup_request(self) -> dict | None:
        """A real request; readiness waits for it to pass through the whole pipeline. None: the
        pipeline has no request of its own (raw tensors), so nothing warms it up end to end."""
        ...

    def audit(self) -> dict:
        """What produced the answers: bundle hash, calibration, prompt template, precision."""
        ...
