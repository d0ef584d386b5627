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
    # Sequential: the stable flags restarted back, then observed again after the candidate.
    RETURNING = "returning"
    OBSERVING_BASELINE_AFTER = "observing_baseline_after"
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
# A person's release of a held canary starts one of these (`Release`).
_LEAVES_HOLD = frozenset({Phase.PROMOTING, Phase.ROLLING_BACK})
# Phases in which the stable instance may be serving flags other than its old ones.
STABLE_TOUCHED = {
    Strategy.PARALLEL: frozenset({Phase.PROMOTING, Phase.BAKING, Phase.REVERTING}),
    Strategy.SEQUENTIAL: frozenset(
        {
            Phase.STARTING,
            Phase.WARMING,
            Phase.OBSERVING,
            Phase.RETURNING,  # the restart back may not have happened
            Phase.JUDGING,
            Phase.PROMOTING,
            Phase.BAKING,
            Phase.REVERTING,
            Phase.ROLLING_BACK,
        }
    ),
}


class Release(StrEnum):
    """A person's answer to a held canary (Argo Rollouts' `promote` and `abort`)."""

    PROMOTE = "promote"
    ROLLBACK = "rollback"

    @property
    def words(self) -> str:
        """How the record's reason says it (and how a repeat of it is recognised)."""
        return "released for promotion" if self is Release.PROMOTE else "released for rollback"


class NotHeld(RuntimeError):
    """Only a held rollout can be released; the message says where this one is."""

    def __init__(self, record: RolloutRecord) -> None:
        super().__init__(
            f"trial {record.trial_id} is {record.phase.value}, not held"
            + (f" ({record.reason})" if record.reason else "")
        )
        self.record = record


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
        """The record in a new phase; a final phase cannot be left, but for a hold's release
        (a hold is final to recovery and to the run, which leave its canary running)."""
        released = self.phase is Phase.HELD and phase in _LEAVES_HOLD
        if self.phase.final and not released:
            raise ValueError(f"rollout {self.trial_id}: {self.phase} is final")
        return dataclasses.replace(
            self, phase=phase, updated_wall_s=at_wall_s, reason=reason or self.reason, **changes
        )

    def released_as(self) -> Release | None:
        """The release this record's rollout came from, as its reason says (None: none)."""
        return next((r for r in Release if f"{r.words} by " in (self.reason or "")), None)
