"""Cross-request batching: compatible queued work shares one worker call, each request gets its rows,
limits bound what a call holds, and a request's failure or cancellation stays its own."""

import asyncio
import os
import signal
import sys
import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from omnigraph import AsyncOmni, Omni
from omnigraph.bundles import pack_bundle, verify_bundle
from omnigraph.pipelines.config import PipelineConfigError, StagePipelineConfig
from omnigraph.pipelines.deploy import GRAPH_BACKEND, BatchingConfig, validate_deploy_config
from omnigraph.plugin.api.metrics import EngineReadings, ServerMetrics
from omnigraph.stages.batching import (
    DEFAULT_BATCH_WAIT_US, STOP, AxisZeroAdapter, BatchLimits, BatchShape, BatchStats, Footprint, StageQueue, split_rows,
)
from omnigraph.stages.errors import RequestCancelled, StageStartupError, StageUnavailable
from omnigraph.stages.metrics import BatchMetrics, EngineMetrics, LedgerMetrics, StageMetrics
from omnigraph.stages.graph_stage import GraphStage, worker_route

BLOCKER = {"tensors": {"x": np.ones((32768, 32), np.float32)}}  # keeps the one replica busy meanwhile
BATCHING = {"max_batch_rows": 8}


def rows_prompt(seed: int, rows: int, width: int) -> dict:
    return {"tensors": {"x": np.random.default_rng(seed).standard_normal((rows, width), dtype=np.float32)}}


class Item:
    """A queued work item as the stage queue sees it."""

    def __init__(self, request_id: str, rows: int, width: int = 4, dtype=np.float32, live: bool = True) -> None:
        self.request_id = request_id
        self.tensors = {"x": np.zeros((rows, width), dtype)}
        self.live = live

    def is_live(self) -> bool:
        return self.live


def queue(max_rows: int = 1, wait_us: int = 0, **limits) -> StageQueue:
    return StageQueue(BatchLimits(max_rows=max_rows, wait_us=wait_us, **limits), AxisZeroAdapter())


def take_ids(stage_queue: StageQueue, calls: int) -> list:
    taken = [stage_queue.take() for _ in range(calls)]
    return ["STOP" if batch is STOP else [entry.item.request_id for entry in batch] for batch in taken]


def test_the_queue_groups_compatible_items_within_the_row_limit():
    stage_queue = queue(max_rows=4)
    for item in (Item("a", 1), Item("b", 1, width=5), Item("c", 2), Item("gone", 1, live=False),
                 Item("d", 1, dtype=np.float64), Item("e", 2), Item("f", 1)):
        stage_queue.put(item)
    stage_queue.stop_one()
    # a + c fill 3 rows; e (2 more) does not fit, f does; the cancelled item is dropped unseen
    assert take_ids(stage_queue, 5) == [["a", "c", "f"], ["b"], ["d"], ["e"], "STOP"]


def test_an_item_at_the_limit_runs_alone_and_unbatched_stages_take_one_item():
    stage_queue = queue(max_rows=2)
    for item in (Item("big", 3), Item("small", 1), Item("other", 1)):
        stage_queue.put(item)
    assert take_ids(stage_queue, 2) == [["big"], ["small", "other"]]
    single = queue()
    single.put(Item("a", 1))
    single.put(Item("b", 1))
    assert take_ids(single, 1) == [["a"]]


def test_the_byte_limit_bounds_a_call_and_the_queue_records_how_long_items_waited():
    stage_queue = queue(max_rows=64, max_bytes=3 * 16)  # rows of 4 float32: three rows per call
    for name in "abcde":
        stage_queue.put(Item(name, 1))
    first = stage_queue.take()
    assert [entry.item.request_id for entry in first] == ["a", "b", "c"]
    assert all(entry.waited_s >= 0 for entry in first)
    assert take_ids(stage_queue, 1) == [["d", "e"]]


def test_a_free_replica_waits_for_work_arriving_after_it_took_the_first_item():
    stage_queue = queue(max_rows=8, wait_us=100_000)
    stage_queue.put(Item("first", 1))
    taken = []
    taker = threading.Thread(target=lambda: taken.append(stage_queue.take()))
    taker.start()
    while stage_queue._entries:  # the replica holds "first" and is waiting for batch-mates
        threading.Event().wait(0.001)
    stage_queue.put(Item("late", 1))
    taker.join()
    assert [entry.item.request_id for entry in taken[0]] == ["first", "late"]


