"""Open-Jev's pipeline declaration: a native Qwen backbone stage -> the scalar head graph -> decision.

Stage 0 runs the backbone's prefill in vLLM (pooling runner, the last position's final-norm hidden
state of every prompt); stage 1 scores each prompt with the head bundle. One work item is one
question with all its candidate prompts, so a question's scores always travel together. Only names
here: the engine imports the processor, exporter and synthesiser through these dotted strings.
"""

from omnigraph.pipelines.config import PipelineConfig, StageExecutionType, StagePipelineConfig

OPEN_JEV_PIPELINE = PipelineConfig(
    model_type="open_jev",
    stages=(
        StagePipelineConfig(stage_id=0, model_stage="backbone", execution_type=StageExecutionType.LLM_POOLING),
        StagePipelineConfig(
            stage_id=1,
            model_stage="head",
            execution_type=StageExecutionType.GRAPH,
            input_sources=(0,),
            final_output=True,
            final_output_type="decision",
            # The head's P axis is symbolic and leads its input and output, so the prompts of
            # questions queued together share one call; each question's rows come back to it.
            max_batch_rows=256,
        ),
    ),
    processor="omnigraph.pipelines.open_jev.processor:OpenJevProcessor",
    bundle_builder="omnigraph.pipelines.open_jev.export:build_bundle",
    checkpoint_synthesizer="omnigraph.pipelines.open_jev.synth:synthesize_checkpoint",
    default_bundle="omnigraph.pipelines.open_jev.export:default_bundle",
)
