"""End to end: Omni(model="laya", bundle=...) answers as the reference does.

The decision graph runs in an ONNX Runtime worker process, so its fp32 logits differ from the
reference's torch logits by float noise: categorical fields must be identical and every rounded
number within one unit of its last (4th) decimal.
"""

from __future__ import annotations

import math

import pytest

from omnigraph.plugin.omni import Omni

pytest.importorskip("laya")

REQUESTS = [
    {"model": "laya", "state": "Please refund the duplicate charge.",
     "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}},
    {"state": {"ticket": "My parcel is late and I was billed twice.", "priority": 2},
     "questions": {
         "team": {"type": "choice", "instructions": "Which team handles it?",
                  "criteria": {"billing": "payments, refunds", "shipping": "parcels", "other": None}},
         "urgency": {"type": "score", "instructions": "How urgent?",
                     "criteria": [f"urgency {i}" for i in range(32)]},
         "angry": {"type": "noul", "instructions": "Is the customer angry?",
                   "criteria": {"true": "uses strong words"}, "labels": {"false": "calm", "true": "angry"}},
     }},
    {"state": [{"role": "user", "content": f"turn {i}: the invoice [MASK] is wrong é 日本"} for i in range(60)],
     "questions": {"label": {"type": "choice", "instructions": {"task": "pick one"},
                             "criteria": [f"label {i}" for i in range(100)]}}},
    {"state": "refund " * 700,
     "questions": {f"q{i}": {"type": "noul", "instructions": f"Question {i}?"} for i in range(18)}},
]


def _assert_close(answer, expected, where: str) -> None:
    assert type(answer) is type(expected) and (not isinstance(answer, dict) or list(answer) == list(expected)), where
    if isinstance(expected, dict):
        for key in expected:
            _assert_close(answer[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, float):
        assert math.isclose(answer, expected, abs_tol=1.5e-4), f"{where}: {answer} != {expected}"
    else:
        assert answer == expected, where


@pytest.fixture(scope="module")
def omni(laya_tiny_bundle):
    with Omni(model="laya", bundle=laya_tiny_bundle.root) as omni:
        yield omni


def test_omni_answers_as_the_reference(omni, laya_reference_tiny):
    outputs = omni.generate(REQUESTS)
    for request, output in zip(REQUESTS, outputs):
        assert output.error is None
        response = output.custom_output
        reference = laya_reference_tiny.system_one(request["state"], request["questions"])
        assert response["model"] == request.get("model", "laya")
        _assert_close(response["answers"], reference["answers"], "answers")
        assert response["usage"] == {"input_tokens": reference["usage"]["input_tokens"], "output_tokens": 0}


def test_omni_reports_the_processor_audit(omni, laya_tiny_bundle):
    audit = omni.audit()
    assert audit["model_hash"] == laya_tiny_bundle.manifest_sha256
    assert audit["calibration_version"] == laya_tiny_bundle.manifest.metadata.calibration["version"]
