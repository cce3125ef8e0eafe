"""The engine's typed counters (stages/metrics.py): what `/metrics` reads instead of the execution plan."""

import dataclasses
import math

import numpy as np
import pytest

from omnigraph import Omni
from omnigraph.plugin.api.metrics import EngineReadings, ServerMetrics
from omnigraph.stages.metrics import EngineMetrics, LedgerConstraintMetrics, ReplicaMetrics


def test_the_typed_snapshot_counts_what_the_execution_plan_describes(make_plan, os_processes):
    plan = make_plan("affine", "rename", replicas=2, capacity=1000, demand=100)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with Omni(deploy_config=plan) as omni:
        omni.generate([{"tensors": {"x": x}}, {"tensors": {"x": x + 1}}])
        metrics = omni.metrics()
        described = omni.execution_plan

    assert isinstance(metrics, EngineMetrics)
    with pytest.raises(dataclasses.FrozenInstanceError):
        metrics.stages[0].state = "failed"
    first, second = metrics.stages
    assert [first.stage_id, second.stage_id] == [0, 1]
    assert (first.execution_type, first.state, first.state_reason) == ("graph", "ok", None)
    assert (first.num_replicas, first.live_replicas, first.restarts, first.fenced_calls) == (2, 2, 0, 0)
    assert first.items == 2 and first.calls == first.batching.calls  # both requests passed stage 0
    assert all(isinstance(replica, ReplicaMetrics) and replica.state == "serving" for replica in first.replicas)
    for stage, plan_stage in zip(metrics.stages, described["stages"]):  # the same facts, read without describe()
        assert [(r.replica, r.generation, r.calls, r.items) for r in stage.replicas] == [
            (r["replica"], r["generation"], r["calls"], r["items"]) for r in plan_stage["replicas"]]
        assert stage.batching.calls == plan_stage["batching"]["stats"]["calls"]
        assert stage.batching.batch_requests.count == stage.batching.calls
        assert stage.batching.batch_rows.bounds[-1] == math.inf
    assert metrics.ledger.constraints == (LedgerConstraintMetrics("machine:ram", 1000, 400, 0, 600),)
    assert metrics.ledger.reservations == 4
    assert set(metrics.batching()) == {0, 1}

    # /metrics renders these fields (the service hands over the same records)
    readings = EngineReadings(engine=lambda: metrics, stage_names=lambda: {0: "affine", 1: "rename"})
    text = ServerMetrics("tensors", readings).render().decode()
    for line in ('omnigraph_ledger_capacity{model_name="tensors",resource="machine:ram"} 1000.0',
                 'omnigraph_ledger_reserved{model_name="tensors",resource="machine:ram",state="held"} 400.0',
                 'omnigraph_ledger_reserved{model_name="tensors",resource="machine:ram",state="quarantined"} 0.0',
                 'omnigraph_ledger_reservations{model_name="tensors"} 4.0',
                 f'omnigraph_batch_requests_count{{model_name="tensors",stage="rename"}} '
                 f'{float(second.batching.calls)}',
                 'omnigraph_batch_rows_bucket{le="+Inf",model_name="tensors",stage="affine"}',
                 'omnigraph_stage_live_replicas{model_name="tensors",stage="affine"} 2.0',
                 'omnigraph_worker_deaths_total{model_name="tensors",stage="affine"} 0.0',
                 'omnigraph_replica_calls_total{model_name="tensors",replica="1",stage="rename"}'):
        assert line in text
    assert os_processes.children() == set()
