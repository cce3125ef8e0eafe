"""The deploy YAML: strict keys with precise paths, base_config merging, pipeline resolution."""

import sys
import textwrap
from pathlib import Path

import pytest

from omnigraph.pipelines.deploy import (
    BACKEND_ROUTE_KEYS,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DeployConfigError,
    GraphBackendConfig,
    RouteConfig,
    load_deploy_config,
    resolve_pipeline,
)
from omnigraph.stages.graph_stage import worker_route
from omnigraph.workers.route import ROUTE_FIELDS, WorkerRoute, route_default


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def bundle_dir(tmp_path):
    bundle = tmp_path / "bundles" / "head"
    bundle.mkdir(parents=True)
    (bundle / "manifest.json").write_text("{}")
    return bundle


PLAN = """\
    pipeline: laya
    stages:
      - stage_id: 0
        backend:
          name: external.graph.v1
          manifest: bundles/head/manifest.json
          route: {name: local-cpu, ep: cpu}
        resource_budget:
          capacities: {"machine:ram": 1000}
          demands: {"machine:ram": 100}
    """


def test_relative_manifest_resolves_against_the_yaml(tmp_path, bundle_dir):
    plan = load_deploy_config(write(tmp_path, "plan.yaml", PLAN))
    stage = plan.stage(0)
    assert stage.backend.manifest == bundle_dir / "manifest.json"
    assert stage.backend.route.ep == "cpu" and stage.num_replicas == 1
    assert plan.max_queued_requests == DEFAULT_MAX_QUEUED_REQUESTS
    assert resolve_pipeline(plan).model_type == "laya"
    # defaults: retired replicas are replaced (5 per minute); batching is what the pipeline declares
    assert (stage.restart.max_restarts, stage.restart.window_s) == (5, 60.0)
    assert stage.batching.model_dump() == dict.fromkeys(
        ("max_batch_rows", "max_batch_tokens", "max_batch_bytes", "batch_wait_us"))


def test_restart_and_batching_keys(tmp_path, bundle_dir):
    text = PLAN.replace("        resource_budget:", "        restart: {max_restarts: 0, window_s: 30}\n"
                        "        batching: {max_batch_rows: 16, max_batch_tokens: 4096,"
                        " max_batch_bytes: 1048576, batch_wait_us: 200}\n        resource_budget:")
    stage = load_deploy_config(write(tmp_path, "plan.yaml", text)).stage(0)
    assert (stage.restart.max_restarts, stage.restart.window_s) == (0, 30.0)
    assert stage.batching.model_dump() == {"max_batch_rows": 16, "max_batch_tokens": 4096,
                                           "max_batch_bytes": 1048576, "batch_wait_us": 200}


@pytest.mark.parametrize("value", ["512", "-2", "null"])
def test_max_batch_markers_is_refused_naming_its_replacement(tmp_path, bundle_dir, value):
    # The engine's limits are rows, tokens and bytes; Laya's marker-slot cap is its adapter's own.
    text = PLAN.replace("        resource_budget:", f"        batching: {{max_batch_markers: {value}}}\n        resource_budget:")
    with pytest.raises(DeployConfigError) as error:
        load_deploy_config(write(tmp_path, "plan.yaml", text))
    message = str(error.value)
    assert "stages[0].batching.max_batch_markers: is no longer a batching key" in message
    assert "max_batch_tokens or max_batch_bytes instead" in message


