"""Fixtures for engine tests: tiny ONNX bundles built with onnx.helper, and plans over them."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from omnigraph.bundles import pack_bundle
from omnigraph.pipelines.deploy import GRAPH_BACKEND, validate_deploy_config


def _save_bundle(folder: Path, graph: onnx.GraphProto, example: dict[str, np.ndarray]) -> Path:
    folder.mkdir(parents=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), folder / "graph.onnx")
    np.savez(folder / "inputs.npz", **example)
    pack_bundle(folder, component=f"test.{folder.name}", example_inputs_file="inputs.npz")
    return folder


@pytest.fixture(scope="session")
def bundles(tmp_path_factory) -> dict[str, Path]:
    """Bundles by name:

    affine: y = 2x + 1 (x float32 [b, 4]); rename: y -> z = y - 1 (input named "y");
    slow: x [n, n] multiplied by itself 200 times (a call that runs for seconds at n = 1024);
    bad_warmup: affine with int64 example inputs, so the worker's warmup fails;
    rows: x [b, n] -> y [b, n] through 2000 elementwise Mul/Add steps: every row is computed on its
    own and exactly (IEEE, no reduction), and 32768 x 32 rows keep a worker busy for a while.
    """
    root = tmp_path_factory.mktemp("bundles")
    two, one = numpy_helper.from_array(np.float32(2), "two"), numpy_helper.from_array(np.float32(1), "one")
    affine = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["x2"]), helper.make_node("Add", ["x2", "one"], ["y"])],
        "affine", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])], initializer=[two, one],
    )
    rename = helper.make_graph(
        [helper.make_node("Sub", ["y", "one"], ["z"])],
        "rename", [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["b", 4])], initializer=[one],
    )
    steps = [helper.make_node("MatMul", ["x" if i == 0 else f"h{i}", "x"], [f"h{i + 1}"]) for i in range(200)]
    slow = helper.make_graph(
        steps, "slow", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "n"])],
        [helper.make_tensor_value_info("h200", TensorProto.FLOAT, ["n", "n"])],
    )
    steps = [helper.make_node("Mul" if i % 2 == 0 else "Add", ["x" if i == 0 else f"s{i}", "scale" if i % 2 == 0 else "shift"],
                              [f"s{i + 1}"]) for i in range(2000)]
    rows = helper.make_graph(
        steps, "rows", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "n"])],
        [helper.make_tensor_value_info("s2000", TensorProto.FLOAT, ["b", "n"])],
        initializer=[numpy_helper.from_array(np.float32(1.001), "scale"), numpy_helper.from_array(np.float32(-0.001), "shift")],
    )
    x = np.ones((1, 4), np.float32)
    return {
        "rows": _save_bundle(root / "rows", rows, {"x": np.ones((2, 3), np.float32)}),
        "affine": _save_bundle(root / "affine", affine, {"x": x}),
        "rename": _save_bundle(root / "rename", rename, {"y": x}),
        "slow": _save_bundle(root / "slow", slow, {"x": np.zeros((2, 2), np.float32)}),
        "bad_warmup": _save_bundle(root / "bad_warmup", affine, {"x": x.astype(np.int64)}),
    }


_plans = iter(range(10**6))


def chain_plan(bundles: dict[str, Path], *names: str, replicas: int = 1, capacity: int | None = None,
               demand: int | None = None, max_queued_requests: int = 32, max_io_bytes: int | None = None,
               restart: dict[str, Any] | None = None, batching: dict[str, Any] | None = None,
               placement: dict[str, Any] | None = None, **route: Any):
    """A deploy plan chaining the named bundles, declared inline (one stage each, in order);
    `restart` and `batching` are the stages' deploy keys of those names; a `placement` puts the
    plan on Ray (distributed_executor_backend: ray), every stage placed so."""
    stages = []
    for stage_id, name in enumerate(names):
        stage: dict[str, Any] = {
            "stage_id": stage_id,
            "model_stage": name,
            "num_replicas": replicas,
            "backend": {"name": GRAPH_BACKEND, "manifest": str(bundles[name]),
                        "route": {"name": "cpu", "interpreter": sys.executable, "intra_op_num_threads": 1, **route}},
        }
        if max_io_bytes is not None:
            stage["backend"]["max_io_bytes"] = max_io_bytes
        if restart is not None:
            stage["restart"] = restart
        if batching is not None:
            stage["batching"] = batching
        if placement is not None:
            stage["placement"] = placement
        if stage_id:
            stage["input_sources"] = [stage_id - 1]
        if stage_id == len(names) - 1:
            stage.update(final_output=True, final_output_type="tensors")
        if capacity is not None:
            stage["resource_budget"] = {"capacities": {"machine:ram": capacity}, "demands": {"machine:ram": demand}}
        stages.append(stage)
    return validate_deploy_config({"pipeline": f"test-chain-{next(_plans)}", "max_queued_requests": max_queued_requests,
                                   "stages": stages,
                                   **({"distributed_executor_backend": "ray"} if placement is not None else {})})


def child_pids() -> set[int]:
    """Live (non-zombie) child processes of this test process, read from /proc."""
    children = set()
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == me and state != "Z":
            children.add(int(entry.name))
    return children


def process_alive(pid: int) -> bool:
    """True while /proc holds a non-zombie process with this pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def make_plan(bundles):
    """`make_plan("affine", "rename", replicas=2, ...)`: see chain_plan."""
    return lambda *names, **options: chain_plan(bundles, *names, **options)


