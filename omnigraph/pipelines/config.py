"""Pipeline declarations: what a model's stages are and how data flows between them.

Mirrors vllm-omni's stage configs: a model declares its stages (frozen, validated once here) and
names its code by dotted strings, so the engine reads declarations and never imports a model to
learn its behaviour. Deployment facts (bundles, routes, budgets) live in the deploy YAML instead.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

_DOTTED = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
# Why: past a few milliseconds, waiting for batch-mates costs more latency than batching saves.
MAX_BATCH_WAIT_US = 100_000


class PipelineConfigError(ValueError):
    """A pipeline declaration is inconsistent; the message names the model and the field."""


class StageExecutionType(str, enum.Enum):
    """How a stage executes: an ONNX graph in a worker, or a pooling pass of a native LLM."""

    GRAPH = "graph"
    LLM_POOLING = "llm_pooling"


def check_dotted(value: str | None, where: str) -> None:
    """Refuse a code reference that is not `package.module:attribute` (None means absent)."""
    if value is not None and (not isinstance(value, str) or not _DOTTED.match(value)):
        raise PipelineConfigError(f"{where} must be a dotted reference 'package.module:attr', got {value!r}")


@dataclass(frozen=True)
class StagePipelineConfig:
    """One stage of a pipeline.

    `input_sources` are the stage ids whose outputs feed this stage (empty for the entry stage);
    `custom_process_input_func` turns those outputs into this stage's inputs (`{"tensors": ...}`);
    without it, outputs pass on by name. Exactly one stage of a pipeline is its `final_output`.
    `max_batch_rows` > 1 lets a graph stage merge queued work items of different requests into one
    call of at most that many rows (axis 0); 1 (the default) runs each work item alone. Where set,
    `max_batch_tokens` and `max_batch_bytes` bound the call's padded tokens (rows x length) and
    input bytes; `batch_wait_us` is how long a free replica waits for more work (None: the
    engine's measured default). `batch_adapter` names the model's `BatchAdapter` class
    (constructed with the stage's bundle and route), which groups, packs and unpacks its work
    items and keeps any cap only the model knows (None: items identical except along axis 0 are
    concatenated). The deploy YAML's `batching:` overrides each limit per stage.
    """

    stage_id: int
    model_stage: str
    execution_type: StageExecutionType = StageExecutionType.GRAPH
    input_sources: tuple[int, ...] = ()
    final_output: bool = False
    final_output_type: str | None = None
    custom_process_input_func: str | None = None
    max_batch_rows: int = 1
    max_batch_tokens: int | None = None
    max_batch_bytes: int | None = None
    batch_wait_us: int | None = None
    batch_adapter: str | None = None

    def __post_init__(self) -> None:
        where = f"stage {self.stage_id!r}"
        if not isinstance(self.stage_id, int) or isinstance(self.stage_id, bool) or self.stage_id < 0:
            raise PipelineConfigError(f"stage_id must be a non-negative int, got {self.stage_id!r}")
        if not isinstance(self.model_stage, str) or not self.model_stage:
            raise PipelineConfigError(f"{where}: model_stage must be a non-empty string")
        try:
            object.__setattr__(self, "execution_type", StageExecutionType(self.execution_type))
        except ValueError:
            allowed = ", ".join(t.value for t in StageExecutionType)
            raise PipelineConfigError(
                f"{where}: execution_type {self.execution_type!r} is not one of {allowed}"
            ) from None
        sources = tuple(self.input_sources)
        if any(not isinstance(s, int) or isinstance(s, bool) for s in sources):
            raise PipelineConfigError(f"{where}: input_sources must be stage ids, got {self.input_sources!r}")
        if len(set(sources)) != len(sources):
            raise PipelineConfigError(f"{where}: input_sources repeats a stage: {list(sources)}")
        if self.stage_id in sources:
            raise PipelineConfigError(f"{where}: a stage cannot feed itself")
        object.__setattr__(self, "input_sources", sources)
        if self.final_output and not self.final_output_type:
            raise PipelineConfigError(f"{where}: a final_output stage must name its final_output_type")
        if not self.final_output and self.final_output_type is not None:
            raise PipelineConfigError(f"{where}: final_output_type is set but the stage is not a final_output")
        check_dotted(self.custom_process_input_func, f"{where}: custom_process_input_func")
        check_dotted(self.batch_adapter, f"{where}: batch_adapter")
        for name, minimum, optional in (("max_batch_rows", 1, False), ("max_batch_tokens", 1, True),
                                        ("max_batch_bytes", 1, True), ("batch_wait_us", 0, True)):
            value = getattr(self, name)
            if value is None and optional:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise PipelineConfigError(f"{where}: {name} must be an int >= {minimum}"
                                          f"{' or None' if optional else ''}, got {value!r}")
        if self.batch_wait_us is not None and self.batch_wait_us > MAX_BATCH_WAIT_US:
            raise PipelineConfigError(f"{where}: batch_wait_us must be <= {MAX_BATCH_WAIT_US}, "
                                      f"got {self.batch_wait_us}")

    def describe(self) -> dict[str, Any]:
        """The declaration's place in the pipeline, as an execution plan reports each stage."""
        return {
            "stage_id": self.stage_id,
            "model_stage": self.model_stage,
            "execution_type": self.execution_type.value,
            "input_sources": list(self.input_sources),
            "final_output": self.final_output,
        }


@dataclass(frozen=True)
class PipelineConfig:
    """A model's whole pipeline: its stages plus the dotted names of its model code.

    `processor` prepares requests and finishes responses (None: the pipeline takes and returns raw
    tensors); `bundle_builder`, `checkpoint_synthesizer` and `default_bundle` serve the CLI and the
    embedded demo. Pipelines holding a graph stage must be linear chains with one final output,
    checked here so a bad declaration fails before anything loads.
    """

    model_type: str
    stages: tuple[StagePipelineConfig, ...]
    processor: str | None = None
    bundle_builder: str | None = None
    checkpoint_synthesizer: str | None = None
    default_bundle: str | None = None
    stage_order: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model_type, str) or not self.model_type:
            raise PipelineConfigError("model_type must be a non-empty string")
        where = f"pipeline {self.model_type!r}"
        stages = tuple(self.stages)
        if not stages:
            raise PipelineConfigError(f"{where}: declares no stages")
        if not all(isinstance(s, StagePipelineConfig) for s in stages):
            raise PipelineConfigError(f"{where}: stages must be StagePipelineConfig instances")
        object.__setattr__(self, "stages", stages)
        for name in ("processor", "bundle_builder", "checkpoint_synthesizer", "default_bundle"):
            check_dotted(getattr(self, name), f"{where}: {name}")

        by_id = {s.stage_id: s for s in stages}
        if len(by_id) != len(stages):
            raise PipelineConfigError(f"{where}: stage ids repeat: {[s.stage_id for s in stages]}")
        for stage in stages:
            unknown = [s for s in stage.input_sources if s not in by_id]
            if unknown:
                raise PipelineConfigError(f"{where}: stage {stage.stage_id} reads unknown stages {unknown}")
        finals = [s.stage_id for s in stages if s.final_output]
        if len(finals) != 1:
            raise PipelineConfigError(f"{where}: needs exactly one final_output stage, found {finals}")
        if any(s.execution_type is StageExecutionType.GRAPH for s in stages):
            order = _linear_order(where, stages, finals[0])
        else:
            order = tuple(sorted(by_id))
        object.__setattr__(self, "stage_order", order)

    def stage(self, stage_id: int) -> StagePipelineConfig:
        """The stage declared with `stage_id`."""
        for stage in self.stages:
            if stage.stage_id == stage_id:
                return stage
        raise KeyError(f"pipeline {self.model_type!r} has no stage {stage_id}")

    @property
    def final_stage(self) -> StagePipelineConfig:
        """The stage whose output is the pipeline's answer."""
        return next(s for s in self.stages if s.final_output)

    @property
    def final_output_type(self) -> str:
        return self.final_stage.final_output_type  # type: ignore[return-value]  # validated: the final stage has one


def _linear_order(where: str, stages: tuple[StagePipelineConfig, ...], final: int) -> tuple[int, ...]:
    """The chain's stage ids from entry to final output; refuses joins, fan-out and cycles."""
    entries = [s.stage_id for s in stages if not s.input_sources]
    if len(entries) != 1:
        raise PipelineConfigError(f"{where}: a graph pipeline must have exactly one entry stage, found {entries}")
    consumers: dict[int, list[int]] = {s.stage_id: [] for s in stages}
    for stage in stages:
        if len(stage.input_sources) > 1:
            raise PipelineConfigError(
                f"{where}: stage {stage.stage_id} joins stages {list(stage.input_sources)}; "
                "graph pipelines must be linear chains"
            )
        for source in stage.input_sources:
            consumers[source].append(stage.stage_id)
    for source, readers in consumers.items():
        if len(readers) > 1:
            raise PipelineConfigError(
                f"{where}: stage {source} fans out to stages {readers}; graph pipelines must be linear chains"
            )
    order = [entries[0]]
    while consumers[order[-1]]:
        order.append(consumers[order[-1]][0])
    if len(order) != len(stages):
        missing = sorted({s.stage_id for s in stages} - set(order))
        raise PipelineConfigError(f"{where}: stages {missing} are not on the chain from stage {entries[0]}")
    if order[-1] != final:
        raise PipelineConfigError(f"{where}: the final_output stage {final} must end the chain "
                                  f"(it ends at {order[-1]})")
    return tuple(order)
