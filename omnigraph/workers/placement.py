"""Where ONNX Runtime really ran each node, read from its own profiler, and the rule that refuses
a load whose placement breaks the route.

ORT writes one "Node" event per executed kernel (``<node name>_kernel_time``, with
``args.provider`` and ``args.op_name``); the worker profiles its warmup run, and
``placement_from_profile`` turns those events into a PlacementReport. Only nodes that ran are
counted (constant-folded or fused-away nodes are no longer nodes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omnigraph.workers.errors import PlacementRefused
from omnigraph.workers.reports import PlacementReport

# PlacementReport lives in reports.py (errors.py names it too); it is re-exported here.
__all__ = ["KERNEL_SUFFIX", "PlacementReport", "check_placement", "placement_from_events", "placement_from_profile"]

KERNEL_SUFFIX = "_kernel_time"


def placement_from_events(events: Sequence[Mapping[str, Any]], target_provider: str) -> PlacementReport:
    """A report from ORT profile events (the parsed JSON list)."""
    nodes: dict[str, tuple[str, str]] = {}
    for event in events:
        if event.get("cat") != "Node":
            continue
        name = str(event.get("name", ""))
        if not name.endswith(KERNEL_SUFFIX):
            continue
        args = event.get("args") or {}
        provider = args.get("provider")
        if not provider:
            continue
        op = str(args.get("op_name", ""))
        node = name[: -len(KERNEL_SUFFIX)] or f"{op}#{args.get('node_index', '?')}"
        nodes[node] = (str(provider), op)
    return PlacementReport.from_nodes(target_provider, nodes)


def placement_from_profile(profile_path: str | Path, target_provider: str) -> PlacementReport:
    """A report from an ORT profile file (``InferenceSession.end_profiling()``'s path)."""
    events = json.loads(Path(profile_path).read_text())
    if isinstance(events, dict):  # some ORT builds wrap the list
        events = events.get("traceEvents", [])
    return placement_from_events(events, target_provider)


def check_placement(
    report: PlacementReport, allowed_providers: Sequence[str], min_fraction_on_target: float
) -> None:
    """Raise PlacementRefused when a node ran on a provider outside ``allowed_providers``, or the
    target ran less than ``min_fraction_on_target`` of the nodes. A report without information
    (ORT profiled no node) passes only when ``min_fraction_on_target`` is 0.
    """
    allowed = set(allowed_providers)
    if report.fraction_on_target is None:
        if min_fraction_on_target > 0.0:
            raise PlacementRefused(
                "placement_refused",
                f"placement unknown ({report.note}) but the route needs {min_fraction_on_target:.0%} "
                f"of the nodes on {report.target_provider}",
                report,
            )
        return
    outside = {n: p for n, p in report.node_providers.items() if p not in allowed}
    if outside:
        raise PlacementRefused(
            "placement_refused",
            f"{len(outside)} of {len(report.node_providers)} nodes ran on providers outside "
            f"{sorted(allowed)}: {_describe(outside, report)}",
            report,
        )
    if report.fraction_on_target < min_fraction_on_target:
        off = report.off_target_nodes()
        raise PlacementRefused(
            "placement_refused",
            f"{report.fraction_on_target:.1%} of the nodes ran on {report.target_provider}, the route "
            f"needs {min_fraction_on_target:.1%}; off target: {_describe(off, report)}",
            report,
        )


def _describe(nodes: Mapping[str, str], report: PlacementReport, limit: int = 20) -> str:
    items = [f"{name} ({report.node_ops.get(name, '?')} on {provider})"
             for name, provider in list(nodes.items())[:limit]]
    more = len(nodes) - len(items)
    return ", ".join(items) + (f" and {more} more" if more > 0 else "")
