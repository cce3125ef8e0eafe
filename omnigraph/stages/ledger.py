"""ResourceLedger: admission of stages against named capacities (RAM, VRAM per GPU, anything).

Capacities are pre-load ceilings; a stage's demands cover its load peak, weights, activations,
workspace and transport copies. A reservation charges every constraint it names at once or none
at all, so a plan that does not fit is refused before any worker starts. A worker whose death is
not yet verified keeps its charge *quarantined*: the memory may still be in use, so nothing else
may claim it until `release_quarantined` after the OS confirms the process is gone.

Nodes. On a Ray cluster every node is a machine of its own: a reservation made for a node charges
each `machine:` constraint it names against that node's copy of the capacity (`machine:ram@NODE`,
the amount the plan declares per machine), and every other constraint against the plan-wide one.
A local reservation (no node) charges the plain names, as on one machine.
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from omnigraph.pipelines.deploy import MACHINE_PREFIX
from omnigraph.stages.errors import CapacityConflict, ReservationRefused, StageError


class ReservationState(str, enum.Enum):
    HELD = "held"
    QUARANTINED = "quarantined"
    RELEASED = "released"


@dataclass(frozen=True)
class Reservation:
    """One owner's charge against the ledger (e.g. owner "stage0/replica1"), on `node` (a Ray
    node id) or on this machine (None)."""

    reservation_id: int
    owner: str
    demands: Mapping[str, int]
    node: str | None = None

    def charges(self) -> dict[str, int]:
        """The constraints charged and by how much (`machine:` ones scoped to the node)."""
        return {charged_name(name, self.node): amount for name, amount in self.demands.items()}


def charged_name(name: str, node: str | None) -> str:
    """The constraint a demand on `name` charges on `node`: `name@node` for a machine's own."""
    return f"{name}@{node}" if node is not None and name.startswith(MACHINE_PREFIX) else name


