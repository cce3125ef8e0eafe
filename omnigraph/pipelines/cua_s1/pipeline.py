"""Cua-S1's pipeline declaration: native vLLM backbone (last-position hidden state) -> graph letter head.

Only names: the engine imports the processor, exporter and synthesiser through these dotted
strings when it needs them.
"""

from omnigraph.pipelines.config import PipelineConfig, StageExecutionType, StagePipelineConfig

CUA_S1_PIPELINE = PipelineConfig(
    model_type="cua_s1",
    stages=(
        StagePipelineConfig(stage_id=0, model_stage="backbone", execution_type=StageExecutionType.LLM_POOLING),
        StagePipelineConfig(
            stage_id=1,
            model_stage="head",
            execution_type=StageExecutionType.GRAPH,
            input_sources=(0,),
            final_output=True,
            final_output_type="decision",
            # One row per question ([P, H] with P = 1) and a MatMul over the leading axis, so the
            # questions of concurrent requests share one head call.
            max_batch_rows=64,
        ),
    ),
    processor="omnigraph.pipelines.cua_s1.processor:CuaS1Processor",
    bundle_builder="omnigraph.pipelines.cua_s1.export:build_bundle",
    checkpoint_synthesizer="omnigraph.pipelines.cua_s1.synth:synthesize_checkpoint",
    default_bundle="omnigraph.pipelines.cua_s1.export:default_bundle",
)
