"""Errors of the engine room; each says which stage, request or constraint is concerned."""

from __future__ import annotations


class StageError(RuntimeError):
    """Base class for errors raised by the stage runtime and orchestrator."""


class ResourceUnavailable(StageError):
    """Admission refused at once (queue full): retry later (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ReservationRefused(StageError):
    """The ledger cannot charge a demand: names the constraint, the demand and what is free."""

    def __init__(self, owner: str, constraint: str, demand: int, free: int, *, reason: str = "") -> None:
        super().__init__(
            f"{owner}: cannot reserve {demand} of {constraint!r}: {reason or f'only {free} free'}"
        )
        self.owner = owner
        self.constraint = constraint
        self.demand = demand
        self.free = free


class CapacityConflict(StageError):
    """Two stages declare different capacities for the same constraint."""


class StageStartupError(StageError):
    """A stage failed to start, load or warm up; everything started so far was unwound."""

    def __init__(self, stage_id: int, replica: int, message: str) -> None:
        super().__init__(f"stage {stage_id} replica {replica}: {message}")
        self.stage_id = stage_id
        self.replica = replica


class StartupCancelled(StageError):
    """The pipeline's start was cancelled (a signal); everything started so far was unwound."""


class StageUnavailable(StageError):
    """A stage cannot serve now: `retry_after` seconds while it recovers (a replacement starting,
    a backoff, a changed bundle), None only for a stage down for good (`max_restarts: 0`)."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class HandoffInvalid(StageError):
    """Tensors handed to a stage do not match the inputs its bundle declares."""


class RequestCancelled(StageError):
    """The request was aborted before it finished."""


class DeadlineExceeded(StageError):
    """The request's deadline passed before it finished (HTTP 504)."""


class PipelineClosed(StageError):
    """The pipeline was shut down; no further requests are accepted."""
