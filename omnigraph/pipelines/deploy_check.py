"""`omnigraph deploy check PLAN.yaml`: a deploy plan checked completely, without serving it.

No worker starts, no model loads, no port is bound. The check reuses the deploy schema
(deploy.py: `read_deploy_data`, `validate_deploy_config`, `resolve_pipeline`) and adds what only
a start would find, or what nothing finds today:

- YAML 1.1 readings (strict_yaml.YamlSurprise): `yes` / `on` as booleans, `4.0e9` as a string;
- near-miss keys ("did you mean ...?", difflib over the schema's keys at that place), and vllm-omni's
  flat stage keys (`max_model_len`, `gpu_memory_utilization`, ...) that belong under the backend;
- a native stage's `engine_args` value types: against the field types of vLLM's `AsyncEngineArgs`
  when vLLM imports, else against a small table of well-known keys (the report says which);
- CUDA graphs asked for on a route that is not `ep: cuda`;
- demands above capacity: each stage's demand times its replicas, and the whole plan together, as
  the ResourceLedger reserves it at start (stages/ledger.py; the arithmetic is repeated here because
  the declarations room may not import the engine), and capacities two stages declare differently;
  on a Ray plan a `machine:` constraint is each node's, so only one replica's demand is held to it
  (which replicas share a node is Ray's placement, known at start);
- the route each graph stage's workers would get (workers/route.py `WorkerRoute`), its bundle
  (verified: every hash, unless `verify_bundles=False`) and whether the route fits the bundle (the
  stage's batch adapter built for both, e.g. Laya's fp32 unpadded bundle on fixed shapes).

Every problem is one `Problem` (the YAML path of the offending key, what is wrong, a hint), all of
them collected rather than the first.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from inspect import isclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from omnigraph.bundles.errors import BundleError
from omnigraph.bundles.verify import read_bundle_layout, verify_bundle
from omnigraph.pipelines.config import PipelineConfig
from omnigraph.pipelines.deploy import (
    GRAPH_BACKEND,
    MACHINE_PREFIX,
    MANAGED_ENGINE_ARGS,
    NATIVE_BACKEND,
    DeployConfig,
    DeployConfigError,
    GraphBackendConfig,
    StageDeployConfig,
    format_bytes,
    parse_byte_amount,
    read_deploy_data,
    resolve_pipeline,
    validate_deploy_config,
)
from omnigraph.pipelines.registry import get_pipeline, resolve_dotted
from omnigraph.pipelines.strict_yaml import YamlSurprise, read_yaml_file
from omnigraph.workers.route import RouteInvalid, WorkerRoute

__all__ = ["WELL_KNOWN_ENGINE_ARGS", "CheckReport", "Problem", "check_deploy_plan", "engine_arg_types"]

# The types of vLLM engine arguments a plan commonly sets: what `engine_args` are checked against
# where vLLM cannot be imported (vLLM 0.32's AsyncEngineArgs declares these types).
WELL_KNOWN_ENGINE_ARGS: dict[str, Any] = {
    "enforce_eager": bool,
    "gpu_memory_utilization": float,
    "kv_cache_memory_bytes": int | None,
    "max_num_seqs": int | None,
    "max_num_batched_tokens": int | None,
    "tensor_parallel_size": int,
    "pipeline_parallel_size": int,
    "data_parallel_size": int,
    "trust_remote_code": bool,
    "seed": int,
    "enable_prefix_caching": bool | None,
    "enable_chunked_prefill": bool | None,
    "block_size": int | None,
    "cpu_offload_gb": float,
    "disable_log_stats": bool,
    "quantization": str | None,
    "revision": str | None,
    "tokenizer": str | None,
    "kv_cache_dtype": str,
    "max_logprobs": int,
    "served_model_name": str | list[str] | None,
}
# vllm-omni stage keys that an omnigraph plan writes elsewhere: those of a pooling backend itself,
# and the rest of vLLM's engine arguments (which go under `backend.engine_args`).
_BACKEND_KEYS = ("model", "dtype", "max_model_len")
_VLLM_OMNI_STAGE_KEYS = frozenset({*WELL_KNOWN_ENGINE_ARGS, *_BACKEND_KEYS, "engine_args", "max_cudagraph_capture_size",
                                   "cudagraph_capture_sizes", "distributed_executor_backend", "load_format",
                                   "worker_cls", "scheduler_cls", "model_arch", "engine_output_type"})
_PATH_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a plan: where (its YAML path), what, and how to fix it."""

    path: str
    message: str
    hint: str | None = None

    def line(self) -> str:
        return f"{self.path}: {self.message}" + (f"; hint: {self.hint}" if self.hint else "")


