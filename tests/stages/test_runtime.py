"""StageRuntime: the whole plan is reserved before anything loads, failures unwind, shutdown is clean."""

import asyncio
import logging
import os
import re
import signal

import numpy as np
import pytest

from omnigraph import AsyncOmni, Omni
from omnigraph.pipelines.deploy import resolve_pipeline
from omnigraph.stages import runtime as runtime_module
from omnigraph.stages.errors import (
    CapacityConflict,
    ReservationRefused,
    StageStartupError,
)
from omnigraph.stages.graph_stage import worker_route
from omnigraph.stages.runtime import StageRuntime


def test_overcommit_is_refused_before_any_worker_starts(make_plan, os_processes, monkeypatch):
    plan = make_plan("affine", "rename", capacity=1000, demand=600)

    def no_start(*args, **kwargs):
        raise AssertionError("a worker was started for a plan that does not fit")

    monkeypatch.setattr(runtime_module.WorkerClient, "start", no_start)
    runtime = StageRuntime(resolve_pipeline(plan), plan)
    with pytest.raises(ReservationRefused) as refused:
        runtime.start()
    assert refused.value.constraint == "machine:ram" and refused.value.demand == 1200 and refused.value.free == 1000
    assert "stage0/replica0 + stage1/replica0" in str(refused.value)
    assert runtime.ledger.snapshot()["reservations"] == []
    assert os_processes.children() == set()


def test_a_stage_failing_warmup_unwinds_the_others(make_plan, os_processes):
    plan = make_plan("affine", "bad_warmup", capacity=1000, demand=100)
    runtime = StageRuntime(resolve_pipeline(plan), plan)
    with pytest.raises(StageStartupError, match="stage 1 replica 0: load and warmup refused") as error:
        runtime.start()
    assert "warmup on the example inputs failed" in str(error.value)
    assert runtime.ledger.snapshot()["reservations"] == []
    assert runtime.ledger.snapshot()["constraints"]["machine:ram"]["free"] == 1000
    assert os_processes.children() == set()


def test_shutdown_leaves_no_reservation_and_no_process(make_plan, os_processes):
    plan = make_plan("affine", "rename", replicas=2, capacity=1000, demand=100)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with Omni(deploy_config=plan) as omni:
        (output,) = omni.generate([{"tensors": {"x": x}}])
        execution = omni.execution_plan
        live = os_processes.children()
        omni.shutdown()
        snapshot = omni.ledger_snapshot()
        left = os_processes.children()
    assert np.array_equal(output.custom_output["z"], x * 2) and set(output.stage_durations) == {0, 1}
    pids = [r["pid"] for s in execution["stages"] for r in s["replicas"]]
    assert len(set(pids)) == 4 and live == set(pids)
    assert sorted(r["generation"] for s in execution["stages"] for r in s["replicas"]) == [1, 2, 3, 4]
    assert execution["ledger"]["constraints"]["machine:ram"]["held"] == 400
    first = execution["stages"][0]
    assert first["manifest"]["component"] == "test.affine" and len(first["manifest"]["sha256"]) == 64
    assert first["replicas"][0]["placement"]["target_provider"] == "CPUExecutionProvider"
    assert first["replicas"][0]["route"]["intra_op_num_threads"] == 1
    assert not any(os_processes.alive(pid) for pid in pids) and left == set()
    assert snapshot["reservations"] == []
    assert snapshot["constraints"]["machine:ram"] == {"capacity": 1000, "held": 0, "quarantined": 0, "free": 1000}


def test_async_omni_context_manager_shuts_down(make_plan, os_processes):
    x = np.ones((3, 4), np.float32)

    async def main():
        async with AsyncOmni(deploy_config=make_plan("affine")) as omni:
            outputs = [o async for o in omni.generate({"tensors": {"x": x}}, request_id="one")]
            assert omni.queue_depth() == 0 and omni.failure() is None and omni.audit() == {}
            return outputs

    outputs = asyncio.run(main())
    assert len(outputs) == 1 and outputs[0].finished and outputs[0].request_id == "one"
    assert outputs[0].final_output_type == "tensors" and outputs[0].stage_id == 0
    assert np.array_equal(outputs[0].custom_output["y"], 2 * x + 1)
    assert os_processes.children() == set()


def test_vram_demand_becomes_the_ort_arena_limit(make_plan):
    plan = make_plan("affine", ep="cuda", device_id=1)
    gpu = plan.stage(0).model_copy(update={"resource_budget": plan.stage(0).resource_budget.model_copy(update={
        "capacities": {"machine:vram:1": 8 << 30, "machine:ram": 1 << 30},
        "demands": {"machine:vram:1": 2 << 30, "machine:ram": 1 << 28}})})
    route = worker_route(gpu)
    assert route.ep == "cuda" and route.gpu_mem_limit == 2 << 30
    assert dict(route.ort_providers())["CUDAExecutionProvider"]["gpu_mem_limit"] == str(2 << 30)
    assert worker_route(make_plan("affine", capacity=1000, demand=10).stage(0)).gpu_mem_limit is None


def test_stages_must_agree_on_capacities(make_plan, os_processes):
    plan = make_plan("affine", "rename", capacity=1000, demand=10)
    second = plan.stages[1]
    budget = second.resource_budget.model_copy(update={"capacities": {"machine:ram": 2000}})
    plan = plan.model_copy(update={"stages": [plan.stages[0], second.model_copy(update={"resource_budget": budget})]})
    runtime = StageRuntime(resolve_pipeline(plan), plan)
    with pytest.raises(CapacityConflict, match="capacity of 'machine:ram' is 1000 per stage 0 but 2000 per stage 1"):
        runtime.start()
    assert runtime.ledger.snapshot()["reservations"] == [] and os_processes.children() == set()


def test_startup_phases_and_a_replacement_are_logged(make_plan, engine, caplog):
    caplog.set_level(logging.INFO, logger="omnigraph")

    async def main():
        async with AsyncOmni(deploy_config=make_plan("affine")) as omni:
            (first,) = engine.replicas(omni)
            os.kill(first["pid"], signal.SIGKILL)
            await engine.until_serving(omni, first["generation"] + 1)
            return first, engine.replicas(omni)[0]

    first, second = asyncio.run(main())
    lines = [(record.levelname, record.getMessage()) for record in caplog.records if record.name.startswith("omnigraph")]
    infos = [message for level, message in lines if level == "INFO"]
    assert any(re.fullmatch(r"pipeline \S+: 1 bundle\(s\) verified in [\d.]+ s", line) for line in infos)
    assert any(re.fullmatch(rf"stage 0: replica 0 on worker {first['pid']} \(generation 1, route \S+\) loaded \S+ on "
                            r"CPUExecutionProvider, warmed up in \d+ ms; ready in [\d.]+ s", line) for line in infos)
    assert any(re.fullmatch(r"pipeline \S+: 1 stage\(s\) serving, started in [\d.]+ s", line) for line in infos)
    warnings = [message for level, message in lines if level == "WARNING"]
    assert any(line.startswith(f"stage 0: replica 0 (worker {first['pid']}, generation 1) retired: worker "
                               f"{first['pid']} exited while idle") for line in warnings)
    assert f"stage 0: replica 0 replaced by worker {second['pid']} (generation 2, restart 1)" in warnings
