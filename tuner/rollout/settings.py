"""How a rollout decides and how long it waits: the settings the rollout and its decisions
share."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.tuner.judge.judgement import JudgeConfig
from kvpilot.tuner.judge.sequential import DEFAULT_WINDOWS, LookPlan, Spending, looks_for
from kvpilot.tuner.problem.objective import Slo


@dataclass(frozen=True, slots=True)
class RolloutSettings:
    """How a rollout decides and how long it waits. The defaults: up to 64 windows a side
    judged at looks of 8/16/32/64, a half-point error margin (with zero errors on both sides
    it needs about 550 requests a side), a bake of 8 windows, a saving of at least 5 % and
    64 MiB, at most 10 % lost against the deployed configuration."""

    slo: Slo = field(default_factory=Slo)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    ready_timeout_s: float = 240.0
    bake: bool = True
    # The bake: this many windows of the promoted flags, judged by the same tests against the
    # old stable's windows; it reverts when they are shown worse (or infeasible).
    bake_windows: int = 8
    # A bake of one analysis (live traffic's handover): the share of the canary's goodput
    # the promoted flags may lose.
    bake_tolerance_ratio: float = 0.2
    require_improvement: bool = True  # a pass must also beat the baseline's objective
    # With fewer windows than the judge's least a side, more goodput promotes only beyond
    # this share of the stable's: the same configuration measured twice differs by more
    # than a few percent.
    min_gain_ratio: float = 0.1
    # The most windows observed a side (each side's the same, at the same time for a
    # parallel canary), judged at group-sequential looks (`judge.sequential.looks_for`: 8,
    # 16, 32 and 64 by default, alpha spent by `spending`). An equal canary passes by 32
    # windows of 64 requests at the earliest: with zero errors on both sides the half-point
    # error margin needs about 550 requests a side. Live traffic observes one analysis of
    # many intervals instead.
    windows: int = DEFAULT_WINDOWS
    spending: Spending = Spending.POCOCK
    # True: a canary still inconclusive at the last look is held (left running, the stable
    # untouched) for a person's review instead of rolled back.
    hold_inconclusive: bool = False
    # Less memory is a gain only from this much: a share of the stable's and a size.
    min_memory_saving_ratio: float = 0.05
    min_memory_saving_bytes: int = 64 << 20
    # No promotion may leave goodput more than this share below the configuration the
    # operator deployed (each promotion becomes the next baseline: small losses add up).
    max_cumulative_loss_ratio: float = 0.10
    # A window where a side finished more than this share of requests the load generator
    # did not send (users' traffic on the serving instance) is observed again, left out of
    # the judgement.
    max_foreign_share: float = 0.02
    # A sequential canary stops before the stable's windows after it only when shown worse
    # than the latencies' and goodput's margins widened by this factor (the drift one phase
    # may bring, which only the windows after it cancel): a clearly bad candidate.
    sequential_drift_ratio: float = 0.25

    def __post_init__(self) -> None:
        if self.windows < 1:
            raise ValueError(f"a rollout observes at least one window, not {self.windows}")
        if self.bake_windows < 1:
            raise ValueError(f"a bake observes at least one window, not {self.bake_windows}")
        if not 0 <= self.max_cumulative_loss_ratio < 1:
            raise ValueError("max_cumulative_loss_ratio must be in [0, 1)")
        if not 0 <= self.max_foreign_share < 1:
            raise ValueError("max_foreign_share must be in [0, 1)")
        if not self.sequential_drift_ratio >= 0:
            raise ValueError("sequential_drift_ratio must be at least 0")

    @property
    def look_plan(self) -> LookPlan:
        """The looks the windows are judged at."""
        return LookPlan(looks_for(self.windows), self.spending)