@pytest.mark.parametrize("old, new, path", [
    ("ep: cpu", "epp: cpu", "stages[0].backend.route.epp: unknown key"),
    ("ep: cpu", "ep: gpu", "stages[0].backend.route.ep:"),
    ("ep: cpu", "ep: cpu, spin_wait_us: -5", "stages[0].backend.route.spin_wait_us:"),
    ("ep: cpu", "ep: cpu, mailbox_bytes: 100", "stages[0].backend.route.mailbox_bytes:"),
    ("demands: {\"machine:ram\": 100}", "demands: {\"machine:ram\": \"100\"}", "stages[0].resource_budget.demands.machine:ram:"),
    ("bundles/head/manifest.json", "bundles/missing", "stages[0].backend.manifest: no such bundle"),
    ("name: external.graph.v1", "name: external.graph.v2", "stages[0].backend.name:"),
    ("pipeline: laya", "pipelin: laya", "pipeline: required key is missing"),
    ("        resource_budget:", "        restart: {max_restarts: -1}\n        resource_budget:", "stages[0].restart.max_restarts:"),
    ("        resource_budget:", "        restart: {window_s: 0}\n        resource_budget:", "stages[0].restart.window_s:"),
    ("        resource_budget:", "        batching: {max_batch_rows: 0}\n        resource_budget:", "stages[0].batching.max_batch_rows:"),
    ("        resource_budget:", "        batching: {batch_wait_us: 1000000}\n        resource_budget:",
     "stages[0].batching.batch_wait_us:"),
    ("        resource_budget:", "        batching: {max_rows: 4}\n        resource_budget:", "stages[0].batching.max_rows: unknown key"),
    ("        resource_budget:", "        batching: {max_batch_tokens: 0}\n        resource_budget:",
     "stages[0].batching.max_batch_tokens:"),
    ("        resource_budget:", "        batching: {max_batch_bytes: 1MiX}\n        resource_budget:",
     "stages[0].batching.max_batch_bytes:"),
    ("        resource_budget:", "        batching: {batch_wait_us: -1}\n        resource_budget:",
     "stages[0].batching.batch_wait_us:"),
])
def test_typos_name_the_yaml_path(tmp_path, bundle_dir, old, new, path):
    with pytest.raises(DeployConfigError) as error:
        load_deploy_config(write(tmp_path, "plan.yaml", PLAN.replace(old, new)))
    assert path in str(error.value)


def test_demand_without_capacity_is_refused(tmp_path, bundle_dir):
    text = PLAN.replace('demands: {"machine:ram": 100}', 'demands: {"machine:vram:0": 100}')
    with pytest.raises(DeployConfigError, match=r"stages\[0\].resource_budget: demands name constraints without a capacity"):
        load_deploy_config(write(tmp_path, "plan.yaml", text))


def test_base_config_merges_under_the_plan(tmp_path, bundle_dir):
    write(tmp_path, "base.yaml", PLAN)
    sub = tmp_path / "sub"
    sub.mkdir()
    plan = load_deploy_config(write(sub, "plan.yaml", """\
        base_config: ../base.yaml
        max_queued_requests: 4
        stages:
          - stage_id: 0
            num_replicas: 2
            backend: {route: {name: two-threads, intra_op_num_threads: 2, spin_wait_us: 0, mailbox_bytes: 0}}
        """))
    stage = plan.stage(0)
    assert plan.max_queued_requests == 4 and stage.num_replicas == 2
    assert stage.backend.route.name == "two-threads" and stage.backend.route.intra_op_num_threads == 2
    assert stage.backend.route.spin_wait_us == 0 and worker_route(stage).spin_wait_us == 0
    assert worker_route(stage).mailbox_bytes == 0
    assert stage.backend.manifest == bundle_dir / "manifest.json"  # relative to base.yaml's folder
    assert stage.resource_budget.demands == {"machine:ram": 100}


def test_base_config_cycle_is_refused(tmp_path):
    write(tmp_path, "a.yaml", "base_config: b.yaml\n")
    write(tmp_path, "b.yaml", "base_config: a.yaml\n")
    with pytest.raises(DeployConfigError, match="cycle"):
        load_deploy_config(tmp_path / "a.yaml")


INLINE = """\
    pipeline: inline-chain
    stages:
      - stage_id: 0
        model_stage: features
        backend: {name: external.graph.v1, manifest: bundles/head, route: {name: cpu}}
      - stage_id: 1
        model_stage: head
        input_sources: [0]
        final_output: true
        final_output_type: tensors
        backend: {name: external.graph.v1, manifest: bundles/head, route: {name: cpu}}
    """


