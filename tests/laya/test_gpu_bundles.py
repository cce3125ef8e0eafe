"""Laya bundles on the CUDA execution provider, end to end through `Omni`, against the fp32 bundle
on the CPU: the plain fp32 and bf16 bundles (whose encoder runs on ONNX Runtime's fused attention
and rotary operators, which the CUDA provider implements too) and the `fast` bundle (the omnigraph
custom-op library), with and without CUDA graphs. Runs on the GPU machine only."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import onnxruntime as ort
import pytest

from omnigraph import Omni
from omnigraph.pipelines.deploy import GRAPH_BACKEND, validate_deploy_config
from omnigraph.pipelines.laya.export import cached_bundle
from omnigraph.pipelines.laya.synth import cached_checkpoint
from omnigraph.workers.ops.build import find_nvcc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                       reason="needs onnxruntime-gpu with a CUDA device"),
]

REQUESTS = [
    {"state": "Please refund the duplicate charge.",
     "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}},
    {"state": "The printer on floor 3 jams every morning and the toner is low. " * 6,
     "questions": {"team": {"type": "choice", "instructions": "Which team handles this?",
                            "criteria": {"facilities": "the building", "it": "devices", "finance": None}},
                   "urgency": {"type": "score", "instructions": "How urgent is it?",
                               "criteria": ["low", "medium", "high"]}}},
]
# Drift allowed against fp32 on the CPU, on any number of an answer: fp32 on CUDA (TF32 off, see
# workers/session.py) differs only in summation order; bf16 projections carry issue 4's 0.002. The
# fast bundle misses issue 7's 0.002 (0.0035 here on the H200, 0.0059 on the full checkpoint, in
# benchmarks/results/RESULTS.md#laya-gpu-h200): this bound only guards against regressions.
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-3, "fast": 5e-3}


def _answers(bundle: Path, ep: str, *, cuda_graph: bool = False) -> list[dict[str, Any]]:
    route = {"name": f"test-{ep}", "interpreter": sys.executable, "ep": ep}
    if ep == "cuda":
        route.update(device_id=0, enable_cuda_graph=cuda_graph)
    # ONNX Runtime keeps shape arithmetic (Shape, Gather, Slice of shapes) on the CPU: about 14% of
    # these graphs' nodes, none of their compute.
    placement = ({"allowed_providers": ["CUDAExecutionProvider", "CPUExecutionProvider"], "min_fraction_on_target": 0.8}
                 if ep == "cuda" else {})
    plan = validate_deploy_config({"pipeline": "laya", "stages": [
        {"stage_id": 0, "backend": {"name": GRAPH_BACKEND, "manifest": str(bundle), "route": route, **placement}}]})
    with Omni(deploy_config=plan) as omni:
        outputs = omni.generate(REQUESTS)
    assert all(output.error is None for output in outputs), [output.error for output in outputs]
    return [output.custom_output["answers"] for output in outputs]


def _numbers(value: Any, path: str = "") -> dict[str, float]:
    """Every number of an answer by its path (probabilities, noul, score, confidences, action)."""
    if isinstance(value, dict):
        return {key: number for name, item in value.items() for key, number in _numbers(item, f"{path}.{name}").items()}
    return {path: float(value)} if isinstance(value, (int, float)) else {}


def _drift(expected: list[dict[str, Any]], got: list[dict[str, Any]]) -> float:
    """The largest difference of any number of any answer; the decisions themselves must agree."""
    worst = 0.0
    for want, have in zip(expected, got, strict=True):
        assert [(q, a.get("choice")) for q, a in want.items()] == [(q, a.get("choice")) for q, a in have.items()]
        want_numbers, have_numbers = _numbers(want), _numbers(have)
        assert want_numbers.keys() == have_numbers.keys()
        worst = max(worst, *(abs(number - have_numbers[key]) for key, number in want_numbers.items()))
    return worst


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    """The small synthetic checkpoint: heads of 64, a size the fast attention kernel supports
    (the tiny one's heads of 16 are refused on CUDA with that reason)."""
    return cached_checkpoint("small")


@pytest.fixture(scope="module")
def cpu_answers(checkpoint: Path) -> list[dict[str, Any]]:
    return _answers(cached_bundle(checkpoint), "cpu")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_plain_bundles_on_cuda_match_fp32_on_the_cpu(checkpoint, cpu_answers, precision):
    answers = _answers(cached_bundle(checkpoint, precision=precision), "cuda")
    assert _drift(cpu_answers, answers) <= TOLERANCE[precision]


@pytest.mark.skipif(find_nvcc() is None, reason="the fast bundle builds the op library with nvcc")
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["plain", "cuda-graph"])
def test_the_fast_bundle_on_cuda_matches_fp32_on_the_cpu(checkpoint, cpu_answers, cuda_graph):
    answers = _answers(cached_bundle(checkpoint, precision="bf16", fast=True), "cuda", cuda_graph=cuda_graph)
    assert _drift(cpu_answers, answers) <= TOLERANCE["fast"]
