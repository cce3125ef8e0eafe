"""Laya across requests: merged calls give every request the answer it gets alone, padding never
reaches a response, and a request's failure or cancellation stays its own."""

import asyncio
import functools
import json
import sys

import numpy as np
import pytest

from omnigraph import AsyncOmni, Omni
from omnigraph.bundles import verify_bundle
from omnigraph.pipelines.deploy import GRAPH_BACKEND, validate_deploy_config
from omnigraph.pipelines.laya.batching import LayaBatchAdapter
from omnigraph.pipelines.laya.export import cached_bundle
from omnigraph.pipelines.laya.processor import LayaProcessor
from omnigraph.pipelines.laya.synth import cached_checkpoint
from omnigraph.pipelines.registry import get_pipeline, resolve_dotted
from omnigraph.stages.batching import BatchLimits, Footprint, StageQueue
from omnigraph.stages.errors import RequestCancelled
from omnigraph.workers.route import WorkerRoute

WORDS = "refund order please charge late customer angry ticket email billing thanks error invoice twice".split()
# One merged call gathers everything queued within this wait: Omni submits a list of prompts at once.
GATHER_ALL = {"max_batch_rows": 32, "batch_wait_us": 100_000}


def state(n: int) -> str:
    return " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(n))


def noul(text: str) -> dict:
    return {"type": "noul", "instructions": text}


def choice(options: int) -> dict:
    return {"type": "choice", "instructions": "Which team handles it?",
            "criteria": {f"team{i}": f"handles case {i} {state(i)}" for i in range(options)}}


def score(levels: int) -> dict:
    return {"type": "score", "instructions": "How urgent is it?", "criteria": [f"level {state(i + 1)}" for i in range(levels)]}


# Different lengths (within and across length classes), kinds, option counts and question counts.
REQUESTS = [
    {"state": "Please refund the duplicate charge.", "questions": {"refund": noul("Does the customer ask for a refund?")}},
    {"state": state(12), "questions": {"team": choice(3)}},
    {"state": state(30), "questions": {"urgency": score(5), "angry": noul("Is the customer angry?")}},
    {"state": state(150), "questions": {"refund": noul("Refund?")}},
    {"state": state(8), "questions": {"team": choice(7), "urgency": score(3), "late": noul("Is it late?")}},
    {"state": "hello", "questions": {"hello": noul("Is it a greeting?")}},
    {"state": state(60), "questions": {"team": choice(2)}},
    {"state": "Please refund the duplicate charge.", "questions": {"refund": noul("Does the customer ask for a refund?")}},
]


@pytest.fixture(scope="module")
def bundle():
    return resolve_dotted(get_pipeline("laya").default_bundle)()


@pytest.fixture(scope="module")
def processor(bundle):
    return LayaProcessor({0: verify_bundle(bundle)})


def route(**options) -> WorkerRoute:
    return WorkerRoute(name="test", interpreter=sys.executable, **options)


@pytest.fixture(scope="module")
def fixed_shape_bundle():
    """A bundle that runs at the call's shapes (bf16: the fp32 one computes real tokens only)."""
    return cached_bundle(cached_checkpoint("tiny"), precision="bf16")


@pytest.fixture(scope="module")
def adapter(fixed_shape_bundle):
    """The adapter on a CUDA-graph route: rows padded to their power-of-two bucket."""
    return LayaBatchAdapter(verify_bundle(fixed_shape_bundle), route(ep="cuda", enable_cuda_graph=True))


def laya_plan(bundle, batching: dict):
    return validate_deploy_config({"pipeline": "laya", "stages": [{
        "stage_id": 0, "batching": batching,
        "backend": {"name": GRAPH_BACKEND, "manifest": str(bundle),
                    "route": {"name": "cpu", "interpreter": sys.executable, "intra_op_num_threads": 1}}}]})


def as_json(output) -> str:
    assert output.error is None, output.error
    return json.dumps(output.custom_output, sort_keys=True)


def test_answers_are_identical_alone_and_batched_with_other_lengths_and_kinds(bundle):
    with Omni(deploy_config=laya_plan(bundle, {"max_batch_rows": 1})) as omni:
        alone = [as_json(output) for prompt in REQUESTS for output in omni.generate([prompt])]
    with Omni(deploy_config=laya_plan(bundle, GATHER_ALL)) as omni:
        batched = [as_json(output) for output in omni.generate(REQUESTS)]
        stats = omni.execution_plan["stages"][0]["batching"]["stats"]
    assert batched == alone
    # merged for real: fewer calls than requests, one of them holding several requests
    assert stats["calls"] < len(REQUESTS) and stats["histograms"]["batch_requests"]["buckets"][0][1] < stats["calls"]
    assert stats["rows"] == 1 + sum(len(r["questions"]) for r in REQUESTS)  # and the warmup request's row
    assert 0.5 < stats["padding_efficiency"] < 1.0


