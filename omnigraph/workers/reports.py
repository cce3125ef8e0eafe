"""What a worker tells its controller: its hello (who and what it is), a load report and the
placement report in it (where ONNX Runtime really ran each node; placement.py reads and checks it)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SOURCE_PROFILE = "ort_profile"
SOURCE_UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class PlacementReport:
    """The provider of every executed node.

    ``node_providers`` maps node name -> provider, ``nodes_by_provider`` counts them,
    ``fraction_on_target`` is the share run by ``target_provider`` (None when ORT gave no
    information: ``source`` is then "unavailable" and ``note`` says why).
    """

    target_provider: str
    nodes_by_provider: Mapping[str, int]
    node_providers: Mapping[str, str]
    node_ops: Mapping[str, str]
    fraction_on_target: float | None
    source: str = SOURCE_PROFILE
    note: str = ""

    def off_target_nodes(self) -> dict[str, str]:
        """node name -> provider for every node the target provider did not run."""
        return {n: p for n, p in self.node_providers.items() if p != self.target_provider}

    def to_dict(self) -> dict[str, Any]:
        return {
            "target_provider": self.target_provider,
            "nodes_by_provider": dict(self.nodes_by_provider),
            "node_providers": dict(self.node_providers),
            "node_ops": dict(self.node_ops),
            "fraction_on_target": self.fraction_on_target,
            "source": self.source,
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlacementReport:
        return cls(
            target_provider=data["target_provider"],
            nodes_by_provider=dict(data["nodes_by_provider"]),
            node_providers=dict(data["node_providers"]),
            node_ops=dict(data["node_ops"]),
            fraction_on_target=data["fraction_on_target"],
            source=data["source"],
            note=data["note"],
        )

    @classmethod
    def from_nodes(cls, target_provider: str, nodes: Mapping[str, tuple[str, str]]) -> PlacementReport:
        """From node name -> (provider, op type)."""
        providers = {name: provider for name, (provider, _) in nodes.items()}
        counts = Counter(providers.values())
        fraction = counts[target_provider] / len(providers) if providers else None
        return cls(
            target_provider=target_provider,
            nodes_by_provider=dict(counts),
            node_providers=providers,
            node_ops={name: op for name, (_, op) in nodes.items()},
            fraction_on_target=fraction,
            source=SOURCE_PROFILE if providers else SOURCE_UNAVAILABLE,
            note="" if providers else "the ORT profile held no node events",
        )

    @classmethod
    def unavailable(cls, target_provider: str, note: str) -> PlacementReport:
        return cls(target_provider, {}, {}, {}, None, SOURCE_UNAVAILABLE, note)


@dataclass(frozen=True)
class WorkerHello:
    """The worker's first message: identity (pid, start time, instance) and its software."""

    interpreter: str
    python_version: str
    onnxruntime_version: str
    onnx_version: str
    numpy_version: str
    available_providers: tuple[str, ...]
    pid: int
    start_time_ticks: int  # /proc/<pid>/stat field 22: with the pid, the process identity
    start_time_unix: float
    instance: str
    wire_version: int
    features: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        data["available_providers"] = list(self.available_providers)
        data["features"] = list(self.features)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerHello:
        values = {name: data[name] for name in cls.__dataclass_fields__}
        values["available_providers"] = tuple(values["available_providers"])
        values["features"] = tuple(values["features"])
        return cls(**values)


@dataclass(frozen=True)
class TensorSpec:
    """A graph input or output as ORT declares it (dims: int, or a symbolic name / None)."""

    name: str
    onnx_type: str
    shape: tuple[int | str | None, ...]


@dataclass(frozen=True)
class LoadReport:
    """A loaded bundle: identity, the session's providers, its I/O and the real placement."""

    manifest_path: str
    manifest_sha256: str
    component: str
    session_providers: tuple[str, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    placement: PlacementReport
    custom_ops_library: str | None
    warmup_ms: float
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "manifest_path": self.manifest_path,
            "manifest_sha256": self.manifest_sha256,
            "component": self.component,
            "session_providers": list(self.session_providers),
            "inputs": [[s.name, s.onnx_type, list(s.shape)] for s in self.inputs],
            "outputs": [[s.name, s.onnx_type, list(s.shape)] for s in self.outputs],
            "placement": self.placement.to_dict(),
            "custom_ops_library": self.custom_ops_library,
            "warmup_ms": self.warmup_ms,
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoadReport:
        return cls(
            manifest_path=data["manifest_path"],
            manifest_sha256=data["manifest_sha256"],
            component=data["component"],
            session_providers=tuple(data["session_providers"]),
            inputs=tuple(TensorSpec(n, t, tuple(s)) for n, t, s in data["inputs"]),
            outputs=tuple(TensorSpec(n, t, tuple(s)) for n, t, s in data["outputs"]),
            placement=PlacementReport.from_dict(data["placement"]),
            custom_ops_library=data["custom_ops_library"],
            warmup_ms=data["warmup_ms"],
            notes=tuple(data["notes"]),
        )