@dataclass
class CheckReport:
    """The outcome of `check_deploy_plan`: its problems (none: the plan is fine), notes on how it
    was checked, and a summary of what would be served."""

    plan: Path
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, path: str, message: str, hint: str | None = None) -> None:
        self.problems.append(Problem(path, message, hint))

    def format(self) -> str:
        lines = [problem.line() for problem in self.problems] if self.problems else list(self.summary)
        return "\n".join([*lines, *(f"note: {note}" for note in self.notes)])


def check_deploy_plan(path: str | Path, *, verify_bundles: bool = True) -> CheckReport:
    """Check the deploy YAML at `path` as completely as can be done without serving it."""
    path = Path(path).expanduser().resolve()
    report = CheckReport(plan=path)
    surprises: list[YamlSurprise] = []
    try:
        data = read_deploy_data(path, surprises=surprises)
    except DeployConfigError as exc:  # unreadable, not YAML, not strict YAML: nothing more to check
        _add_lines(report, str(exc))
        return report
    stages = _raw_stages(data)
    deploy: DeployConfig | None = None
    try:
        deploy = validate_deploy_config(data, base_dir=path.parent, vllm_optional=True)
    except DeployConfigError as exc:
        for line in str(exc).splitlines():
            where, _, message = line.partition(": ")
            if re.fullmatch(r"stages\[\d+\]\.backend\.engine_args", where):
                continue  # names: _check_engine_args reports each key by its own path
            hint = _unknown_key_hint(where, data, stages) if message == "unknown key" else _validation_hint(message)
            report.add(where, message, hint)
    _check_engine_args(report, stages)
    _check_cuda_graphs(report, stages)
    _check_budget(report, stages, per_node=data.get("distributed_executor_backend") == "ray")
    if deploy is not None:
        _check_plan(report, deploy, verify_bundles)
    else:
        _check_valid_stages(report, data, stages, path.parent, verify_bundles)
    _add_surprises(report, surprises, path, stages)
    return report


# --- what validation says, made specific -----------------------------------------------------------------------


def _add_lines(report: CheckReport, text: str) -> None:
    for line in text.splitlines():
        where, _, message = line.partition(": ")
        report.add(where, message)


