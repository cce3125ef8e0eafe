"""What every model's exporter records the same way: its calibration's version, its own identity,
and the check of an exported graph in ONNX Runtime against a reference computed without it.

Each model folder's `export.py` builds its own graph; these helpers keep the manifest entries
they write (`calibration`, `exporter`, `validation`) in one form across models. Imported by
exporters only (never by serving code).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from omnigraph import __version__ as omnigraph_version

__all__ = ["BundleValidationFailed", "exporter_info", "validate_in_onnxruntime", "versioned_calibration"]


class BundleValidationFailed(RuntimeError):
    """The exported graph does not reproduce its reference within tolerance; nothing was written."""


def versioned_calibration(values: Mapping[str, Any]) -> dict[str, Any]:
    """metadata.calibration: `values` and a `version`, the sha256 of their canonical JSON."""
    canonical = json.dumps(dict(values), sort_keys=True, separators=(",", ":"))
    return {**values, "version": hashlib.sha256(canonical.encode()).hexdigest()}


def exporter_info(name: str, version: int, opset: int, **details: Any) -> dict[str, Any]:
    """metadata.exporter: the exporter module, its version, the library versions, and `details`."""
    import onnxruntime as ort

    return {"name": name, "version": version, "omnigraph": omnigraph_version, "onnx": onnx.__version__,
            "onnxruntime": ort.__version__, "opset": opset, **details}


def validate_in_onnxruntime(graph_path: Path, inputs: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray],
                            tolerance: float, *, reference: str, inputs_file: str) -> dict[str, Any]:
    """Run `graph_path` in ONNX Runtime (CPU) on `inputs` and compare each output named in
    `expected` with it; refuse a shape mismatch or a difference above `tolerance`.

    Returns metadata.validation: the `reference` described, the runtime, the `inputs_file` the
    inputs are stored in, and each output's largest absolute difference and tolerance.
    """
    import onnxruntime as ort

    session = ort.InferenceSession(str(graph_path), providers=["CPUExecutionProvider"])
    names = list(expected)
    diff = {}
    for name, actual in zip(names, session.run(names, dict(inputs))):
        want = expected[name]
        if actual.shape != want.shape:
            raise BundleValidationFailed(f"{graph_path.name}: {name} has shape {actual.shape}, the reference "
                                         f"({reference}) {want.shape}")
        diff[name] = float(np.abs(actual - want).max())
        if not diff[name] <= tolerance:
            raise BundleValidationFailed(f"{graph_path.name}: {name} differs from the reference ({reference}) by "
                                         f"{diff[name]:.3g} (tolerance {tolerance:g})")
    return {
        "reference": reference,
        "runtime": f"onnxruntime {ort.__version__} CPUExecutionProvider",
        "inputs": inputs_file,
        "max_abs_diff": diff,
        "tolerance": {name: tolerance for name in names},
    }
