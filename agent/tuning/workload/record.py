"""The workload the last tuning run replayed, kept in the state database so that `kvpilot
tune report` can draw what the trials were measured under."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.agent.state.store import StateStore
from kvpilot.agent.tuning.workload.as_json import ShapeJsonError, shape_from_json, shape_json
from kvpilot.agent.tuning.workload.choice import WorkloadChoice
from kvpilot.tuner.load.learned import WorkloadShape

WORKLOAD_FACT = "tuning.workload"


@dataclass(frozen=True, slots=True)
class ReplayedWorkload:
    """Where the last run's workload came from and why; its shape when it was learned."""

    source: str
    reason: str
    shape: WorkloadShape | None
    wall_s: float | None


def remember_workload(store: StateStore, choice: WorkloadChoice, wall_s: float) -> None:
    """Noted as a run starts (a run killed half-way was measured under it too)."""
    shape = shape_json(choice.shape) if choice.source == "learned" and choice.shape else None
    fact = {"source": choice.source, "reason": choice.reason, "shape": shape, "wall_s": wall_s}
    store.set_fact(WORKLOAD_FACT, fact, wall_s)


def last_workload(store: StateStore) -> ReplayedWorkload | None:
    """The last run's workload; None when no run noted one. A damaged record keeps what it
    can and says what it lost in the reason."""
    fact = store.get_fact(WORKLOAD_FACT)
    if not isinstance(fact, dict):
        return None
    source, reason = str(fact.get("source", "unknown")), str(fact.get("reason", ""))
    wall = fact.get("wall_s")
    shape = None
    if fact.get("shape") is not None:
        try:
            shape = shape_from_json({"learned": fact["shape"]})
        except ShapeJsonError as exc:
            reason = f"{reason} (its recorded shape cannot be read: {exc})"
    return ReplayedWorkload(
        source, reason, shape, float(wall) if isinstance(wall, int | float) else None
    )
