"""Laya through the engine: the declaration, the default bundle, the processor at both ends."""

import asyncio

import pytest

from omnigraph import AsyncOmni, Omni
from omnigraph.pipelines.processor import RequestInvalid
from omnigraph.pipelines.registry import get_pipeline, resolve_dotted

REFUND = {"state": "Please refund the duplicate charge.",
          "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}}


@pytest.fixture(scope="module")
def laya_bundle():
    return resolve_dotted(get_pipeline("laya").default_bundle)()


def test_omni_runs_laya_from_the_pipeline_declaration(laya_bundle):
    with Omni(model="laya", bundle=laya_bundle) as omni:
        first, second = omni.generate([REFUND, REFUND])
        plan = omni.execution_plan
        audit = omni.audit()
        with pytest.raises(RequestInvalid) as invalid:
            omni.generate([REFUND, {"state": "x", "questions": {"q": {"type": "maybe", "instructions": "?"}}}])
        assert omni.queue_depth() == 0
    assert first.final_output_type == "decision" and first.error is None
    answer = first.custom_output["answers"]["refund"]
    assert answer["type"] == "noul" and 0.0 <= answer["noul"] <= 1.0
    assert first.custom_output["usage"]["output_tokens"] == 0
    assert first.custom_output == second.custom_output  # same request, same answer
    assert invalid.value.field.startswith("questions.q")
    assert plan["pipeline"] == "laya" and plan["stages"][0]["manifest"]["component"] == "laya.decision"
    assert plan["stages"][0]["replicas"][0]["route"]["name"] == "local-cpu"
    assert audit["model_hash"] == plan["stages"][0]["manifest"]["sha256"]


def test_async_omni_defaults_to_the_embedded_laya_bundle(laya_bundle):
    async def main():
        async with AsyncOmni() as omni:
            outputs = [o async for o in omni.generate(REFUND, request_id="refund")]
            return outputs, omni.execution_plan["stages"][0]["manifest"]["path"]

    outputs, manifest = asyncio.run(main())
    assert len(outputs) == 1 and outputs[0].request_id == "refund" and "refund" in outputs[0].custom_output["answers"]
    assert manifest.startswith(str(laya_bundle))