def test_limits_take_the_deploy_keys_over_the_declaration():
    declared = StagePipelineConfig(stage_id=0, model_stage="x", max_batch_rows=32, max_batch_tokens=8192,
                                   batch_wait_us=250)
    limits = BatchLimits.for_stage(declared, BatchingConfig(max_batch_rows=1, max_batch_bytes=1024))
    assert limits.to_dict() == {"max_batch_rows": 1, "max_batch_tokens": 8192, "max_batch_bytes": 1024,
                                "batch_wait_us": 250}
    assert BatchLimits.for_stage(StagePipelineConfig(stage_id=0, model_stage="x"), BatchingConfig()).wait_us == DEFAULT_BATCH_WAIT_US
    shape = BatchShape(rows=4, tokens=64, bytes=100, real_rows=3, real_tokens=40)
    assert BatchLimits(max_rows=4, max_tokens=64, max_bytes=100).admits(shape)
    for tight in ({"max_rows": 3}, {"max_tokens": 63}, {"max_bytes": 99}):
        assert not BatchLimits(**{"max_rows": 4, **tight}).admits(shape)


def test_the_axis_zero_adapter_merges_and_splits_by_rows():
    adapter = AxisZeroAdapter()
    a, b = {"x": np.zeros((2, 4), np.float32)}, {"x": np.ones((3, 4), np.float32)}
    assert adapter.group(a) == adapter.group(b) != adapter.group({"x": np.zeros((2, 5), np.float32)})
    assert adapter.group({"x": np.zeros((3, 4)), "m": np.zeros((2,))}) is None  # rows disagree: runs alone
    assert adapter.footprint(a) == Footprint(rows=2, row_bytes=16)
    assert adapter.padded(adapter.footprint(a).combine(adapter.footprint(b))).bytes == 80
    assert adapter.pack([a, b])["x"].shape == (5, 4)
    parts = adapter.unpack({"y": np.arange(10).reshape(5, 2)}, [a, b])
    assert [p["y"].tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7], [8, 9]]]
    assert parts[0]["y"].base is None  # a copy: no request keeps a view of the others' rows
    with pytest.raises(ValueError, match="axis 0 >= 5"):
        split_rows({"y": np.zeros((4, 2))}, [2, 3])


def test_batch_stats_count_calls_rows_requests_waits_and_padding():
    stats = BatchStats()
    assert stats.snapshot()["padding_efficiency"] is None
    stats.record_call(BatchShape(rows=4, tokens=64, bytes=0, real_rows=3, real_tokens=48), requests=2)
    stats.record_waits([0.0002, 0.003])
    snapshot = stats.snapshot()
    assert (snapshot["calls"], snapshot["rows"], snapshot["padded_rows"]) == (1, 3, 4)
    assert snapshot["padding_efficiency"] == 48 / 64
    histograms = snapshot["histograms"]
    assert histograms["batch_requests"]["buckets"][:2] == [[1, 0], [2, 1]]
    assert histograms["queue_wait_seconds"]["count"] == 2
    assert dict(map(tuple, histograms["queue_wait_seconds"]["buckets"]))[0.00025] == 1


async def queue_behind_blocker(omni, engine, prompts):
    """Occupy the replica with the blocker, queue `prompts` meanwhile; all outputs, blocker first."""
    blocker = asyncio.create_task(engine.first(omni, BLOCKER, "blocker"))
    await engine.until_in_flight(omni, "blocker")
    tasks = [asyncio.create_task(engine.first(omni, prompt, f"r{i}")) for i, prompt in enumerate(prompts)]
    await engine.until(lambda: omni.queue_depth() == len(prompts) + 1, "every request admitted")
    return await asyncio.gather(blocker, *tasks)


def test_compatible_requests_share_calls_and_get_exactly_their_rows(make_plan, engine):
    # interleaved: six 1-row requests of width 32, five 2-row requests of width 16
    prompts = [rows_prompt(i, 1, 32) if i % 2 == 0 else rows_prompt(i, 2, 16) for i in range(11)]

    async def serve(batching):
        async with AsyncOmni(deploy_config=make_plan("rows", batching=batching)) as omni:
            outputs = await queue_behind_blocker(omni, engine, prompts)
            (replica,) = engine.replicas(omni)
            stats = omni.runtime.stages[0].replicas[0].client.stats()
            return [o.custom_output["s2000"] for o in outputs[1:]], replica, stats, omni.execution_plan["stages"][0]

    batched, replica, stats, stage = asyncio.run(serve(BATCHING))
    unbatched, _, single_stats, _ = asyncio.run(serve({"max_batch_rows": 1}))
    assert {key: stage["batching"][key] for key in ("max_batch_rows", "batch_wait_us", "adapter")} == {
        "max_batch_rows": 8, "batch_wait_us": DEFAULT_BATCH_WAIT_US, "adapter": None}
    # blocker; the six width-32 rows; 8 rows of width 16 (four requests); the last one
    assert stats["runs"] == replica["calls"] == 4 and replica["items"] == 12
    assert single_stats["runs"] == 12
    batch_stats = stage["batching"]["stats"]
    assert batch_stats["calls"] == 4 and batch_stats["rows"] == batch_stats["padded_rows"] == 32768 + 16
    assert batch_stats["histograms"]["batch_requests"]["sum"] == 12
    assert batch_stats["padding_efficiency"] == 1.0  # the axis-0 adapter pads nothing
    for prompt, out, reference in zip(prompts, batched, unbatched):
        assert out.shape == prompt["tensors"]["x"].shape
        assert np.array_equal(out, reference)


