"""Why a worker call failed: one class per kind of fault (wire faults derive from WireError).

Codes a worker reports in error frames besides the wire codes (``RemoteError.code``):

    not_loaded              run before a successful load
    bundle_invalid          the bundle failed re-verification inside the worker (LoadRefused)
    load_failed             ONNX Runtime could not build the session (LoadRefused)
    placement_refused       the real node placement broke the route's rules (PlacementRefused)
    input_name_mismatch     run inputs missing or not declared by the graph
    input_dtype_mismatch    a run input of another element type than the graph declares
    input_rank_mismatch     a run input of another rank than the graph declares
    input_shape_mismatch    a run input whose static dims differ from the graph's
    run_failed              ONNX Runtime raised during the run
    outputs_not_sent        the run's outputs break the wire's limits (more bytes than the route's
                            max_io_bytes, say); the message names the wire code; nothing was sent
    unexpected_message      a message type the worker does not accept in its state
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omnigraph.workers.wire import WireError

if TYPE_CHECKING:
    from omnigraph.workers.reports import PlacementReport

__all__ = [
    "WireError", "WorkerError", "WorkerDied", "WorkerBusy", "WorkerTimeout", "WorkerStartFailed",
    "CallRefused", "RemoteError", "LoadRefused", "PlacementRefused",
]


class WorkerError(Exception):
    """A graph worker could not do what was asked."""


class WorkerDied(WorkerError):
    """The worker process is gone; ``exit_status`` is its waitpid status (negative: the signal)."""

    def __init__(self, message: str, *, exit_status: int | None) -> None:
        super().__init__(message)
        self.exit_status = exit_status


class WorkerStartFailed(WorkerError):
    """The worker process did not come up (bad interpreter, no hello in time, a wrong hello)."""


class WorkerBusy(WorkerError):
    """A call is already in flight on this client (one at a time)."""


class WorkerTimeout(WorkerError):
    """The call's reply did not come in time; the worker was retired (killed), as its call cannot
    be pre-empted."""


class _CodedError(WorkerError):
    """A refusal with a stable ``code`` and its ``message``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class CallRefused(_CodedError):
    """The client refused a call before sending a byte: its tensors break the wire's limits (too
    large for the route's max_io_bytes, an unknown dtype...). ``code`` is the wire error's; the
    worker never saw the call and stays in step."""


class RemoteError(_CodedError):
    """The worker refused or failed a request; ``code`` is stable (see this module's docstring)."""


class LoadRefused(RemoteError):
    """The worker refused to load the bundle; ``report`` is the placement seen, if any."""

    def __init__(self, code: str, message: str, report: PlacementReport | None = None) -> None:
        super().__init__(code, message)
        self.report = report


class PlacementRefused(LoadRefused):
    """The real node placement broke the route's rules; ``report`` names the off-target nodes."""

    report: PlacementReport