class ResourceLedger:
    """Thread-safe accounting of capacities and reservations keyed by constraint name."""

    def __init__(self, capacities: Mapping[str, int] | None = None) -> None:
        self._lock = threading.Lock()
        self._capacity: dict[str, int] = {}
        self._declared_by: dict[str, str] = {}
        self._states: dict[int, ReservationState] = {}
        self._reservations: dict[int, Reservation] = {}
        self._ids = itertools.count(1)
        if capacities:
            self.declare_capacities(capacities, declared_by="ledger")

    def declare_capacities(self, capacities: Mapping[str, int], *, declared_by: str) -> None:
        """Add capacities; a constraint declared twice must have the same amount both times."""
        with self._lock:
            for name, amount in capacities.items():
                _check_amount(name, amount, "capacity")
                known = self._capacity.get(name)
                if known is not None and known != amount:
                    raise CapacityConflict(
                        f"capacity of {name!r} is {known} per {self._declared_by[name]} "
                        f"but {amount} per {declared_by}"
                    )
            for name, amount in capacities.items():
                self._capacity.setdefault(name, amount)
                self._declared_by.setdefault(name, declared_by)

    def reserve(self, owner: str, demands: Mapping[str, int], *, node: str | None = None) -> Reservation:
        """Charge all of `demands` to `owner` (on `node`) or nothing (raises `ReservationRefused`)."""
        return self.reserve_all([(owner, demands)], nodes=[node])[0]

    def reserve_all(self, requests: Sequence[tuple[str, Mapping[str, int]]], *,
                    nodes: Sequence[str | None] | None = None) -> list[Reservation]:
        """Charge several owners at once, all or none: how a whole stage plan is admitted.
        `nodes[i]` is where request i runs (None or left out: this machine)."""
        placed = list(nodes) if nodes is not None else [None] * len(requests)
        if len(placed) != len(requests):
            raise ValueError(f"{len(requests)} requests but {len(placed)} nodes")
        with self._lock:
            totals: dict[str, int] = {}
            for (owner, demands), node in zip(requests, placed):
                for name, amount in demands.items():
                    _check_amount(name, amount, f"{owner} demand")
                    if name not in self._capacity:
                        raise ReservationRefused(owner, name, amount, 0, reason="no capacity is declared for it")
                    charged = charged_name(name, node)
                    totals[charged] = totals.get(charged, 0) + amount
                    free = self._free_locked(charged)
                    if totals[charged] > free:
                        owners = [o for (o, d), n in zip(requests, placed)
                                  if d.get(name) and charged_name(name, n) == charged]
                        who = owner if len(owners) == 1 else " + ".join(owners)
                        raise ReservationRefused(who, charged, totals[charged], free)
            made = []
            for (owner, demands), node in zip(requests, placed):
                reservation = Reservation(next(self._ids), owner, MappingProxyType(dict(demands)), node)
                self._reservations[reservation.reservation_id] = reservation
                self._states[reservation.reservation_id] = ReservationState.HELD
                made.append(reservation)
            return made

    def release(self, reservation: Reservation) -> None:
        """Return a held reservation; releasing an already released one does nothing."""
        with self._lock:
            state = self._state_locked(reservation)
            if state is ReservationState.QUARANTINED:
                raise StageError(
                    f"{reservation.owner}: reservation is quarantined; "
                    "release_quarantined() once the worker's exit is verified"
                )
            self._states[reservation.reservation_id] = ReservationState.RELEASED

    def quarantine(self, reservation: Reservation) -> None:
        """Keep a held reservation charged while its worker's death is unverified."""
        with self._lock:
            state = self._state_locked(reservation)
            if state is ReservationState.RELEASED:
                raise StageError(f"{reservation.owner}: cannot quarantine a released reservation")
            self._states[reservation.reservation_id] = ReservationState.QUARANTINED

    def release_quarantined(self, reservation: Reservation) -> None:
        """Return a quarantined reservation after its worker's exit was verified."""
        with self._lock:
            state = self._state_locked(reservation)
            if state is not ReservationState.QUARANTINED:
                raise StageError(f"{reservation.owner}: reservation is {state.value}, not quarantined")
            self._states[reservation.reservation_id] = ReservationState.RELEASED

    def state(self, reservation: Reservation) -> ReservationState:
        with self._lock:
            return self._state_locked(reservation)

    def free(self, constraint: str) -> int:
        with self._lock:
            return self._free_locked(constraint)

    def snapshot(self) -> dict[str, Any]:
        """Capacities, charges and live reservations, for reports and metrics."""
        with self._lock:
            constraints = {}
            for name in sorted(self._constraints_locked()):
                capacity = self._capacity[_base_name(name)]
                held = self._charged_locked(name, ReservationState.HELD)
                quarantined = self._charged_locked(name, ReservationState.QUARANTINED)
                constraints[name] = {"capacity": capacity, "held": held, "quarantined": quarantined,
                                     "free": capacity - held - quarantined}
            live = [
                {"reservation_id": r.reservation_id, "owner": r.owner,
                 "state": self._states[r.reservation_id].value, "demands": dict(r.demands),
                 **({"node": r.node} if r.node is not None else {})}
                for r in self._reservations.values()
                if self._states[r.reservation_id] is not ReservationState.RELEASED
            ]
            return {"constraints": constraints, "reservations": live}

    def _state_locked(self, reservation: Reservation) -> ReservationState:
        state = self._states.get(reservation.reservation_id)
        if state is None or self._reservations[reservation.reservation_id] is not reservation:
            raise StageError(f"{reservation.owner}: reservation {reservation.reservation_id} is not from this ledger")
        return state

    def _constraints_locked(self) -> set[str]:
        """Every declared constraint, and each node's copy of a machine's one that was charged."""
        return set(self._capacity) | {name for r in self._reservations.values() for name in r.charges()}

    def _charged_locked(self, name: str, state: ReservationState) -> int:
        return sum(r.charges().get(name, 0) for rid, r in self._reservations.items() if self._states[rid] is state)

    def _free_locked(self, name: str) -> int:
        if _base_name(name) not in self._capacity:
            return 0
        charged = sum(r.charges().get(name, 0) for rid, r in self._reservations.items()
                      if self._states[rid] is not ReservationState.RELEASED)
        return self._capacity[_base_name(name)] - charged


def _base_name(charged: str) -> str:
    """The declared constraint a charged name is a copy of (`machine:ram@NODE` -> `machine:ram`)."""
    return charged.partition("@")[0] if charged.startswith(MACHINE_PREFIX) else charged


def _check_amount(name: str, amount: int, what: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what}: constraint names must be non-empty strings, got {name!r}")
    if name.startswith(MACHINE_PREFIX) and "@" in name:
        raise ValueError(f"{what} {name!r}: '@' is reserved for a node's copy of a machine's constraint")
    if not isinstance(amount, int) or isinstance(amount, bool) or amount < 0:
        raise ValueError(f"{what} {name!r} must be a non-negative int, got {amount!r}")
