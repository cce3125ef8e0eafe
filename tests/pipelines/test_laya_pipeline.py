"""Laya through the engine: the declaration, the default bundle, the processor at both ends."""

import asyncio

import numpy as np
import pytest

from omnigraph import AsyncOmni, Omni
from omnigraph.plugin.omni import build_plan
from omnigraph.pipelines.processor import RequestInvalid
from omnigraph.pipelines.registry import get_pipeline, resolve_dotted
from omnigraph.stages.orchestrator import Orchestrator
from omnigraph.stages.runtime import StageRuntime

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


class RecordingProcessor:
    """The Laya processor, keeping the graph outputs each request's finish received."""

    def __init__(self, inner):
        self.inner = inner
        self.outputs = {}

    def prepare(self, request):
        return self.inner.prepare(request)

    def finish(self, prepared, outputs):
        self.outputs[prepared.context.request.state_text] = [dict(o) for o in outputs]
        return self.inner.finish(prepared, outputs)


def serve_together(laya_bundle, requests, batching):
    """Submit `requests` at once to a fresh Laya runtime; (answers, graph outputs, the replica)."""
    pipeline, deploy = build_plan("laya", bundle=laya_bundle)
    stage = deploy.stages[0]
    deploy = deploy.model_copy(update={"stages": [stage.model_copy(update={"batching": stage.batching.model_copy(update=batching)})]})
    runtime = StageRuntime(pipeline, deploy)
    runtime.start()
    try:
        processor = RecordingProcessor(resolve_dotted(pipeline.processor)(runtime.bundles))
        orchestrator = Orchestrator(runtime, processor)
        admitted = [orchestrator.submit(request) for request in requests]
        answers = [request.wait(120) for request in admitted]
        (replica,) = runtime.execution_plan()["stages"][0]["replicas"]
        return answers, processor.outputs, replica
    finally:
        runtime.shutdown()


def test_laya_batches_concurrent_requests_without_changing_answers(laya_bundle):
    assert get_pipeline("laya").stage(0).max_batch_rows == 32
    requests = [{"state": f"Customer {i} asks us to refund the duplicate charge of order {100 + i}.",
                 "questions": REFUND["questions"]} for i in range(8)]
    batched, batched_outputs, replica = serve_together(laya_bundle, requests, {"batch_wait_us": 100_000})
    alone, alone_outputs, single = serve_together(laya_bundle, requests, {"max_batch_rows": 1})
    assert replica["items"] == single["items"] == single["calls"] == 8 and replica["calls"] < 8
    assert batched == alone  # identical rounded answers
    for state, outputs in alone_outputs.items():
        for got, want in zip(batched_outputs[state], outputs):
            assert got.keys() == want.keys()
            for name in want:
                assert got[name].shape == want[name].shape
                np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-6)