@pytest.fixture(scope="module")
def lookup_bundle(tmp_path_factory):
    """y = table[index]: table float32 [8, 4], index int64 [b]; an index past 7 fails ORT's Gather."""
    folder = tmp_path_factory.mktemp("lookup") / "lookup"
    folder.mkdir()
    table = numpy_helper.from_array(np.arange(32, dtype=np.float32).reshape(8, 4), "table")
    graph = helper.make_graph([helper.make_node("Gather", ["table", "index"], ["y"], axis=0)], "lookup",
                              [helper.make_tensor_value_info("index", TensorProto.INT64, ["b"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])], initializer=[table])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), folder / "graph.onnx")
    np.savez(folder / "inputs.npz", index=np.array([0, 7], np.int64))
    pack_bundle(folder, component="test.lookup", example_inputs_file="inputs.npz")
    return folder


def lookup_plan(bundle, batching, **backend):
    return validate_deploy_config({"pipeline": "test-batching-lookup", "stages": [{
        "stage_id": 0, "model_stage": "lookup", "final_output": True, "final_output_type": "tensors",
        "batching": batching,
        "backend": {"name": GRAPH_BACKEND, "manifest": str(bundle), **backend,
                    "route": {"name": "cpu", "interpreter": sys.executable, "intra_op_num_threads": 1}}}]})


def test_a_request_level_fault_in_a_merged_call_fails_only_its_request(lookup_bundle):
    prompts = [{"tensors": {"index": np.array(rows, np.int64)}} for rows in ([1, 2], [99], [7], [3, 0, 5])]
    # a long wait: the four requests, submitted together, are merged into one call
    with Omni(deploy_config=lookup_plan(lookup_bundle, {"max_batch_rows": 16, "batch_wait_us": 100_000})) as omni:
        outputs = omni.generate(prompts)
        stage = omni.execution_plan["stages"][0]
    good = [o for i, o in enumerate(outputs) if i != 1]
    assert all(o.error is None for o in good)
    for prompt, output in zip([p for i, p in enumerate(prompts) if i != 1], good):
        assert output.custom_output["y"].tolist() == [[4 * i + j for j in range(4)] for i in prompt["tensors"]["index"]]
    assert outputs[1].error.startswith("RemoteError: run_failed") and "idx=99" in outputs[1].error
    (replica,) = stage["replicas"]
    # the merged call, then one call per request (three answered); the worker stays: a request-level fault
    assert stage["batching"]["stats"]["histograms"]["batch_requests"]["buckets"][:3] == [[1, 4], [2, 4], [4, 5]]
    assert replica["generation"] == 1 and replica["state"] == "serving" and replica["calls"] == 3


@pytest.mark.parametrize("rows, refused_by", [(40, "the client: the merged inputs exceed the route's max_io_bytes"),
                                              (20, "the worker: the merged outputs exceed it")])
def test_a_merged_call_too_large_for_the_wire_runs_item_by_item(lookup_bundle, rows, refused_by):
    """Each request fits the route's 1 KiB cap alone; four merged do not. The merged call is refused
    before anything runs or is sent back, so it is run again item by item: every request gets
    its rows and the worker keeps serving (no retirement, no replacement)."""
    prompts = [{"tensors": {"index": np.full(rows, i, np.int64)}} for i in range(4)]
    plan = lookup_plan(lookup_bundle, {"max_batch_rows": 256, "batch_wait_us": 100_000}, max_io_bytes=1024)
    with Omni(deploy_config=plan) as omni:
        outputs = omni.generate(prompts)
        stage = omni.execution_plan["stages"][0]
    assert [o.error for o in outputs] == [None] * 4, refused_by
    for i, output in enumerate(outputs):
        assert output.custom_output["y"].tolist() == [[4 * i + j for j in range(4)]] * rows
    (replica,) = stage["replicas"]
    assert replica["generation"] == 1 and replica["state"] == "serving" and replica["restarts"] == 0
    assert stage["batching"]["stats"]["histograms"]["batch_requests"]["buckets"][:3] == [[1, 4], [2, 4], [4, 5]]


