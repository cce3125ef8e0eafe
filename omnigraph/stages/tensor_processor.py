"""The processor of a raw graph pipeline (one without a model processor).

The prompt is `{"tensors": {name: array}}` for the first stage; the answer is the final stage's
tensors. Checking the prompt here turns a wrong tensor into `RequestInvalid` (the caller's
fault) before anything is queued.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from omnigraph.pipelines.processor import PreparedRequest, RequestInvalid, RequestTooLarge
from omnigraph.stages.errors import HandoffInvalid
from omnigraph.stages.tensors import InputSpec, check_tensors


class TensorProcessor:
    """Passes tensors through: prepare checks them, finish returns the final outputs."""

    def __init__(self, entry_specs: Mapping[str, InputSpec], *, max_io_bytes: int) -> None:
        self._specs = dict(entry_specs)
        self._max_io_bytes = max_io_bytes

    def prepare(self, request: Mapping[str, Any]) -> PreparedRequest:
        if not isinstance(request, Mapping) or len(request) != 1 or "tensors" not in request:
            raise RequestInvalid("tensors", 'a raw graph pipeline takes {"tensors": {name: numpy array}}')
        try:
            tensors = check_tensors("tensors", request["tensors"], self._specs)
        except HandoffInvalid as exc:
            raise RequestInvalid("tensors", str(exc).removeprefix("tensors: ")) from None
        size = sum(array.nbytes for array in tensors.values())
        if size > self._max_io_bytes:
            raise RequestTooLarge("tensors", f"{size} bytes of tensors; the stage's route takes at most "
                                             f"{self._max_io_bytes}")
        return PreparedRequest(calls=(tensors,), context=None)

    def finish(self, prepared: PreparedRequest, outputs: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        return dict(outputs[0])

    def warmup_request(self) -> None:
        """Raw tensors have no request of their own: each worker's load warmed up its graph."""
        return None

    def audit(self) -> dict[str, Any]:
        return {}
