"""A rollout's vocabulary: its strategies, its phases, and the record the journal keeps of
where one rollout got to (`tuner.rollout.canary` runs them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Strategy(StrEnum):
    PARALLEL = "parallel"
    SEQUENTIAL = "sequential"


class Phase(StrEnum):
    PLANNED = "planned"
    OBSERVING_BASELINE = "observing_baseline"
    STARTING = "starting"
    WARMING = "warming"
    OBSERVING = "observing"
    JUDGING = "judging"
    PROMOTING = "promoting"
    BAKING = "baking"
    REVERTING = "reverting"
    ROLLING_BACK = "rolling_back"
    PROMOTED = "promoted"
    HELD = "held"  # inconclusive: the canary left running for a person's review
    ROLLED_BACK = "rolled_back"
    REVERTED = "reverted"
    INFEASIBLE = "infeasible"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def final(self) -> bool:
        return self in _FINAL


_FINAL = frozenset(
    {
        Phase.PROMOTED,
        Phase.HELD,
        Phase.ROLLED_BACK,
        Phase.REVERTED,
        Phase.INFEASIBLE,
        Phase.FAILED,
        Phase.ABORTED,
    }
)
# Phases in which the stable instance may be serving flags other than its old ones.
STABLE_TOUCHED = {
    Strategy.PARALLEL: frozenset({Phase.PROMOTING, Phase.BAKING, Phase.REVERTING}),
    Strategy.SEQUENTIAL: frozenset(
        {
            Phase.STARTING,
            Phase.WARMING,
            Phase.OBSERVING,
            Phase.JUDGING,
            Phase.PROMOTING,
            Phase.BAKING,
            Phase.REVERTING,
            Phase.ROLLING_BACK,
        }
    ),
}


@dataclass(frozen=True, slots=True)
class RolloutRecord:
    """Where one trial's rollout got to, and the flags needed to undo it."""

    trial_id: str
    strategy: Strategy
    phase: Phase
    stable_argv: tuple[str, ...]  # the stable instance's flags before the trial
    candidate_argv: tuple[str, ...]
    updated_wall_s: float
    reason: str | None = None
    baseline_goodput_tokens_per_s: float | None = None
    bake_goodput_tokens_per_s: float | None = None

    def at(
        self, phase: Phase, *, at_wall_s: float, reason: str | None = None, **changes: Any
    ) -> RolloutRecord:
        """The record in a new phase; a final phase cannot be left."""
        if self.phase.final:
            raise ValueError(f"rollout {self.trial_id}: {self.phase} is final")
        return dataclasses.replace(
            self, phase=phase, updated_wall_s=at_wall_s, reason=reason or self.reason, **changes
        )
