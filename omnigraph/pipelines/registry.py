"""Where pipeline declarations are found by name.

Pipelines register explicitly (`register_pipeline`) or through the `omnigraph.pipelines`
entry-point group, which is consulted on a miss so that installing a package is enough to serve
its models. Model code is referenced by dotted strings and imported only when used.
"""

from __future__ import annotations

import importlib
import threading
from importlib.metadata import entry_points
from typing import Any

from omnigraph.pipelines.config import PipelineConfig, check_dotted

ENTRY_POINT_GROUP = "omnigraph.pipelines"

_registry: dict[str, PipelineConfig] = {}
_lock = threading.Lock()


class PipelineNotFound(LookupError):
    """No pipeline is registered or installed under the requested name."""


def register_pipeline(config: PipelineConfig) -> PipelineConfig:
    """Register `config` under its `model_type`; registering the same declaration twice is a no-op."""
    if not isinstance(config, PipelineConfig):
        raise TypeError(f"register_pipeline takes a PipelineConfig, got {type(config).__name__}")
    with _lock:
        known = _registry.get(config.model_type)
        if known is not None and known != config:
            raise ValueError(f"a different pipeline is already registered as {config.model_type!r}")
        _registry[config.model_type] = config
    return config


def get_pipeline(name: str) -> PipelineConfig:
    """The pipeline named `name`, loading it from the entry-point group on a miss."""
    with _lock:
        found = _registry.get(name)
    if found is not None:
        return found
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name == name:
            config = point.load()
            if not isinstance(config, PipelineConfig) or config.model_type != name:
                raise TypeError(f"entry point {point.value!r} must name a PipelineConfig with model_type {name!r}")
            return register_pipeline(config)
    raise PipelineNotFound(f"unknown pipeline {name!r}; known: {', '.join(available_pipelines()) or 'none'}")


def available_pipelines() -> list[str]:
    """Names that `get_pipeline` can resolve: registered ones and installed entry points."""
    with _lock:
        names = set(_registry)
    names.update(point.name for point in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def resolve_dotted(reference: str) -> Any:
    """Import `package.module:attr.path` and return the attribute."""
    check_dotted(reference, "reference")
    module_name, _, attr_path = reference.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ImportError(f"{reference!r}: module {module_name!r} has no attribute {attr_path!r}") from None
    return target