@pytest.fixture
def os_processes():
    """The OS view used to check that no worker outlives the pipeline.

    `children()` counts only the processes started during this test: a session-scoped fixture of
    another folder (a demo server) may legitimately keep a child of its own alive meanwhile.
    """
    before = child_pids()

    class OsProcesses:
        alive = staticmethod(process_alive)

        @staticmethod
        def children() -> set[int]:
            return child_pids() - before

    return OsProcesses


class EngineHelpers:
    """Run one request through AsyncOmni, and poll the execution plan for a state."""

    @staticmethod
    async def first(omni, prompt, request_id, **kwargs):
        """The first (only) output of one request through AsyncOmni."""
        async for output in omni.generate(prompt, request_id=request_id, **kwargs):
            return output

    @staticmethod
    def replicas(omni, stage: int = 0) -> list[dict[str, Any]]:
        return omni.execution_plan["stages"][stage]["replicas"]

    @staticmethod
    async def until(condition: Callable[[], bool], what: str) -> None:
        """Poll `condition` (every 5 ms, for up to 30 s) until it holds."""
        for _ in range(6000):
            if condition():
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"never happened: {what}")

    @staticmethod
    async def until_in_flight(omni, request_id: str, stage: int = 0) -> None:
        """Wait until a replica of `stage` is running a call that serves `request_id`."""
        await EngineHelpers.until(lambda: any(request_id in r["in_flight"] for r in EngineHelpers.replicas(omni, stage)),
                                  f"{request_id} reached a worker")

    @staticmethod
    async def until_retired(omni, stage: int = 0) -> None:
        """Wait until a replica of `stage` has retired and the OS confirmed its worker's exit."""
        await EngineHelpers.until(
            lambda: any(r["state"] == "retired" and r["exit_verified"] for r in EngineHelpers.replicas(omni, stage)),
            "a replica retired")

    @staticmethod
    async def until_serving(omni, generation: int, stage: int = 0) -> None:
        """Wait until every replica slot of `stage` serves, one of them at `generation` or later."""
        def serving() -> bool:
            slots = EngineHelpers.replicas(omni, stage)
            return all(r["state"] == "serving" for r in slots) and max(r["generation"] for r in slots) >= generation

        await EngineHelpers.until(serving, f"generation {generation} serving")


@pytest.fixture
def engine() -> type[EngineHelpers]:
    return EngineHelpers
