"""What a graph stage accepts: its declared inputs, and the check every handoff passes.

Checked in the controller, before a request touches a worker, so a wrong name, dtype or shape is
a precise error naming the stage and tensor instead of a remote failure after a round trip.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from omnigraph.stages.errors import HandoffInvalid
from omnigraph.workers.reports import LoadReport

# ONNX Runtime's element type names -> numpy; bfloat16 travels as its raw uint16 bits (see wire.py).
_ORT_TYPES = {
    "tensor(bool)": np.bool_, "tensor(int8)": np.int8, "tensor(int16)": np.int16,
    "tensor(int32)": np.int32, "tensor(int64)": np.int64, "tensor(uint8)": np.uint8,
    "tensor(float16)": np.float16, "tensor(bfloat16)": np.uint16, "tensor(float)": np.float32,
    "tensor(double)": np.float64,
}


@dataclass(frozen=True)
class InputSpec:
    """One declared graph input: dims are ints (fixed) or None (symbolic / dynamic)."""

    name: str
    dtype: np.dtype
    shape: tuple[int | None, ...]

    def describe(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.dtype.name}[{dims}]"


def input_specs(report: LoadReport) -> dict[str, InputSpec]:
    """The inputs the worker's session declares, as the loaded bundle reports them."""
    specs = {}
    for spec in report.inputs:
        if spec.onnx_type not in _ORT_TYPES:
            raise HandoffInvalid(f"{report.component}: input {spec.name!r} has type {spec.onnx_type}, "
                                 "which no wire carries")
        shape = tuple(d if isinstance(d, int) else None for d in spec.shape)
        specs[spec.name] = InputSpec(spec.name, np.dtype(_ORT_TYPES[spec.onnx_type]), shape)
    return specs


def check_tensors(where: str, tensors: Any, specs: Mapping[str, InputSpec]) -> dict[str, np.ndarray]:
    """`tensors` if it is exactly the declared inputs with matching dtypes and shapes."""
    if type(tensors) is not dict and not isinstance(tensors, Mapping):  # dict: the common case, checked fast
        raise HandoffInvalid(f"{where}: expected a mapping of input name -> array, got {type(tensors).__name__}")
    if tensors.keys() != specs.keys():
        missing = sorted(specs.keys() - tensors.keys())
        extra = sorted(tensors.keys() - specs.keys())
        raise HandoffInvalid(f"{where}: inputs do not match the bundle: missing {missing}, unexpected {extra}")
    for name, spec in specs.items():
        array = tensors[name]
        if not isinstance(array, np.ndarray):
            raise HandoffInvalid(f"{where}: input {name!r} must be a numpy array, got {type(array).__name__}")
        if array.dtype != spec.dtype:
            raise HandoffInvalid(f"{where}: input {name!r} is {array.dtype.name}, "
                                 f"the bundle declares {spec.describe()}")
        if array.ndim != len(spec.shape) or any(d is not None and d != n for d, n in zip(spec.shape, array.shape)):
            raise HandoffInvalid(f"{where}: input {name!r} has shape {list(array.shape)}, "
                                 f"the bundle declares {spec.describe()}")
    return dict(tensors)