def test_usage_counts_each_requests_own_tokens(bundle, processor):
    with Omni(deploy_config=laya_plan(bundle, GATHER_ALL)) as omni:
        outputs = omni.generate(REQUESTS)
    for request, output in zip(REQUESTS, outputs):
        tokens = processor.prepare(request).context.row_tokens
        assert output.custom_output["usage"] == {"input_tokens": sum(tokens), "output_tokens": 0}


def test_the_adapter_pads_the_merged_call_and_gives_each_item_its_own_rows_and_slots(processor, adapter):
    items = [processor.prepare(REQUESTS[i]).calls[0] for i in (0, 1, 4)]
    assert [item["input_ids"].shape[0] for item in items] == [1, 1, 3]  # real rows only
    packed = adapter.pack(items)
    length = max(item["input_ids"].shape[1] for item in items)
    markers = max(item["marker_pos"].shape[1] for item in items)
    assert packed["input_ids"].shape == (8, length) and packed["marker_pos"].shape == (8, markers)
    for name in packed:  # padding rows (five real rows, a bucket of eight) repeat the last real row
        assert all(np.array_equal(row, packed[name][4]) for row in packed[name][5:])
    first = items[0]
    assert np.array_equal(packed["input_ids"][0, :first["input_ids"].shape[1]], first["input_ids"][0])
    assert np.all(packed["input_ids"][0, first["input_ids"].shape[1]:] == processor.layout.pad_id)
    assert not packed["attention_mask"][0, first["input_ids"].shape[1]:].any()
    assert not packed["marker_mask"][0, first["marker_pos"].shape[1]:].any()
    outputs = {"logits": np.arange(8 * markers, dtype=np.float32).reshape(8, markers),
               "act_logits": np.arange(16, dtype=np.float32).reshape(8, 2)}
    shares = adapter.unpack(outputs, items)
    assert [share["logits"].shape for share in shares] == [(1, first["marker_pos"].shape[1]),
                                                          (1, items[1]["marker_pos"].shape[1]),
                                                          (3, items[2]["marker_pos"].shape[1])]
    assert shares[2]["act_logits"].tolist() == [[4, 5], [6, 7], [8, 9]]  # padding rows reach no one
    assert shares[0]["logits"].tolist() == [outputs["logits"][0, :first["marker_pos"].shape[1]].tolist()]
    with pytest.raises(ValueError, match="output 'logits' is \\[8, 1\\]; the packed call needs \\[8, "):
        adapter.unpack({**outputs, "logits": outputs["logits"][:, :1]}, items)


def test_routes_without_fixed_shapes_get_no_padding_rows(bundle, fixed_shape_bundle, processor):
    items = [processor.prepare(REQUESTS[i]).calls[0] for i in (0, 1, 4)]
    cpu = LayaBatchAdapter(verify_bundle(bundle), route())
    assert not cpu.fixed_shapes
    assert LayaBatchAdapter(verify_bundle(fixed_shape_bundle), route(ep="tensorrt")).fixed_shapes
    assert cpu.pack(items)["input_ids"].shape[0] == 5
    assert cpu.padded(functools.reduce(Footprint.combine, map(cpu.footprint, items))).rows == 5


def test_cuda_graph_routes_pad_rows_only_up_to_the_captured_size(fixed_shape_bundle, processor):
    """Like vLLM's cudagraph capture sizes: small calls pad to a captured bucket, large ones stay exact."""
    items = [processor.prepare(REQUESTS[i]).calls[0] for i in (0, 1, 4)]  # 5 rows
    bundle = verify_bundle(fixed_shape_bundle)
    graphs = LayaBatchAdapter(bundle, route(ep="cuda", enable_cuda_graph=True, cuda_graph_max_rows=4))
    assert [graphs.padded_rows(rows) for rows in (1, 3, 4, 5, 26)] == [1, 4, 4, 5, 26]
    assert graphs.pack(items)["input_ids"].shape[0] == 5
    assert LayaBatchAdapter(bundle, route(ep="cuda", enable_cuda_graph=True)).pack(items)[
        "input_ids"].shape[0] == 8  # the default captures up to 8 rows


@pytest.mark.parametrize("options", [{"ep": "cuda", "enable_cuda_graph": True}, {"ep": "tensorrt"}])
def test_an_unpadded_bundle_is_refused_on_fixed_shape_routes(bundle, options):
    """The fp32 bundle gathers its real tokens (a shape that follows the data), which neither a
    captured CUDA graph nor a TensorRT engine can run: refused when the stage is built."""
    verified = verify_bundle(bundle)
    assert verified.manifest.metadata.layout["unpadded"] is True
    with pytest.raises(ValueError, match="computes real tokens only .* runs fixed shapes"):
        LayaBatchAdapter(verified, route(**options))