def _raw_stages(data: Mapping[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    stages = data.get("stages")
    if not isinstance(stages, list):
        return []
    return [(index, stage) for index, stage in enumerate(stages) if isinstance(stage, dict)]


def _parts(path: str) -> list[str | int]:
    return [int(index) if index else key for key, index in _PATH_PART.findall(path)]


def _unknown_key_hint(where: str, data: Mapping[str, Any], stages: list[tuple[int, dict[str, Any]]]) -> str | None:
    """"did you mean <key>?" for a near miss, or where a vllm-omni stage key goes in this plan."""
    *parent, key = _parts(where)
    if not isinstance(key, str):
        return None
    model = _model_at(parent, data)
    if model is StageDeployConfig and key in _VLLM_OMNI_STAGE_KEYS:
        index = parent[-1]
        stage = dict(stages).get(index, {}) if isinstance(index, int) else {}
        backend = stage.get("backend")
        name = backend.get("name") if isinstance(backend, dict) else None
        prefix = f"stages[{index}].backend"
        if key == "engine_args":
            target = f"{prefix}.engine_args"
        elif key in _BACKEND_KEYS:
            target = f"{prefix}.{key}"
        else:
            target = f"{prefix}.engine_args.{key}"
        where_it_goes = (f"a vllm-omni stage key; in an omnigraph plan it belongs under the {NATIVE_BACKEND} "
                         f"backend: move it to {target}")
        if name == GRAPH_BACKEND:
            return where_it_goes + f" (this stage's backend is {GRAPH_BACKEND}: ONNX Runtime, no vLLM engine)"
        return where_it_goes
    if model is None:
        return None
    candidates = [name for name, spec in model.model_fields.items() if not spec.exclude]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f"did you mean {close[0]}?" if close else f"the keys here are {', '.join(candidates)}"


_TYPE_HINTS = {
    "Input should be a valid string": "write a string (quote it if YAML would read it as something else)",
    "Input should be a valid integer": "write a whole number, without quotes",
    "Input should be a valid number": "write a number, without quotes",
    "Input should be a valid boolean": "write true or false",
    "Input should be a valid dictionary": "write a mapping ({key: value, ...})",
    "Input should be a valid list": "write a list ([a, b, ...])",
    "required key is missing": "add it",
}


def _validation_hint(message: str) -> str | None:
    return next((hint for start, hint in _TYPE_HINTS.items() if message.startswith(start)), None)


def _model_at(parts: Sequence[str | int], data: Any) -> type[BaseModel] | None:
    """The schema model (a pydantic class) at a YAML path, following the raw data through unions."""
    annotation: Any = DeployConfig
    node = data
    for part in parts:
        annotation = _unwrap(annotation, node)
        if isinstance(part, int):
            if get_origin(annotation) is not list:
                return None
            annotation = get_args(annotation)[0]
            node = node[part] if isinstance(node, list) and part < len(node) else None
            continue
        if isclass(annotation) and issubclass(annotation, BaseModel):
            spec = annotation.model_fields.get(part)
            if spec is None:
                return None
            annotation = spec.annotation
        elif get_origin(annotation) is dict:
            annotation = get_args(annotation)[1]
        else:
            return None
        node = node.get(part) if isinstance(node, dict) else None
    annotation = _unwrap(annotation, node)
    return annotation if isclass(annotation) and issubclass(annotation, BaseModel) else None


def _unwrap(annotation: Any, node: Any) -> Any:
    """`annotation` without Annotated / Optional; of a union of models, the one the data names."""
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation = get_args(annotation)[0]
        elif origin in (Union, types.UnionType):
            members = [m for m in get_args(annotation) if m is not type(None)]
            if len(members) == 1:
                annotation = members[0]
                continue
            name = node.get("name") if isinstance(node, dict) else None
            named = [m for m in members if isclass(m) and issubclass(m, BaseModel) and "name" in m.model_fields
                     and name in get_args(m.model_fields["name"].annotation)]
            return named[0] if named else annotation
        else:
            return annotation


def _add_surprises(report: CheckReport, surprises: list[YamlSurprise], plan: Path,
                   stages: list[tuple[int, dict[str, Any]]]) -> None:
    """Each YAML 1.1 reading as a problem; one at the path of a problem already found explains it."""
    for surprise in surprises:
        where = _plan_path(surprise, stages)
        origin = f"line {surprise.line}" if Path(surprise.file) == plan else f"{surprise.file} line {surprise.line}"
        for index, problem in enumerate(report.problems):
            if problem.path == where:
                generic = problem.hint is None or problem.hint in _TYPE_HINTS.values()
                hint = surprise.explain() if generic else f"{surprise.explain()}; {problem.hint}"
                report.problems[index] = dataclasses.replace(problem, hint=hint)
                break
        else:
            report.add(where, f"{surprise.text} ({origin}) is read as {surprise.value!r}", surprise.explain())


def _plan_path(surprise: YamlSurprise, stages: list[tuple[int, dict[str, Any]]]) -> str:
    """A surprise's path in the merged plan: a base_config file's or overlay's `stages[k]` is the
    plan's stage of the same stage_id (stages merge by stage_id)."""
    match = re.match(r"stages\[(\d+)\]", surprise.path)
    if match is None:
        return surprise.path
    try:
        written = read_yaml_file(Path(surprise.file))["stages"][int(match[1])]["stage_id"]
    except Exception:  # the file changed or is odd: keep its own path
        return surprise.path
    merged = [index for index, stage in stages if stage.get("stage_id") == written]
    return f"stages[{merged[0]}]{surprise.path[match.end():]}" if merged else surprise.path


# --- engine_args -------------------------------------------------------------------------------------------------


def engine_arg_types() -> tuple[dict[str, Any], str | None]:
    """(name -> declared type, the vLLM version they come from): the fields of vLLM's
    AsyncEngineArgs when vLLM imports, else (WELL_KNOWN_ENGINE_ARGS, None)."""
    try:
        import vllm
        from vllm.engine.arg_utils import AsyncEngineArgs
    except Exception:  # not installed, or installed but unusable here: the table stands in
        return dict(WELL_KNOWN_ENGINE_ARGS), None
    return {spec.name: spec.type for spec in dataclasses.fields(AsyncEngineArgs)}, str(vllm.__version__)


def _check_engine_args(report: CheckReport, stages: list[tuple[int, dict[str, Any]]]) -> None:
    native = [(index, stage["backend"]) for index, stage in stages
              if isinstance(stage.get("backend"), dict) and stage["backend"].get("name") == NATIVE_BACKEND
              and stage["backend"].get("engine_args")]
    if not native:
        return
    declared, version = engine_arg_types()
    from_vllm = version is not None
    report.notes.append(
        f"engine_args checked against the field types of vLLM {version}'s AsyncEngineArgs" if from_vllm else
        f"engine_args checked against omnigraph's table of {len(declared)} well-known vLLM engine arguments "
        "(vLLM cannot be imported here); other keys were not checked")
    for index, backend in native:
        args = backend["engine_args"]
        base = f"stages[{index}].backend.engine_args"
        if not isinstance(args, dict):
            report.add(base, f"must be a mapping of vLLM engine arguments, got {_shown(args)}")
            continue
        for key, value in args.items():
            where = f"{base}.{key}"
            if key in MANAGED_ENGINE_ARGS:
                own = f"write it as stages[{index}].backend.{key}" if key in _BACKEND_KEYS else "remove it"
                report.add(where, "is set by omnigraph for a pooling stage", own)
                continue
            if key not in declared:
                if from_vllm:
                    close = difflib.get_close_matches(str(key), list(declared), n=1, cutoff=0.6)
                    report.add(where, "is not an argument of vLLM's AsyncEngineArgs",
                               f"did you mean {close[0]}?" if close else "see vLLM's engine arguments")
                continue
            expected = _type_problem(value, declared[key])
            if expected is not None:
                report.add(where, f"vLLM declares {_type_name(declared[key])}, got {_shown(value)}",
                           _engine_arg_hint(value, expected))


def _engine_arg_hint(value: Any, expected: str) -> str:
    if isinstance(value, str) and "integer" in expected:
        try:
            amount = parse_byte_amount(value)
        except ValueError:
            pass
        else:
            return f"engine_args go to vLLM as they are, without byte units: write {amount}"
    return f"write {expected}"


def _type_problem(value: Any, annotation: Any) -> str | None:
    """None when `value` (parsed YAML) fits `annotation`, else what was expected, in words.
    Types this cannot judge (vLLM's config classes, callables, forward references) pass."""
    if annotation is Any or isinstance(annotation, str):
        return None
    origin = get_origin(annotation)
    if origin is Annotated:
        return _type_problem(value, get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        wanted = [_type_problem(value, member) for member in get_args(annotation)]
        return None if None in wanted else " or ".join(dict.fromkeys(w for w in wanted if w))
    if origin is Literal:
        choices = get_args(annotation)
        return None if any(type(value) is type(c) and value == c for c in choices) else f"one of {list(choices)}"
    if annotation is type(None):
        return None if value is None else "null"
    simple = {bool: (lambda v: isinstance(v, bool), "a boolean (true or false)"),
              int: (lambda v: type(v) is int, "an integer"),
              float: (lambda v: type(v) in (int, float), "a number"),
              str: (lambda v: isinstance(v, str), "a string")}
    if annotation in simple:
        fits, words = simple[annotation]
        return None if fits(value) else words
    if annotation in (list, set, tuple, frozenset) or origin in (list, set, tuple, frozenset, Sequence):
        if not isinstance(value, list):
            return "a list"
        items = get_args(annotation)
        if items and origin is not tuple:
            for item in value:
                inner = _type_problem(item, items[0])
                if inner is not None:
                    return f"a list of {inner.removeprefix('a ').removeprefix('an ')}s"
        return None
    if annotation is dict or origin in (dict, Mapping):
        return None if isinstance(value, dict) else "a mapping"
    return None


def _type_name(annotation: Any) -> str:
    if isclass(annotation) and get_origin(annotation) is None:
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("NoneType", "None")


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if value is None:
        return "null"
    kinds = {str: "the string", int: "the integer", float: "the float", list: "a list", dict: "a mapping"}
    return f"{kinds.get(type(value), type(value).__name__)} {value!r}" if not isinstance(value, (list, dict)) \
        else kinds[type(value)]


# --- routes ------------------------------------------------------------------------------------------------------


def _route(stage: dict[str, Any]) -> dict[str, Any] | None:
    backend = stage.get("backend")
    if not isinstance(backend, dict) or backend.get("name") != GRAPH_BACKEND:
        return None
    route = backend.get("route")
    return route if isinstance(route, dict) else None


def _check_cuda_graphs(report: CheckReport, stages: list[tuple[int, dict[str, Any]]]) -> None:
    """CUDA graphs run on the CUDA execution provider only."""
    for index, stage in stages:
        route = _route(stage)
        if route is None:
            continue
        ep = route.get("ep", "cpu")
        if ep == "cuda":
            continue
        where = f"stages[{index}].backend.route"
        hint = ("CUDA graphs run on ep: cuda only: remove the key (or set it false) on this route, "
                "or run the stage on ep: cuda")
        if route.get("enable_cuda_graph") is True:
            report.add(f"{where}.enable_cuda_graph", f"CUDA graphs asked for on an ep: {ep} route", hint)
        options = route.get("provider_options")
        if isinstance(options, dict) and str(options.get("enable_cuda_graph", "0")).lower() not in ("0", "false"):
            report.add(f"{where}.provider_options.enable_cuda_graph",
                       f"CUDA graphs asked for on an ep: {ep} route (through ONNX Runtime provider options)", hint)


# --- the resource budget -----------------------------------------------------------------------------------------


def _amounts(budget: Any, table: str) -> dict[str, int]:
    """A stage's capacities or demands that parse (validation reports the others)."""
    raw = budget.get(table) if isinstance(budget, dict) else None
    amounts = {}
    for name, value in (raw.items() if isinstance(raw, dict) else ()):
        try:
            amount = parse_byte_amount(value)
        except ValueError:
            continue
        if type(amount) is int and amount >= 0:
            amounts[str(name)] = amount
    return amounts


def _amount(value: int) -> str:
    shown = format_bytes(value)
    return str(value) if shown == str(value) else f"{value} ({shown})"


def _check_budget(report: CheckReport, stages: list[tuple[int, dict[str, Any]]], *, per_node: bool) -> None:
    """What the ResourceLedger does at start (declare every stage's capacities, reserve every replica's
    demands at once), as arithmetic: each refusal it would raise, for every constraint (`per_node`: a
    Ray plan's `machine:` constraints, where only one replica's demand is sure to share a node)."""
    capacity: dict[str, tuple[int, int]] = {}  # constraint -> (amount, the first stage declaring it)
    charges: dict[str, list[tuple[int, int, int]]] = {}  # constraint -> [(stage index, demand, replicas)]
    for index, stage in stages:
        budget = stage.get("resource_budget")
        for name, amount in _amounts(budget, "capacities").items():
            known = capacity.setdefault(name, (amount, index))
            if known[0] != amount:
                report.add(f"stages[{index}].resource_budget.capacities.{name}",
                           f"capacity {_amount(amount)} differs from the {_amount(known[0])} stages[{known[1]}] "
                           "declares; the ledger refuses a constraint declared with two amounts",
                           "a capacity is the machine's, not the stage's: declare the same amount in every stage")
        replicas = stage.get("num_replicas", 1)
        replicas = replicas if type(replicas) is int and replicas >= 1 else 1
        for name, amount in _amounts(budget, "demands").items():
            charges.setdefault(name, []).append((index, amount, replicas))
    for name, charged in charges.items():
        if name not in capacity:
            continue  # validation says so
        limit = capacity[name][0]
        over = False
        each_node = per_node and name.startswith(MACHINE_PREFIX)  # held to one replica's demand alone
        if each_node:
            charged = [(index, amount, 1) for index, amount, _ in charged]
        for index, amount, replicas in charged:
            if amount * replicas > limit:
                over = True
                times = f" x {replicas} replicas = {_amount(amount * replicas)}" if replicas > 1 else ""
                report.add(f"stages[{index}].resource_budget.demands.{name}",
                           f"demand {_amount(amount)}{times} is above the capacity {_amount(limit)}",
                           "lower the demand" + (" or num_replicas" if replicas > 1 else "") +
                           ", or raise the capacity if the machine has it")
        total = sum(amount * replicas for _, amount, replicas in charged)
        if not over and total > limit and not each_node:
            parts = " + ".join(f"stages[{i}] {_amount(a)}" + (f" x {r}" if r > 1 else "") for i, a, r in charged)
            report.add(f"stages[{charged[-1][0]}].resource_budget.demands.{name}",
                       f"the plan's stages together demand {_amount(total)} ({parts}), above the capacity "
                       f"{_amount(limit)}",
                       "the whole plan is reserved before any stage loads: lower the demands or replicas so they "
                       "fit together, or raise the capacity if the machine has it")


# --- the plan as it would start ----------------------------------------------------------------------------------


def _check_plan(report: CheckReport, deploy: DeployConfig, verify_bundles: bool) -> None:
    """The pipeline, and each graph stage's route and bundle and whether they fit, as a start would
    build them (up to loading the graph: nothing is loaded)."""
    pipeline: PipelineConfig | None = None
    try:
        pipeline = resolve_pipeline(deploy)
    except DeployConfigError as exc:
        _add_lines(report, str(exc))
    described = []
    for index, stage in enumerate(deploy.stages):
        if isinstance(stage.backend, GraphBackendConfig):
            described.append(_check_graph_stage(report, index, stage, pipeline, verify_bundles))
        elif stage.backend is not None:
            described.append(f"stage {stage.stage_id}: {NATIVE_BACKEND} (vLLM) over {stage.backend.model}, "
                             f"dtype {stage.backend.dtype}")
    if not verify_bundles:
        report.notes.append("bundle hashes were not checked (--skip-hashes): only each manifest and its file list")
    replicas = sum(stage.num_replicas for stage in deploy.stages)
    reserved: dict[str, int] = {}
    for stage in deploy.stages:
        for name, amount in stage.resource_budget.demands.items():
            reserved[name] = reserved.get(name, 0) + amount * stage.num_replicas
    capacities = {name: amount for stage in deploy.stages for name, amount in stage.resource_budget.capacities.items()}
    on_ray = deploy.distributed_executor_backend == "ray"
    budget = ", ".join(f"{name} {format_bytes(amount)} of {format_bytes(capacities[name])}"
                       for name, amount in sorted(reserved.items())
                       if name in capacities and not (on_ray and name.startswith(MACHINE_PREFIX)))
    if on_ray and any(name.startswith(MACHINE_PREFIX) for name in reserved):
        report.notes.append("distributed_executor_backend: ray: machine: demands are admitted on the node Ray places "
                            "each replica on (each node holding the capacity), at start")
    count = len(deploy.stages)
    report.summary = [
        f"plan OK: pipeline {deploy.pipeline}, {count} stage{'s' * (count != 1)}, "
        f"{replicas} replica{'s' * (replicas != 1)}" + (" on a Ray cluster" if on_ray else "")
        + (f"; reserves {budget}" if budget else ""),
        *(f"  {line}" for line in described),
    ]


def _check_valid_stages(report: CheckReport, data: Mapping[str, Any], stages: list[tuple[int, dict[str, Any]]],
                        base_dir: Path, verify_bundles: bool) -> None:
    """With the plan refused by the schema, the graph stages that pass it on their own still get their
    route, bundle and fit checked, so one run shows those problems too."""
    pipeline: PipelineConfig | None = None
    try:
        pipeline = get_pipeline(str(data.get("pipeline")))
    except Exception:  # not registered (declared inline) or no name: the adapter check needs the plan
        pipeline = None
    for index, raw in stages:
        try:
            stage = StageDeployConfig.model_validate(raw, context={"base_dir": str(base_dir), "vllm_optional": True})
        except ValidationError:
            continue  # its problems are reported already
        if isinstance(stage.backend, GraphBackendConfig):
            _check_graph_stage(report, index, stage, pipeline, verify_bundles)


def _check_graph_stage(report: CheckReport, index: int, stage: StageDeployConfig, pipeline: PipelineConfig | None,
                       verify_bundles: bool) -> str:
    backend = stage.graph_backend
    where = f"stages[{index}].backend"
    fields = stage.worker_route_fields()
    if fields["ep"] != "cuda":
        fields["enable_cuda_graph"] = False  # already refused by _check_cuda_graphs; look for more
    # as stages.graph_stage.worker_route: the stage's VRAM demand on its device is ORT's arena limit
    vram = stage.resource_budget.demands.get(f"machine:vram:{fields['device_id']}") if fields["ep"] != "cpu" else None
    route: WorkerRoute | None = None
    try:
        route = WorkerRoute.from_dict({**fields, "gpu_mem_limit": vram or None})
    except RouteInvalid as exc:
        report.add(f"{where}.route", str(exc))
    bundle: Any = None
    try:
        bundle = verify_bundle(backend.manifest) if verify_bundles else read_bundle_layout(backend.manifest)
    except (BundleError, OSError) as exc:
        report.add(f"{where}.manifest", str(exc),
                   "`omnigraph bundle verify` says the same; rebuild or re-pack the bundle")
    declared = {config.stage_id: config for config in pipeline.stages} if pipeline is not None else {}
    adapter = declared[stage.stage_id].batch_adapter if stage.stage_id in declared else None
    if adapter is not None and route is not None and bundle is not None:
        try:
            resolve_dotted(adapter)(bundle, route)
        except Exception as exc:
            fixed = route.enable_cuda_graph or route.ep == "tensorrt"
            key = (".route.enable_cuda_graph" if route.enable_cuda_graph else ".route.ep") if fixed else ".manifest"
            hint = ("this route runs fixed shapes (a CUDA graph or a TensorRT engine): serve a bundle built for them "
                    "(bf16 or fp16), or a route that takes any shape (ep: cpu, or ep: cuda without "
                    "enable_cuda_graph)") if fixed else None
            report.add(where + key, f"the route does not fit the bundle: {exc}", hint)
    shown = "bundle unreadable" if bundle is None else (
        f"bundle {bundle.manifest.component} {bundle.manifest.metadata.precision}"
        f"{' (verified)' if verify_bundles else ''}")
    route_name = backend.route.name
    extras = ", CUDA graphs" if backend.route.enable_cuda_graph else ""
    replicas = f", {stage.num_replicas} replicas" if stage.num_replicas > 1 else ""
    return f"stage {stage.stage_id}: route {route_name} (ep {backend.route.ep}{extras}{replicas}), {shown}"
