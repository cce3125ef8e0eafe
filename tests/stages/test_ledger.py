"""ResourceLedger: atomic multi-constraint charges, quarantine, snapshots."""

import threading

import pytest

from omnigraph.stages.errors import CapacityConflict, ReservationRefused, StageError
from omnigraph.stages.ledger import ReservationState, ResourceLedger

GiB = 1 << 30


def make_ledger() -> ResourceLedger:
    return ResourceLedger({"machine:ram": 8 * GiB, "machine:vram:0": 16 * GiB})


def test_reservation_charges_every_constraint_or_none():
    ledger = make_ledger()
    ledger.reserve("stage0", {"machine:ram": 6 * GiB, "machine:vram:0": 4 * GiB})
    with pytest.raises(ReservationRefused) as refused:
        ledger.reserve("stage1", {"machine:vram:0": 4 * GiB, "machine:ram": 3 * GiB})
    assert refused.value.constraint == "machine:ram"
    assert refused.value.demand == 3 * GiB and refused.value.free == 2 * GiB
    assert "machine:ram" in str(refused.value) and "stage1" in str(refused.value)
    # the VRAM part of the refused reservation was not charged either
    assert ledger.free("machine:vram:0") == 12 * GiB


def test_reserve_all_admits_a_plan_as_one():
    ledger = make_ledger()
    with pytest.raises(ReservationRefused) as refused:
        ledger.reserve_all([("stage0", {"machine:ram": 5 * GiB}), ("stage1", {"machine:ram": 5 * GiB})])
    assert refused.value.demand == 10 * GiB and refused.value.owner == "stage0 + stage1"
    assert ledger.snapshot()["reservations"] == []
    made = ledger.reserve_all([("stage0", {"machine:ram": 4 * GiB}), ("stage1", {"machine:ram": 4 * GiB})])
    assert [r.owner for r in made] == ["stage0", "stage1"]
    assert ledger.free("machine:ram") == 0


def test_on_a_cluster_each_node_holds_a_machine_s_capacity_and_the_rest_is_plan_wide():
    ledger = ResourceLedger({"machine:ram": 8 * GiB, "licenses": 3})
    a = ledger.reserve("stage0/replica0", {"machine:ram": 6 * GiB, "licenses": 1}, node="node-a")
    b = ledger.reserve("stage0/replica1", {"machine:ram": 6 * GiB, "licenses": 1}, node="node-b")
    assert (a.node, b.node) == ("node-a", "node-b") and a.charges() == {"machine:ram@node-a": 6 * GiB,
                                                                           "licenses": 1}
    with pytest.raises(ReservationRefused) as refused:  # node-a has 2 GiB left, whatever node-b has
        ledger.reserve_all([("stage1/replica0", {"machine:ram": 1 * GiB}),
                            ("stage1/replica1", {"machine:ram": 3 * GiB})], nodes=["node-b", "node-a"])
    assert (refused.value.owner, refused.value.constraint, refused.value.demand, refused.value.free) == (
        "stage1/replica1", "machine:ram@node-a", 3 * GiB, 2 * GiB)
    assert ledger.free("machine:ram@node-b") == 2 * GiB and ledger.free("machine:ram") == 8 * GiB
    with pytest.raises(ReservationRefused, match="licenses"):  # plan-wide: 2 of 3 held across both nodes
        ledger.reserve("stage1/replica0", {"licenses": 2}, node="node-c")
    constraints = ledger.snapshot()["constraints"]
    assert constraints["machine:ram@node-a"] == {"capacity": 8 * GiB, "held": 6 * GiB, "quarantined": 0,
                                                 "free": 2 * GiB}
    assert constraints["licenses"]["held"] == 2 and constraints["machine:ram"]["held"] == 0
    assert [r["node"] for r in ledger.snapshot()["reservations"]] == ["node-a", "node-b"]
    with pytest.raises(ValueError, match="'@' is reserved"):
        ledger.reserve("stage2", {"machine:ram@node-a": 1})


def test_unknown_constraint_and_bad_amounts_are_refused():
    ledger = make_ledger()
    with pytest.raises(ReservationRefused, match="no capacity is declared"):
        ledger.reserve("stage0", {"machine:vram:1": 1})
    with pytest.raises(ValueError, match="non-negative int"):
        ledger.reserve("stage0", {"machine:ram": -1})
    assert ledger.snapshot()["reservations"] == []


def test_capacities_must_agree():
    ledger = make_ledger()
    ledger.declare_capacities({"machine:ram": 8 * GiB, "disk": 10}, declared_by="stage1")
    with pytest.raises(CapacityConflict, match="machine:ram"):
        ledger.declare_capacities({"machine:ram": 4 * GiB}, declared_by="stage2")


def test_quarantine_keeps_the_charge_until_verified():
    ledger = make_ledger()
    reservation = ledger.reserve("stage0/replica0", {"machine:ram": 8 * GiB})
    ledger.quarantine(reservation)
    with pytest.raises(StageError, match="quarantined"):
        ledger.release(reservation)
    with pytest.raises(ReservationRefused):
        ledger.reserve("stage0/replica1", {"machine:ram": 1})
    snap = ledger.snapshot()
    assert snap["constraints"]["machine:ram"] == {"capacity": 8 * GiB, "held": 0, "quarantined": 8 * GiB, "free": 0}
    assert snap["reservations"][0]["state"] == "quarantined"
    ledger.release_quarantined(reservation)
    assert ledger.state(reservation) is ReservationState.RELEASED
    assert ledger.free("machine:ram") == 8 * GiB
    assert ledger.snapshot()["reservations"] == []
    with pytest.raises(StageError, match="not quarantined"):
        ledger.release_quarantined(reservation)


def test_release_is_idempotent_and_snapshot_reports_held():
    ledger = make_ledger()
    reservation = ledger.reserve("stage0", {"machine:ram": GiB})
    assert ledger.snapshot()["constraints"]["machine:ram"]["held"] == GiB
    ledger.release(reservation)
    ledger.release(reservation)
    assert ledger.snapshot()["constraints"]["machine:ram"]["free"] == 8 * GiB


def test_concurrent_reservations_never_overcommit():
    ledger = ResourceLedger({"slots": 100})
    granted = []

    def grab():
        for _ in range(50):
            try:
                granted.append(ledger.reserve("t", {"slots": 1}))
            except ReservationRefused:
                pass

    threads = [threading.Thread(target=grab) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(granted) == 100
    assert ledger.free("slots") == 0
