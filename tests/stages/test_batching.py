"""Cross-request batching: compatible queued work shares one worker call, each request gets its rows."""

import asyncio
import os
import signal

import numpy as np
import pytest

from omnigraph import AsyncOmni
from omnigraph.stages.batching import STOP, StageQueue, batch_key, split_outputs
from omnigraph.stages.errors import RequestCancelled, StageStartupError, StageUnavailable

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


def test_the_queue_groups_compatible_items_within_the_row_limit():
    queue = StageQueue(max_batch_rows=4)
    items = [Item("a", 1), Item("b", 1, width=5), Item("c", 2), Item("gone", 1, live=False), Item("d", 1, dtype=np.float64),
             Item("e", 2), Item("f", 1)]
    for item in items:
        queue.put(item)
    queue.put(STOP)
    taken = [queue.take() for _ in range(5)]
    ids = [[item.request_id for item in batch] if batch is not STOP else "STOP" for batch in taken]
    # a + c fill 3 rows; e (2 more) does not fit, f does; the cancelled item is dropped unseen
    assert ids == [["a", "c", "f"], ["b"], ["d"], ["e"], "STOP"]


def test_an_item_at_the_limit_runs_alone_and_unbatched_stages_take_one_item():
    queue = StageQueue(max_batch_rows=2)
    for item in (Item("big", 2), Item("small", 1), Item("other", 1)):
        queue.put(item)
    assert [i.request_id for i in queue.take()] == ["big"]
    assert [i.request_id for i in queue.take()] == ["small", "other"]
    single = StageQueue()
    single.put(Item("a", 1))
    single.put(Item("b", 1))
    assert [i.request_id for i in single.take()] == ["a"]


def test_batch_keys_and_splitting():
    assert batch_key({"x": np.zeros((3, 4)), "m": np.zeros((3,), np.int64)})[0] == 3
    assert batch_key({"x": np.zeros((3, 4)), "m": np.zeros((2,), np.int64)}) is None  # rows disagree
    parts = split_outputs({"y": np.arange(10).reshape(5, 2)}, [2, 3])
    assert [p["y"].tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7], [8, 9]]]
    assert parts[0]["y"].base is None  # a copy: no request keeps a view of the others' rows
    with pytest.raises(ValueError, match="axis 0 = 5"):
        split_outputs({"y": np.zeros((4, 2))}, [2, 3])


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
    unbatched, _, single_stats, _ = asyncio.run(serve(None))
    assert stage["batching"] == {"max_batch_rows": 8, "batch_wait_us": 0}
    # blocker; the six width-32 rows; 8 rows of width 16 (four requests); the last one
    assert stats["runs"] == replica["calls"] == 4 and replica["items"] == 12
    assert single_stats["runs"] == 12
    for prompt, out, reference in zip(prompts, batched, unbatched):
        assert out.shape == prompt["tensors"]["x"].shape
        assert np.array_equal(out, reference)


def test_a_failing_batched_call_fails_each_request_and_the_replica_is_replaced(make_plan, engine):
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
    assert all(isinstance(e, StageUnavailable) and "WorkerDied" in str(e) for e in errors)
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
            return prompts, results, replica

    prompts, results, replica = asyncio.run(main())
    assert isinstance(results[1], RequestCancelled)
    assert [r.request_id for r in (results[0], results[2])] == ["b0", "b2"]
    assert results[0].custom_output["s2000"].shape == (16384, 32)
    assert not np.array_equal(results[0].custom_output["s2000"], results[2].custom_output["s2000"])
    assert replica["state"] == "serving" and replica["generation"] == 1 and replica["items"] == 4


def test_batching_is_refused_for_a_graph_whose_batch_dim_is_not_axis_zero_only(make_plan, os_processes):
    # slow: x [n, n] -> [n, n]: merging requests along axis 0 would change every answer
    with pytest.raises(StageStartupError, match="max_batch_rows=4 is declared but calls of test.slow cannot be merged: "
                                                "x\\['n', 'n'\\] uses the batch dim 'n' beyond axis 0"):
        AsyncOmni(deploy_config=make_plan("slow", capacity=100, demand=10, batching={"max_batch_rows": 4}))
    assert os_processes.children() == set()
