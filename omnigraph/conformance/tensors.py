"""Tensors written as fixture data: `{"dtype", "shape", "values" | "fill"}` -> numpy arrays, and back.

`values` is a flat or nested list; `fill` is `"arange"` (0, 1, 2, ... in the dtype) or `"zeros"`.
`bfloat16` (which numpy lacks) is built as uint16 arrays of the raw bits, the way the wire carries
it: values are rounded to float32 and their upper 16 bits kept, so give values bfloat16 can hold.
Comparison of outputs is exact for integers and booleans and within `atol` for floats.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from omnigraph.conformance.suite import FixtureInvalid

# The dtype names the fixtures use (numpy spellings; the wire whitelist is the target's business).
FIXTURE_DTYPES = (
    "bool", "int8", "uint8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"
)


def tensor_from_spec(spec: Mapping[str, Any], *, where: str) -> np.ndarray:
    """Build the array a fixture describes; raises FixtureInvalid for a spec that makes no sense."""
    dtype = spec.get("dtype")
    if dtype not in FIXTURE_DTYPES:
        raise FixtureInvalid(f"{where}: dtype must be one of {FIXTURE_DTYPES}, got {dtype!r}")
    shape = spec.get("shape")
    if not isinstance(shape, list) or not all(type(dim) is int and dim >= 0 for dim in shape):
        raise FixtureInvalid(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    count = int(np.prod(shape, dtype=np.int64))
    if dtype == "bfloat16":
        as_float = tensor_from_spec({**spec, "dtype": "float32"}, where=where)
        return (as_float.view(np.uint32) >> 16).astype(np.uint16)
    if "values" in spec:
        array = np.asarray(spec["values"], dtype=dtype).reshape(-1)
        if array.size != count:
            raise FixtureInvalid(f"{where}: {array.size} values for shape {shape}")
    elif spec.get("fill") == "arange":
        array = np.arange(count).astype(dtype)
    elif spec.get("fill") == "zeros":
        array = np.zeros(count, dtype=dtype)
    else:
        raise FixtureInvalid(f"{where}: give 'values' or 'fill' ('arange' | 'zeros')")
    return array.reshape(shape)


def compare_tensors(
    expected: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray], *, atol: float
) -> list[str]:
    """Every difference between two name -> array maps, as readable lines (empty when they agree)."""
    problems = []
    if set(expected) != set(actual):
        problems.append(f"output names {sorted(actual)} != expected {sorted(expected)}")
    for name in sorted(set(expected) & set(actual)):
        want, got = expected[name], np.asarray(actual[name])
        if got.dtype != want.dtype or got.shape != want.shape:
            problems.append(f"{name}: {got.dtype}{list(got.shape)} != expected {want.dtype}{list(want.shape)}")
        elif want.dtype.kind == "f":
            if not np.allclose(got, want, atol=atol, rtol=0.0, equal_nan=True):
                worst = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
                problems.append(f"{name}: max |difference| {worst:.3g} > atol {atol}")
        elif not np.array_equal(got, want):
            problems.append(f"{name}: values {got.reshape(-1)[:8].tolist()} "
                            f"!= expected {want.reshape(-1)[:8].tolist()}")
    return problems