def test_a_worker_dying_mid_batch_fails_each_request_retryably_and_is_replaced(make_plan, engine):
    # any request of the call may have killed the worker, so none is re-queued onto its replacement
    async def main():
        async with AsyncOmni(deploy_config=make_plan("rows", batching={"max_batch_rows": 65536})) as omni:
            blocker = asyncio.create_task(engine.first(omni, BLOCKER, "blocker"))
            await engine.until_in_flight(omni, "blocker")
            batch = [asyncio.create_task(engine.first(omni, rows_prompt(i, 16384, 32), f"b{i}")) for i in range(3)]
            await blocker
            await engine.until(lambda: engine.replicas(omni)[0]["in_flight"] == ["b0", "b1", "b2"], "the batched call")
            (replica,) = engine.replicas(omni)
            os.kill(replica["pid"], signal.SIGKILL)
            errors = await asyncio.gather(*batch, return_exceptions=True)
            await engine.until_serving(omni, generation=replica["generation"] + 1)
            after = await engine.first(omni, rows_prompt(9, 1, 32), "after")
            return errors, after

    errors, after = asyncio.run(main())
    assert all(isinstance(e, StageUnavailable) and "WorkerDied" in str(e) and e.retry_after == 1.0 for e in errors)
    assert after.custom_output["s2000"].shape == (1, 32)


def test_cancelling_one_request_of_a_batch_drops_only_its_rows(make_plan, engine, os_processes):
    async def main():
        async with AsyncOmni(deploy_config=make_plan("rows", batching={"max_batch_rows": 65536})) as omni:
            blocker = asyncio.create_task(engine.first(omni, BLOCKER, "blocker"))
            await engine.until_in_flight(omni, "blocker")
            prompts = [rows_prompt(i, 16384, 32) for i in range(3)]
            batch = [asyncio.create_task(engine.first(omni, p, f"b{i}")) for i, p in enumerate(prompts)]
            await blocker
            await engine.until(lambda: engine.replicas(omni)[0]["in_flight"] == ["b0", "b1", "b2"], "the batched call")
            await omni.abort("b1")
            results = await asyncio.gather(*batch, return_exceptions=True)
            (replica,) = engine.replicas(omni)
            alone = await engine.first(omni, prompts[2], "alone")
            return results, replica, alone

    results, replica, alone = asyncio.run(main())
    assert isinstance(results[1], RequestCancelled)
    assert [r.request_id for r in (results[0], results[2])] == ["b0", "b2"]
    assert results[0].custom_output["s2000"].shape == (16384, 32)
    assert np.array_equal(results[2].custom_output["s2000"], alone.custom_output["s2000"])
    assert replica["state"] == "serving" and replica["generation"] == 1 and replica["items"] == 4


def test_batching_is_refused_for_a_graph_whose_batch_dim_is_not_axis_zero_only(make_plan, os_processes):
    # slow: x [n, n] -> [n, n]: merging requests along axis 0 would change every answer
    with pytest.raises(StageStartupError, match="max_batch_rows=4 is declared but calls of test.slow cannot be merged: "
                                                "x\\['n', 'n'\\] uses the batch dim 'n' beyond axis 0"):
        AsyncOmni(deploy_config=make_plan("slow", capacity=100, demand=10, batching={"max_batch_rows": 4}))
    assert os_processes.children() == set()


def test_batching_statistics_are_exported_as_prometheus_histograms_and_counters():
    stats = BatchStats()
    stats.record_call(BatchShape(rows=4, tokens=64, bytes=0, real_rows=3, real_tokens=48), requests=2)
    stats.record_waits([0.0002])
    stage = StageMetrics(0, "graph", "ok", None, 1, 1, 0, (), BatchMetrics.from_stats(stats.snapshot()))
    engine = EngineMetrics((stage,), LedgerMetrics((), 0))
    readings = EngineReadings(engine=lambda: engine, stage_names=lambda: {0: "decision"})
    text = ServerMetrics("laya", readings).render().decode()
    labels = 'model_name="laya",stage="decision"'
    for line in (f'omnigraph_batch_rows_bucket{{le="4.0",{labels}}} 1.0', f'omnigraph_batch_rows_sum{{{labels}}} 3.0',
                 f'omnigraph_batch_requests_bucket{{le="1.0",{labels}}} 0.0',
                 f'omnigraph_batch_queue_wait_seconds_bucket{{le="0.00025",{labels}}} 1.0',
                 f'omnigraph_batch_tokens_total{{{labels}}} 48.0',  # real tokens only
                 f'omnigraph_batch_padding_tokens_total{{{labels}}} 16.0'):  # the padding beside them
        assert line in text
    assert "omnigraph_batch_padding_efficiency" not in text  # no since-start ratio: rate() the two counters
    assert "omnigraph_batch_rows_bucket" not in ServerMetrics("laya", EngineReadings()).render().decode()


