"""How a rollout decides and how long it waits: the settings the rollout and its decisions
share."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.tuner.judge.judgement import JudgeConfig
from kvpilot.tuner.problem.objective import Slo


@dataclass(frozen=True, slots=True)
class RolloutSettings:
    """How a rollout decides and how long it waits."""

    slo: Slo = field(default_factory=Slo)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    ready_timeout_s: float = 240.0
    bake: bool = True
    bake_tolerance_ratio: float = 0.2
    require_improvement: bool = True  # a pass must also beat the baseline's objective
    # With fewer windows than the judge's least a side, more goodput promotes only beyond
    # this share of the stable's: the same configuration measured twice differs by more
    # than a few percent.
    min_gain_ratio: float = 0.1
    # Windows observed a side (each side's the same, at the same time for a parallel
    # canary); from judge.windows.MIN_WINDOWS on, the window is the judge's unit of evidence
    # and a goodput gain must stand out from the windows' own spread. Live traffic observes
    # one analysis of many intervals instead.
    windows: int = 1

    def __post_init__(self) -> None:
        if self.windows < 1:
            raise ValueError(f"a rollout observes at least one window, not {self.windows}")
