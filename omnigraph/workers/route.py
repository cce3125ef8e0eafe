"""WorkerRoute: where and how a graph worker runs (interpreter, execution provider, limits).

The one declaration of a route's fields: their types and defaults are the dataclass fields below
(the defaults themselves live in bundles/defaults.py), and their checks one table (`_CHECKS`). The
deploy schema (pipelines/deploy.py `RouteConfig`) reads its defaults from these fields, and the
engine builds a route from a validated stage by field name (`WorkerRoute.from_dict`). Validated
once at construction; the worker receives it as JSON (``to_json`` / ``from_json``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from types import MappingProxyType
from typing import Any

from omnigraph.bundles.defaults import (
    DEFAULT_CUDA_GRAPH_MAX_ROWS,
    DEFAULT_MAILBOX_BYTES,
    DEFAULT_MAX_CUDA_GRAPHS,
    DEFAULT_MAX_IO_BYTES,
    MAX_CUDA_GRAPHS_LIMIT,
    MAX_IO_BYTES_LIMIT,
    MAX_SPIN_WAIT_US,
)
from omnigraph.workers.mailbox import MAX_AREA_BYTES, MIN_AREA_BYTES
from omnigraph.workers.wire import SPIN_WAIT_US

EP_PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
OS_DOMAINS = ("posix",)


_MAILBOX_BYTES_RULE = (f"must be 0 (every frame through the socket) or an integer in "
                       f"[{MIN_AREA_BYTES}, {MAX_AREA_BYTES}]")


def mailbox_bytes_problem(value: Any) -> str | None:
    """What is wrong with a route's ``mailbox_bytes`` (None: nothing; 0 means no mailbox)."""
    if type(value) is not int or not (value == 0 or MIN_AREA_BYTES <= value <= MAX_AREA_BYTES):
        return _MAILBOX_BYTES_RULE
    return None


class RouteInvalid(ValueError):
    """A route field is missing, of the wrong type or contradicts another field."""


def _option_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _int_in(value: Any, low: int, high: int | None = None) -> bool:
    """`value` is an int (not a bool) in [low, high] (no upper bound when high is None)."""
    return type(value) is int and low <= value and (high is None or value <= high)


def _maps(value: Any, keys: type | tuple[type, ...], values: type | tuple[type, ...]) -> bool:
    return isinstance(value, Mapping) and all(isinstance(k, keys) and isinstance(v, values) for k, v in value.items())


