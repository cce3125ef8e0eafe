"""WorkerRoute: where and how a graph worker runs (interpreter, execution provider, limits).

Validated once at construction; the worker receives it as JSON (``to_json`` / ``from_json``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from omnigraph.workers.mailbox import MAX_AREA_BYTES, MIN_AREA_BYTES
from omnigraph.workers.wire import SPIN_WAIT_US

EP_PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
OS_DOMAINS = ("posix",)
# Why: the wire's own cap on a frame's tensor bytes must stay addressable and sane.
MAX_IO_BYTES_LIMIT = 1 << 40
DEFAULT_MAX_IO_BYTES = 8 * 1024 * 1024
# Why: vLLM captures CUDA graphs up to a batch of 512 by default (max_cudagraph_capture_size); a
# decision row carries a whole sequence, so far fewer rows are launch-bound.
DEFAULT_CUDA_GRAPH_MAX_ROWS = 8
# Why: a served stage visits the bundle's example shape, its warm-up request's and one shape per
# (rows, length) bucket of its traffic; 4 slots left batch-1 Laya at 512 tokens uncaptured on the
# H200 (5.2 ms instead of 2.3). Each graph keeps its buffers inside the route's gpu_mem_limit.
DEFAULT_MAX_CUDA_GRAPHS = 16
# Why: more captured graphs than this is a shape policy gone wrong, not a cache.
MAX_CUDA_GRAPHS_LIMIT = 256
# Why: polling longer than this is a busy loop, not a wait for the next message.
MAX_SPIN_WAIT_US = 100_000
# Why: a decision model's call (token ids, masks) and its answer fit with room to spare; larger
# frames go through the socket, and the worker maps two areas of this size.
DEFAULT_MAILBOX_BYTES = 1 << 20


def mailbox_bytes_problem(value: Any) -> str | None:
    """What is wrong with a route's ``mailbox_bytes`` (None: nothing; 0 means no mailbox)."""
    if type(value) is not int or not (value == 0 or MIN_AREA_BYTES <= value <= MAX_AREA_BYTES):
        return f"must be 0 (every frame through the socket) or an integer in [{MIN_AREA_BYTES}, {MAX_AREA_BYTES}]"
    return None


class RouteInvalid(ValueError):
    """A route field is missing, of the wrong type or contradicts another field."""


def _option_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


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
        if not isinstance(self.interpreter, str) or not os.path.isabs(self.interpreter):
            raise RouteInvalid(f"route {self.name!r}: interpreter must be an absolute path, got {self.interpreter!r}")
        if self.ep not in EP_PROVIDERS:
            raise RouteInvalid(f"route {self.name!r}: ep must be one of {sorted(EP_PROVIDERS)}, got {self.ep!r}")
        if type(self.device_id) is not int or self.device_id < 0:
            raise RouteInvalid(f"route {self.name!r}: device_id must be an integer >= 0")
        if not isinstance(self.provider_options, Mapping) or not all(
            isinstance(k, str) and isinstance(v, (str, int, float, bool)) for k, v in self.provider_options.items()
        ):
            raise RouteInvalid(f"route {self.name!r}: provider_options must map strings to scalars")
        allowed = tuple(self.allowed_providers) or (self.target_provider,)
        if not all(isinstance(p, str) and p.endswith("ExecutionProvider") for p in allowed):
            raise RouteInvalid(f"route {self.name!r}: allowed_providers must be ORT provider names, got {allowed}")
        if self.target_provider not in allowed:
            raise RouteInvalid(f"route {self.name!r}: allowed_providers {allowed} lacks the target "
                               f"{self.target_provider}")
        if isinstance(self.min_fraction_on_target, bool) or not isinstance(self.min_fraction_on_target, (int, float)) \
                or not 0.0 <= self.min_fraction_on_target <= 1.0:
            raise RouteInvalid(f"route {self.name!r}: min_fraction_on_target must be in [0, 1]")
        if self.os_domain not in OS_DOMAINS:
            raise RouteInvalid(f"route {self.name!r}: os_domain must be one of {OS_DOMAINS}, got {self.os_domain!r}")
        if type(self.max_io_bytes) is not int or not 0 < self.max_io_bytes <= MAX_IO_BYTES_LIMIT:
            raise RouteInvalid(f"route {self.name!r}: max_io_bytes must be an integer in (0, 2**40]")
        if not isinstance(self.enable_cuda_graph, bool):
            raise RouteInvalid(f"route {self.name!r}: enable_cuda_graph must be a boolean")
        if self.enable_cuda_graph and self.ep != "cuda":
            raise RouteInvalid(f"route {self.name!r}: enable_cuda_graph needs ep 'cuda', not {self.ep!r}")
        if type(self.cuda_graph_max_rows) is not int or self.cuda_graph_max_rows < 1:
            raise RouteInvalid(f"route {self.name!r}: cuda_graph_max_rows must be an integer >= 1")
        if type(self.max_cuda_graphs) is not int or not 1 <= self.max_cuda_graphs <= MAX_CUDA_GRAPHS_LIMIT:
            raise RouteInvalid(f"route {self.name!r}: max_cuda_graphs must be an integer in "
                               f"[1, {MAX_CUDA_GRAPHS_LIMIT}]")
        if self.gpu_mem_limit is not None:
            if type(self.gpu_mem_limit) is not int or self.gpu_mem_limit <= 0:
                raise RouteInvalid(f"route {self.name!r}: gpu_mem_limit must be a positive integer (bytes)")
            if self.ep == "cpu":
                raise RouteInvalid(f"route {self.name!r}: gpu_mem_limit applies to the cuda and tensorrt routes only")
        if self.intra_op_num_threads is not None and (
            type(self.intra_op_num_threads) is not int or self.intra_op_num_threads < 1
        ):
            raise RouteInvalid(f"route {self.name!r}: intra_op_num_threads must be an integer >= 1")
        if not isinstance(self.env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()
        ):
            raise RouteInvalid(f"route {self.name!r}: env must map strings to strings")
        if type(self.spin_wait_us) is not int or not 0 <= self.spin_wait_us <= MAX_SPIN_WAIT_US:
            raise RouteInvalid(f"route {self.name!r}: spin_wait_us must be an integer in [0, {MAX_SPIN_WAIT_US}]")
        if problem := mailbox_bytes_problem(self.mailbox_bytes):
            raise RouteInvalid(f"route {self.name!r}: mailbox_bytes {problem}")
        object.__setattr__(self, "allowed_providers", allowed)
        object.__setattr__(self, "min_fraction_on_target", float(self.min_fraction_on_target))
        object.__setattr__(self, "provider_options", MappingProxyType(dict(self.provider_options)))
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))

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
