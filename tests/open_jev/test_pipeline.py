"""OPEN_JEV_PIPELINE: a native backbone stage feeding the head graph, and names that resolve."""

from __future__ import annotations

from omnigraph.pipelines.config import StageExecutionType
from omnigraph.pipelines.open_jev.pipeline import OPEN_JEV_PIPELINE
from omnigraph.pipelines.registry import get_pipeline, resolve_dotted


def test_the_backbone_feeds_the_head_which_answers():
    backbone, head = OPEN_JEV_PIPELINE.stages
    assert backbone.execution_type is StageExecutionType.LLM_POOLING and backbone.input_sources == ()
    assert head.execution_type is StageExecutionType.GRAPH and head.input_sources == (0,)
    assert OPEN_JEV_PIPELINE.stage_order == (0, 1)
    assert OPEN_JEV_PIPELINE.final_stage is head and OPEN_JEV_PIPELINE.final_output_type == "decision"
    assert head.max_batch_rows > 1  # prompts of questions queued together share one head call


def test_every_dotted_name_resolves_and_the_entry_point_names_the_pipeline():
    from omnigraph.pipelines.open_jev import export, processor, synth

    assert resolve_dotted(OPEN_JEV_PIPELINE.processor) is processor.OpenJevProcessor
    assert resolve_dotted(OPEN_JEV_PIPELINE.bundle_builder) is export.build_bundle
    assert resolve_dotted(OPEN_JEV_PIPELINE.checkpoint_synthesizer) is synth.synthesize_checkpoint
    assert resolve_dotted(OPEN_JEV_PIPELINE.default_bundle) is export.default_bundle
    assert get_pipeline("open_jev") is OPEN_JEV_PIPELINE
