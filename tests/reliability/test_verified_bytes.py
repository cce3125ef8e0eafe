"""What runs is what was verified (issue 18, finding 2): a graph worker builds its session from the
bytes it hashed, and a bundle changed on disk afterwards is noticed (bundles/watch.py)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from omnigraph.bundles import VerifiedBundle, pack_bundle
from omnigraph.bundles.watch import BundleWatch
from omnigraph.pipelines.deploy import DEFAULT_REVERIFY_INTERVAL_S, DeployConfigError, validate_deploy_config
from omnigraph.pipelines.laya.export import default_bundle
from omnigraph.workers.route import WorkerRoute
from omnigraph.workers.session import describe, load_session

from ..plugin.conftest import REFUND_REQUEST, ServerProcess
from .plans import demo_plan

WIDTH = 1 << 16  # 256 KiB of weights: large enough that ONNX Runtime would map the file


def add_bundle(folder: Path) -> VerifiedBundle:
    """y = x + w, with w (all ones) stored in the external file weights.bin."""
    folder.mkdir()
    weight = numpy_helper.from_array(np.ones(WIDTH, np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])], "add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [WIDTH])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, folder / "graph.onnx", save_as_external_data=True, location="weights.bin", size_threshold=0)
    np.savez(folder / "inputs.npz", x=np.zeros(WIDTH, np.float32))
    return pack_bundle(folder, component="test.add", example_inputs_file="inputs.npz")


def overwrite_in_place(path: Path, value: float) -> None:
    """Rewrite every weight of `path` through the same inode (what an in-place copy or editor does)."""
    with open(path, "r+b") as handle:
        handle.write(np.full(WIDTH, value, np.float32).tobytes())


@pytest.fixture
def bundle(tmp_path: Path) -> VerifiedBundle:
    return add_bundle(tmp_path / "bundle")


@pytest.fixture
def route() -> WorkerRoute:
    return WorkerRoute(name="local-cpu", interpreter=sys.executable, ep="cpu", intra_op_num_threads=1)


def test_weights_changed_in_place_under_a_loaded_session_do_not_change_its_answers(bundle, route):
    graph, report = load_session(str(bundle.manifest_path), route)
    x = {"x": np.zeros(WIDTH, np.float32)}
    assert graph.run(x, describe(x))["y"][0] == 1.0
    overwrite_in_place(bundle.file("weights.bin"), 7.0)
    assert graph.run(x, describe(x))["y"][0] == 1.0  # the verified bytes, not the file's new ones
    assert report.manifest_sha256 == bundle.manifest_sha256


def test_a_watch_reports_nothing_while_the_bundle_is_unchanged_or_only_touched(bundle):
    watch = BundleWatch(bundle, full_every=3)
    assert [watch.check() for _ in range(4)] == [None] * 4
    os.utime(bundle.file("weights.bin"))  # same bytes, new mtime: re-hashed once, then adopted
    assert watch.check() is None and watch.check() is None


def test_a_watch_names_a_weights_file_changed_in_place(bundle):
    watch = BundleWatch(bundle)
    overwrite_in_place(bundle.file("weights.bin"), 7.0)
    problem = watch.check()
    assert problem is not None and "weights.bin" in problem and "sha256" in problem


def test_a_watch_finds_a_change_that_kept_size_and_mtime_at_its_full_check(bundle):
    path = bundle.file("weights.bin")
    before = path.stat()
    watch = BundleWatch(bundle, full_every=2)
    overwrite_in_place(path, 7.0)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # the mtime put back
    problems = [watch.check(), watch.check()]
    assert problems[1] is not None and "weights.bin" in problems[1]


def test_a_watch_names_a_missing_file_and_a_rewritten_manifest(tmp_path):
    first = add_bundle(tmp_path / "one")
    first.file("inputs.npz").unlink()
    assert "inputs.npz" in BundleWatch(first).check()
    second = add_bundle(tmp_path / "two")
    manifest = second.manifest_path.read_text()
    second.manifest_path.write_text(manifest.replace('"test.add"', '"test.other"'))
    assert "manifest.json" in BundleWatch(second).check()


def plan(backend_extra: dict, manifest: Path) -> dict:
    backend = {"name": "external.graph.v1", "manifest": str(manifest), "route": {"name": "local-cpu"}}
    return {"pipeline": "laya", "stages": [{"stage_id": 0, "backend": backend | backend_extra}]}


def test_the_reverify_interval_is_a_graph_backend_key_with_a_default(bundle):
    default = validate_deploy_config(plan({}, bundle.manifest_path)).stages[0]
    assert default.reverify_interval_s == DEFAULT_REVERIFY_INTERVAL_S
    assert validate_deploy_config(plan({"reverify_interval_s": 5}, bundle.manifest_path)).stages[0].reverify_interval_s == 5
    for off in (0, None):
        assert validate_deploy_config(plan({"reverify_interval_s": off}, bundle.manifest_path)).stages[0].reverify_interval_s is None
    with pytest.raises(DeployConfigError, match=r"stages\[0\]\.backend\.reverify_interval_s: .*greater than or equal to 0"):
        validate_deploy_config(plan({"reverify_interval_s": -1}, bundle.manifest_path))


def test_weights_changed_under_a_running_server_turn_its_stage_unavailable_naming_the_file(tmp_path):
    """The finding itself, over HTTP: the demo bundle's weights changed in place under `omnigraph
    serve` are never served; the stage says why until the verified bytes are back."""
    served = tmp_path / "bundle"
    shutil.copytree(default_bundle(), served)
    config = demo_plan(tmp_path, manifest=served / "manifest.json", reverify_interval_s=0.2)
    server = ServerProcess(["--deploy-config", str(config)], {}, tmp_path / "server.log")
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=30) as client:
            before = client.post("/v1/systemone", json=REFUND_REQUEST).json()
            weights = served / "weights.bin"
            original = weights.read_bytes()
            with open(weights, "r+b") as handle:  # the same inode, the same size, other numbers
                handle.write(bytes(byte ^ 0x5A for byte in original[:4096]))
            health = _poll(lambda: client.get("/health"), lambda r: r.status_code == 503)
            assert "weights.bin" in health.text and "Retry-After" in health.headers
            refused = client.post("/v1/systemone", json=REFUND_REQUEST)
            assert refused.status_code == 503 and "weights.bin" in refused.text, refused.text
            weights.write_bytes(original)  # the verified bytes back: the stage serves again
            _poll(lambda: client.get("/health"), lambda r: r.status_code == 200)
            after = client.post("/v1/systemone", json=REFUND_REQUEST).json()
    finally:
        server.stop()
    assert after["answers"] == before["answers"]
    assert after["audit"]["model_hash"] == before["audit"]["model_hash"]


def _poll(get, until, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not until(response := get()):
        assert time.monotonic() < deadline, f"never happened; last answer {response.status_code} {response.text}"
        time.sleep(0.05)
    return response