class Item:
    def __init__(self, request_id: str, tensors: dict) -> None:
        self.request_id, self.tensors = request_id, tensors

    def is_live(self) -> bool:
        return True


def test_length_classes_token_limits_and_the_marker_cap_bound_what_a_call_holds(processor, adapter,
                                                                                 fixed_shape_bundle):
    work = {i: processor.prepare(request).calls[0] for i, request in enumerate(REQUESTS)}
    lengths = {i: item["input_ids"].shape[1] for i, item in work.items()}
    long_class = [i for i in work if lengths[i] > 128]
    assert long_class and len(long_class) < len(work)  # the 150-word state runs in another class

    def batches(adapter=adapter, **limits):
        stage_queue = StageQueue(BatchLimits(max_rows=32, wait_us=0, **limits), adapter)
        for i, tensors in work.items():
            stage_queue.put(Item(str(i), tensors))
        taken = []
        while stage_queue._entries:
            taken.append([int(entry.item.request_id) for entry in stage_queue.take()])
        return taken

    def total(batch, adapter=adapter):
        return functools.reduce(Footprint.combine, [adapter.footprint(work[i]) for i in batch])

    unlimited = batches()
    assert sorted(i for batch in unlimited for i in batch) == list(work)
    for batch in unlimited:  # one length class per call: no row padded past twice its own bucket
        assert max(lengths[i] for i in batch) <= 2 * min(lengths[i] for i in batch)
    limited = batches(max_tokens=256)  # an engine limit
    assert len(limited) > len(unlimited)
    for batch in limited:  # an item beyond a limit on its own still runs, alone
        assert len(batch) == 1 or BatchLimits(max_rows=32, max_tokens=256).admits(adapter.padded(total(batch)))
    # Laya's own cap on padded rows x marker slots (2048 by default) is the adapter's, not the engine's
    assert adapter.fits(total(list(work)[:1]))
    tight = LayaBatchAdapter(verify_bundle(fixed_shape_bundle), route(ep="cuda", enable_cuda_graph=True),
                             max_marker_slots=16)
    capped = batches(adapter=tight)
    assert len(capped) > len(unlimited)
    for batch in capped:
        assert len(batch) == 1 or tight.fits(total(batch, tight))


class FailingFinish:
    """Makes the processor's finish fail for one request state (the engine builds the processor)."""

    def __init__(self, monkeypatch, state_text: str) -> None:
        finish = LayaProcessor.finish

        def failing(processor, prepared, outputs):
            if prepared.context.request.state_text == state_text:
                raise ValueError(f"finish refused {state_text!r}")
            return finish(processor, prepared, outputs)

        monkeypatch.setattr(LayaProcessor, "finish", failing)


def test_a_request_failing_in_a_merged_call_fails_alone(bundle, monkeypatch):
    with Omni(deploy_config=laya_plan(bundle, {"max_batch_rows": 1})) as omni:
        alone = [as_json(output) for prompt in REQUESTS for output in omni.generate([prompt])]
    FailingFinish(monkeypatch, REQUESTS[2]["state"])
    with Omni(deploy_config=laya_plan(bundle, GATHER_ALL)) as omni:
        outputs = omni.generate(REQUESTS)
        stats = omni.execution_plan["stages"][0]["batching"]["stats"]
    assert "finish refused" in outputs[2].error
    assert [as_json(o) for i, o in enumerate(outputs) if i != 2] == [a for i, a in enumerate(alone) if i != 2]
    assert stats["calls"] < len(REQUESTS)


def test_cancelling_a_batched_request_leaves_its_batch_mates_their_answers(bundle):
    with Omni(deploy_config=laya_plan(bundle, {"max_batch_rows": 1})) as omni:
        alone = [as_json(output) for prompt in REQUESTS for output in omni.generate([prompt])]

    async def main():
        async with AsyncOmni(deploy_config=laya_plan(bundle, GATHER_ALL)) as omni:
            async def first(prompt, request_id):
                async for output in omni.generate(prompt, request_id=request_id):
                    return output

            tasks = [asyncio.create_task(first(prompt, f"r{i}")) for i, prompt in enumerate(REQUESTS)]
            while omni.queue_depth() < len(REQUESTS):
                await asyncio.sleep(0.001)
            await omni.abort("r1")  # while the replica still gathers its first call (a 100 ms wait)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            return results, omni.execution_plan["stages"][0]

    results, stage = asyncio.run(main())
    assert isinstance(results[1], RequestCancelled)
    assert [as_json(r) for i, r in enumerate(results) if i != 1] == [a for i, a in enumerate(alone) if i != 1]
    (replica,) = stage["replicas"]
    assert replica["generation"] == 1 and replica["state"] == "serving"
    assert stage["batching"]["stats"]["calls"] < len(REQUESTS) - 1
