"""Laya's pipeline declaration: one graph stage (ModernBERT encoder + decision head) -> decision.

Only names: the engine imports the processor, exporter and synthesiser through these dotted
strings when it needs them.
"""

from omnigraph.pipelines.config import PipelineConfig, StageExecutionType, StagePipelineConfig

LAYA_PIPELINE = PipelineConfig(
    model_type="laya",
    stages=(
        StagePipelineConfig(
            stage_id=0,
            model_stage="decision",
            execution_type=StageExecutionType.GRAPH,
            final_output=True,
            final_output_type="decision",
            # The graph's B axis is dynamic and every output leads with it, so work of requests
            # arriving together shares one forward call (rows stay per request; batching.py).
            # A merged call is never larger than the largest one request makes on its own
            # (processor: 16 rows of 512 tokens, 2048 marker slots), so it needs no more memory;
            # the marker-slot cap is the batch adapter's own (batching.py), not an engine limit.
            max_batch_rows=32,
            max_batch_tokens=8192,
            batch_adapter="omnigraph.pipelines.laya.batching:LayaBatchAdapter",
        ),
    ),
    processor="omnigraph.pipelines.laya.processor:LayaProcessor",
    bundle_builder="omnigraph.pipelines.laya.export:build_bundle",
    checkpoint_synthesizer="omnigraph.pipelines.laya.synth:synthesize_checkpoint",
    default_bundle="omnigraph.pipelines.laya.export:default_bundle",
)
