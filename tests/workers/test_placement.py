"""Placement reports from ORT profile events, and the rule that refuses a bad placement."""

from __future__ import annotations

import pytest

from omnigraph.workers.errors import PlacementRefused
from omnigraph.workers.placement import PlacementReport, check_placement, placement_from_events

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"


def split(cuda: int, cpu: int) -> PlacementReport:
    nodes = {f"gpu{i}": (CUDA, "MatMul") for i in range(cuda)}
    nodes.update({f"host{i}": (CPU, "NonZero") for i in range(cpu)})
    return PlacementReport.from_nodes(CUDA, nodes)


def test_events_become_a_report():
    events = [
        {"cat": "Session", "name": "model_run", "args": {}},
        {"cat": "Node", "name": "mm_fence_before", "args": {"provider": CUDA, "op_name": "MatMul"}},
        {"cat": "Node", "name": "mm_kernel_time", "args": {"provider": CUDA, "op_name": "MatMul"}},
        {"cat": "Node", "name": "nz_kernel_time", "args": {"provider": CPU, "op_name": "NonZero"}},
        {"cat": "Node", "name": "mm_kernel_time", "args": {"provider": CUDA, "op_name": "MatMul"}},  # a second run
        {"cat": "Node", "name": "_kernel_time", "args": {"provider": CUDA, "op_name": "Add", "node_index": "7"}},
    ]
    report = placement_from_events(events, CUDA)
    assert report.node_providers == {"mm": CUDA, "nz": CPU, "Add#7": CUDA}
    assert report.nodes_by_provider == {CUDA: 2, CPU: 1}
    assert report.fraction_on_target == pytest.approx(2 / 3)
    assert report.off_target_nodes() == {"nz": CPU}
    assert PlacementReport.from_dict(report.to_dict()) == report


def test_no_events_means_no_information():
    report = placement_from_events([{"cat": "Session", "name": "x", "args": {}}], CUDA)
    assert report.fraction_on_target is None and report.source == "unavailable"
    check_placement(report, [CUDA], 0.0)
    with pytest.raises(PlacementRefused, match="placement unknown"):
        check_placement(report, [CUDA], 0.5)


def test_a_provider_outside_the_allowed_ones_is_refused_with_the_nodes_named():
    with pytest.raises(PlacementRefused) as info:
        check_placement(split(cuda=8, cpu=2), [CUDA], 0.5)
    assert "host0 (NonZero on CPUExecutionProvider)" in str(info.value)
    assert "host1" in str(info.value) and "gpu0" not in str(info.value)
    assert info.value.code == "placement_refused"
    assert info.value.report.off_target_nodes() == {"host0": CPU, "host1": CPU}


def test_the_fraction_on_target_is_enforced():
    report = split(cuda=8, cpu=2)
    check_placement(report, [CUDA, CPU], 0.8)
    with pytest.raises(PlacementRefused, match="80.0% of the nodes ran on CUDAExecutionProvider, the route needs 90.0%"):
        check_placement(report, [CUDA, CPU], 0.9)
    check_placement(split(cuda=0, cpu=3), [CUDA, CPU], 0.0)


def test_a_long_list_of_nodes_is_cut():
    with pytest.raises(PlacementRefused, match="and 10 more"):
        check_placement(split(cuda=0, cpu=30), [CUDA], 0.0)
