"""PipelineConfig declarations, the registry and the linear-chain rule."""

import pytest

from omnigraph.pipelines.config import PipelineConfig, PipelineConfigError, StageExecutionType, StagePipelineConfig
from omnigraph.pipelines.registry import PipelineNotFound, get_pipeline, register_pipeline, resolve_dotted


def stage(stage_id, sources=(), final=False, kind="graph"):
    return StagePipelineConfig(stage_id=stage_id, model_stage=f"s{stage_id}", execution_type=kind,
                               input_sources=sources, final_output=final,
                               final_output_type="tensors" if final else None)


def test_chain_order_follows_input_sources():
    config = PipelineConfig("chain", (stage(2, (1,), final=True), stage(0), stage(1, (0,))))
    assert config.stage_order == (0, 1, 2)
    assert config.final_stage.stage_id == 2 and config.final_output_type == "tensors"
    assert config.stage(1).execution_type is StageExecutionType.GRAPH


@pytest.mark.parametrize("stages, message", [
    ((stage(0), stage(1, (0,), final=True), stage(2, (0,))), "fans out"),
    ((stage(0), stage(1), stage(2, (0, 1), final=True)), "exactly one entry stage"),
    ((stage(0), stage(1, (0,)), stage(2, (0, 1), final=True)), "joins"),
    ((stage(0), stage(1, (0,), final=True), stage(2, (1,), final=True)), "exactly one final_output"),
    ((stage(0, final=True), stage(1, (0,))), "must end the chain"),
    ((stage(0), stage(1, (2,), final=True), stage(2, (1,))), "not on the chain"),
    ((stage(0), stage(1, (7,), final=True)), "unknown stages"),
    ((stage(0, final=True), stage(0)), "repeat"),
])
def test_graph_pipelines_must_be_linear(stages, message):
    with pytest.raises(PipelineConfigError, match=message):
        PipelineConfig("bad", stages)


def test_stage_fields_are_validated_once():
    with pytest.raises(PipelineConfigError, match="max_batch_rows must be an int >= 1, got 0"):
        StagePipelineConfig(stage_id=0, model_stage="x", max_batch_rows=0)
    with pytest.raises(PipelineConfigError, match="execution_type 'gpu'"):
        stage(0, kind="gpu")
    with pytest.raises(PipelineConfigError, match="final_output_type"):
        StagePipelineConfig(stage_id=0, model_stage="x", final_output=True)
    with pytest.raises(PipelineConfigError, match="dotted reference"):
        StagePipelineConfig(stage_id=0, model_stage="x", custom_process_input_func="not dotted")
    with pytest.raises(PipelineConfigError, match="dotted reference"):
        PipelineConfig("x", (stage(0, final=True),), processor="a.b")


def test_registry_round_trip_and_entry_point():
    config = register_pipeline(PipelineConfig("test-registry", (stage(0, final=True),)))
    assert get_pipeline("test-registry") is config
    register_pipeline(PipelineConfig("test-registry", (stage(0, final=True),)))  # same declaration: fine
    with pytest.raises(ValueError, match="already registered"):
        register_pipeline(PipelineConfig("test-registry", (stage(0, final=True),), processor="a:b"))
    with pytest.raises(PipelineNotFound, match="layaa"):
        get_pipeline("layaa")
    laya = get_pipeline("laya")  # through the omnigraph.pipelines entry point
    assert laya.processor == "omnigraph.pipelines.laya.processor:LayaProcessor"
    assert laya.final_output_type == "decision" and len(laya.stages) == 1


def test_resolve_dotted():
    assert resolve_dotted("omnigraph.pipelines.config:PipelineConfig.stage") is PipelineConfig.stage
    with pytest.raises(ImportError, match="no attribute"):
        resolve_dotted("omnigraph.pipelines.config:Missing")