def test_inline_declaration_for_unregistered_pipelines(tmp_path, bundle_dir):
    pipeline = resolve_pipeline(load_deploy_config(write(tmp_path, "plan.yaml", INLINE)))
    assert pipeline.model_type == "inline-chain" and pipeline.stage_order == (0, 1)
    assert pipeline.processor is None
    assert [s.max_batch_rows for s in pipeline.stages] == [1, 1]  # batching is off unless declared
    batched = INLINE.replace("final_output: true", "final_output: true\n        batching: {max_batch_rows: 8}")
    pipeline = resolve_pipeline(load_deploy_config(write(tmp_path, "batched.yaml", batched)))
    assert pipeline.stage(1).max_batch_rows == 8


def test_inline_fan_out_is_refused_before_loading(tmp_path, bundle_dir):
    text = textwrap.dedent(INLINE) + (
        "  - stage_id: 2\n"
        "    model_stage: other\n"
        "    input_sources: [0]\n"
        "    backend: {name: external.graph.v1, manifest: bundles/head, route: {name: cpu}}\n"
    )
    with pytest.raises(DeployConfigError, match="fans out"):
        resolve_pipeline(load_deploy_config(write(tmp_path, "plan.yaml", text)))


def test_registered_pipeline_refuses_inline_keys_and_unknown_names(tmp_path, bundle_dir):
    text = PLAN.replace("  - stage_id: 0\n", "  - stage_id: 0\n        model_stage: decision\n")
    with pytest.raises(DeployConfigError, match=r"stages\[0\]: pipeline 'laya' is registered"):
        resolve_pipeline(load_deploy_config(write(tmp_path, "plan.yaml", text)))
    with pytest.raises(DeployConfigError, match="pipeline: unknown pipeline 'layaa'"):
        resolve_pipeline(load_deploy_config(write(tmp_path, "plan.yaml", PLAN.replace("laya", "layaa"))))
    with pytest.raises(DeployConfigError, match="declares stages \\[0\\], the plan has \\[3\\]"):
        resolve_pipeline(load_deploy_config(write(tmp_path, "plan.yaml", PLAN.replace("stage_id: 0", "stage_id: 3"))))


def test_the_schema_hands_the_route_its_own_fields_and_defaults(tmp_path, bundle_dir):
    """Every route key of the schema is a WorkerRoute field of the same name with the same default
    (interpreter: this one), so a plan that names nothing builds the route's defaults."""
    assert set(RouteConfig.model_fields) | set(BACKEND_ROUTE_KEYS) | {"env"} <= set(ROUTE_FIELDS)
    assert set(BACKEND_ROUTE_KEYS) <= set(GraphBackendConfig.model_fields)
    for name, spec in RouteConfig.model_fields.items():
        if name not in ("name", "interpreter"):
            assert spec.get_default(call_default_factory=True) == route_default(name), name
    stage = load_deploy_config(write(tmp_path, "plan.yaml", PLAN)).stage(0)
    assert worker_route(stage) == WorkerRoute(name="local-cpu", interpreter=sys.executable)
    text = PLAN.replace("route: {name: local-cpu, ep: cpu}", "route: {name: gpu, ep: cuda, device_id: 1}\n"
                        "          max_io_bytes: 1024\n          min_fraction_on_target: 0.5\n"
                        "          allowed_providers: [CUDAExecutionProvider, CPUExecutionProvider]")
    text = text.replace('capacities: {"machine:ram": 1000}', 'capacities: {"machine:ram": 1000, "machine:vram:1": 64}')
    text = text.replace('demands: {"machine:ram": 100}', 'demands: {"machine:ram": 100, "machine:vram:1": 32}')
    text = text.replace("        resource_budget:", "        env: {A: '1'}\n        resource_budget:")
    stage = load_deploy_config(write(tmp_path, "plan.yaml", text)).stage(0)
    assert worker_route(stage) == WorkerRoute(
        name="gpu", interpreter=sys.executable, ep="cuda", device_id=1, max_io_bytes=1024, min_fraction_on_target=0.5,
        allowed_providers=("CUDAExecutionProvider", "CPUExecutionProvider"), gpu_mem_limit=32, env={"A": "1"})