@dataclass(frozen=True)
class WorkerRoute:
    """A graph worker's placement and limits.

    ``allowed_providers`` defaults to the target provider alone; ``min_fraction_on_target`` is the
    least fraction of executed nodes the target provider must run (see placement.check_placement).
    ``gpu_mem_limit`` is the ORT arena limit in bytes (the ledger's VRAM demand).
    ``cuda_graph_max_rows``: with ``enable_cuda_graph``, only calls whose inputs all have at most
    this many rows (their leading dimension) run from a captured CUDA graph; larger calls, whose
    kernels outweigh their launches, run uncaptured at their exact shape (vLLM's
    max_cudagraph_capture_size). ``max_cuda_graphs``: how many input shapes get a captured graph;
    later shapes run uncaptured.
    ``spin_wait_us``: how long the worker and its client poll for the next message before
    sleeping (wire.SpinWait, or the mailbox's doorbell; 0 always sleeps at once).
    ``mailbox_bytes``: each direction's shared-memory area (mailbox.py): a run or result frame
    that fits travels there instead of through the socket; 0 keeps every frame on the socket.
    """

    name: str
    interpreter: str
    ep: str = "cpu"
    device_id: int = 0
    provider_options: Mapping[str, Any] = field(default_factory=dict)
    allowed_providers: tuple[str, ...] = ()
    min_fraction_on_target: float = 1.0
    os_domain: str = "posix"
    max_io_bytes: int = DEFAULT_MAX_IO_BYTES
    enable_cuda_graph: bool = False
    cuda_graph_max_rows: int = DEFAULT_CUDA_GRAPH_MAX_ROWS
    max_cuda_graphs: int = DEFAULT_MAX_CUDA_GRAPHS
    gpu_mem_limit: int | None = None
    intra_op_num_threads: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    spin_wait_us: int = SPIN_WAIT_US
    mailbox_bytes: int = DEFAULT_MAILBOX_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise RouteInvalid("route name must be a non-empty string")
        for ok, problem in _CHECKS:  # in order: a later check may rely on an earlier one (ep before allowed)
            if not ok(self):
                raise RouteInvalid(f"route {self.name!r}: " + problem.format(r=self))
        object.__setattr__(self, "allowed_providers", self._allowed)
        object.__setattr__(self, "min_fraction_on_target", float(self.min_fraction_on_target))
        object.__setattr__(self, "provider_options", MappingProxyType(dict(self.provider_options)))
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))

    @property
    def _allowed(self) -> tuple[str, ...]:
        """``allowed_providers`` as given, or the target provider alone."""
        return tuple(self.allowed_providers) or (self.target_provider,)

    @property
    def target_provider(self) -> str:
        """The ORT provider this route means to run on."""
        return EP_PROVIDERS[self.ep]

    def ort_providers(self) -> list[tuple[str, dict[str, str]]]:
        """The (provider, options) list for ``InferenceSession(providers=...)``, target first.

        CPU is listed last only when allowed; when it is not, the session also disables CPU
        fallback (see session.py).
        """
        chain: list[tuple[str, dict[str, str]]] = []
        target_options = {k: _option_value(v) for k, v in self.provider_options.items()}
        cuda_options = {"device_id": str(self.device_id)}
        if self.gpu_mem_limit is not None:
            cuda_options["gpu_mem_limit"] = str(self.gpu_mem_limit)
        if self.ep == "cuda":
            if self.enable_cuda_graph:
                cuda_options["enable_cuda_graph"] = "1"
            chain.append(("CUDAExecutionProvider", {**cuda_options, **target_options}))
        elif self.ep == "tensorrt":
            chain.append(("TensorrtExecutionProvider", {"device_id": str(self.device_id), **target_options}))
            if "CUDAExecutionProvider" in self.allowed_providers:
                chain.append(("CUDAExecutionProvider", cuda_options))
        else:
            chain.append(("CPUExecutionProvider", target_options))
        if self.ep != "cpu" and "CPUExecutionProvider" in self.allowed_providers:
            chain.append(("CPUExecutionProvider", {}))
        return chain

    def to_dict(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        data["provider_options"] = dict(self.provider_options)
        data["env"] = dict(self.env)
        data["allowed_providers"] = list(self.allowed_providers)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, allow_nan=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerRoute:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise RouteInvalid(f"route has unknown fields {sorted(unknown)}")
        values = dict(data)
        if "allowed_providers" in values:
            if not isinstance(values["allowed_providers"], (list, tuple)):
                raise RouteInvalid("allowed_providers must be a list of provider names")
            values["allowed_providers"] = tuple(values["allowed_providers"])
        try:
            return cls(**values)
        except TypeError as exc:  # a required field missing
            raise RouteInvalid(f"route: {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> WorkerRoute:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise RouteInvalid(f"route is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise RouteInvalid("route JSON must be an object")
        return cls.from_dict(data)


def route_default(name: str) -> Any:
    """The default of WorkerRoute field `name` (the deploy schema's default for the same key)."""
    spec = WorkerRoute.__dataclass_fields__[name]
    if spec.default_factory is not MISSING:
        return spec.default_factory()
    if spec.default is MISSING:
        raise KeyError(f"route field {name!r} has no default")
    return spec.default


ROUTE_FIELDS = tuple(spec.name for spec in fields(WorkerRoute))

# Every field's check after `name`, in order: (passes(route), what is wrong: a str.format template
# over the route `r`, shown after "route '<name>': ").
_CHECKS: tuple[tuple[Callable[[WorkerRoute], bool], str], ...] = (
    (lambda r: isinstance(r.interpreter, str) and os.path.isabs(r.interpreter),
     "interpreter must be an absolute path, got {r.interpreter!r}"),
    (lambda r: r.ep in EP_PROVIDERS, f"ep must be one of {sorted(EP_PROVIDERS)}, got {{r.ep!r}}"),
    (lambda r: _int_in(r.device_id, 0), "device_id must be an integer >= 0"),
    (lambda r: _maps(r.provider_options, str, (str, int, float, bool)), "provider_options must map strings to scalars"),
    (lambda r: all(isinstance(p, str) and p.endswith("ExecutionProvider") for p in r._allowed),
     "allowed_providers must be ORT provider names, got {r._allowed}"),
    (lambda r: r.target_provider in r._allowed, "allowed_providers {r._allowed} lacks the target {r.target_provider}"),
    (lambda r: not isinstance(r.min_fraction_on_target, bool) and isinstance(r.min_fraction_on_target, (int, float))
     and 0.0 <= r.min_fraction_on_target <= 1.0, "min_fraction_on_target must be in [0, 1]"),
    (lambda r: r.os_domain in OS_DOMAINS, f"os_domain must be one of {OS_DOMAINS}, got {{r.os_domain!r}}"),
    (lambda r: _int_in(r.max_io_bytes, 1, MAX_IO_BYTES_LIMIT), "max_io_bytes must be an integer in (0, 2**40]"),
    (lambda r: isinstance(r.enable_cuda_graph, bool), "enable_cuda_graph must be a boolean"),
    (lambda r: not r.enable_cuda_graph or r.ep == "cuda", "enable_cuda_graph needs ep 'cuda', not {r.ep!r}"),
    (lambda r: _int_in(r.cuda_graph_max_rows, 1), "cuda_graph_max_rows must be an integer >= 1"),
    (lambda r: _int_in(r.max_cuda_graphs, 1, MAX_CUDA_GRAPHS_LIMIT),
     f"max_cuda_graphs must be an integer in [1, {MAX_CUDA_GRAPHS_LIMIT}]"),
    (lambda r: r.gpu_mem_limit is None or _int_in(r.gpu_mem_limit, 1),
     "gpu_mem_limit must be a positive integer (bytes)"),
    (lambda r: r.gpu_mem_limit is None or r.ep != "cpu", "gpu_mem_limit applies to the cuda and tensorrt routes only"),
    (lambda r: r.intra_op_num_threads is None or _int_in(r.intra_op_num_threads, 1),
     "intra_op_num_threads must be an integer >= 1"),
    (lambda r: _maps(r.env, str, str), "env must map strings to strings"),
    (lambda r: _int_in(r.spin_wait_us, 0, MAX_SPIN_WAIT_US),
     f"spin_wait_us must be an integer in [0, {MAX_SPIN_WAIT_US}]"),
    (lambda r: mailbox_bytes_problem(r.mailbox_bytes) is None, "mailbox_bytes " + _MAILBOX_BYTES_RULE),
)