def test_declared_batching_values_are_checked_once_and_a_refusing_adapter_stops_the_start(bundles):
    with pytest.raises(PipelineConfigError, match="stage 0: batch_wait_us must be <= 100000, got 200000"):
        StagePipelineConfig(stage_id=0, model_stage="x", batch_wait_us=200_000)
    with pytest.raises(PipelineConfigError, match="stage 0: max_batch_tokens must be an int >= 1 or None, got 0"):
        StagePipelineConfig(stage_id=0, model_stage="x", max_batch_tokens=0)
    with pytest.raises(PipelineConfigError, match="stage 0: batch_adapter must be a dotted reference"):
        StagePipelineConfig(stage_id=0, model_stage="x", batch_adapter="LayaBatchAdapter")
    laya = StagePipelineConfig(stage_id=0, model_stage="x", batch_adapter="omnigraph.pipelines.laya.batching:LayaBatchAdapter")
    plan = validate_deploy_config({"pipeline": "test-batching-adapter", "stages": [{
        "stage_id": 0, "model_stage": "x", "final_output": True, "final_output_type": "tensors",
        "backend": {"name": GRAPH_BACKEND, "manifest": str(bundles["affine"]), "route": {"name": "cpu"}}}]})
    with pytest.raises(StageStartupError, match="batch adapter omnigraph.pipelines.laya.batching:LayaBatchAdapter "
                                                "refused .*affine/manifest.json: .*metadata.layout has no pad_id"):
        GraphStage(laya, plan.stages[0], verify_bundle(bundles["affine"]), worker_route(plan.stages[0]), None)


def test_a_replica_waits_for_batch_mates_only_while_other_requests_are_admitted():
    def refuse_to_wait(timeout=None):
        raise AssertionError("waited for batch-mates")

    for admitted, waits in ((1, False), (2, True)):
        stage_queue = queue(max_rows=8, wait_us=100_000)
        stage_queue.admitted_requests = lambda: admitted
        stage_queue._ready.wait = refuse_to_wait
        stage_queue.put(Item("only", 1))
        if waits:
            with pytest.raises(AssertionError, match="waited for batch-mates"):
                stage_queue.take()
        else:
            assert [entry.item.request_id for entry in stage_queue.take()] == ["only"]


def test_the_requests_of_one_merged_call_wake_the_event_loop_once_and_finish_there(make_plan, engine):
    prompts = [rows_prompt(i, 1, 32) for i in range(6)]

    async def serve():
        async with AsyncOmni(deploy_config=make_plan("rows", batching=BATCHING)) as omni:
            loop = asyncio.get_running_loop()
            wakes, finished_on = [], []  # wake-ups of the loop from other threads; threads that finished
            call_soon_threadsafe, finish = loop.call_soon_threadsafe, omni.processor.finish

            def counted(*args):
                if threading.get_ident() != threading.main_thread().ident:  # the loop runs in the main thread
                    wakes.append(args)
                return call_soon_threadsafe(*args)

            loop.call_soon_threadsafe = counted
            omni.processor.finish = lambda *args: finished_on.append(threading.get_ident()) or finish(*args)
            outputs = await queue_behind_blocker(omni, engine, prompts)
            loop.call_soon_threadsafe = call_soon_threadsafe
            (replica,) = engine.replicas(omni)
        return outputs, replica, len(wakes), finished_on

    outputs, replica, wakes, finished_on = asyncio.run(serve())
    assert replica["calls"] == 2  # the blocker, then the six requests together
    # the blocker, alone, was called from the loop, whose own reader took its reply: no wake-up; the
    # six requests' call wakes it once, after its last request is posted (none when they join the
    # blocker's drain)
    assert wakes <= 1
    assert finished_on == [threading.get_ident()] * 7  # the processor finished each on the event loop
    assert [output.custom_output["s2000"].shape for output in outputs[1:]] == [(1, 32)] * 6
