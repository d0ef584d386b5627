"""The rollout's two decisions: promote after the judge, revert after the bake."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpilot.tuner.judge import Judgement
from kvpilot.tuner.objective import TrialResult, better

if TYPE_CHECKING:
    from kvpilot.tuner.rollout import RolloutSettings


def promotion_decision(
    result: TrialResult, baseline: TrialResult, judgement: Judgement, settings: RolloutSettings
) -> tuple[bool, str]:
    """Whether to promote, and why: a judge's pass, feasible, and better than the baseline
    by more than noise (`improvement`)."""
    if not judgement.promote:
        return False, f"judged {judgement.classification.value}: {judgement.reason}"
    if not result.feasible:
        return False, f"judged pass but infeasible: {result.reason}"
    if settings.require_improvement:
        gain = improvement(result, baseline, settings)
        if gain is None:
            return False, "judged pass but its objective does not beat the stable instance's"
        return True, f"judged pass ({judgement.reason}) and better than the stable instance: {gain}"
    return True, f"judged pass ({judgement.reason}) and better than the stable instance"


def improvement(
    result: TrialResult, baseline: TrialResult, settings: RolloutSettings
) -> str | None:
    """How the candidate beats the stable instance by more than one window's noise, in words,
    or None. Feasible against infeasible is a gain; so is less memory at a goodput no more
    than the SLO's `memory_tie_ratio` below the stable's (the judge has shown it is not
    worse); more goodput alone counts only beyond `min_gain_ratio`: one window a side cannot
    tell a smaller gain from noise (one configuration measured twice differs by tens of
    percent)."""
    if not better(result, baseline, settings.slo):
        return None
    if not baseline.feasible:
        return "feasible where the stable instance is not"
    got, had = result.goodput_tokens_per_s, baseline.goodput_tokens_per_s
    if got is None or had is None or had <= 0:
        return "goodput where the stable instance had none"
    gain = got / had - 1
    tie, least = settings.slo.memory_tie_ratio, settings.min_gain_ratio
    mem, base_mem = result.memory_bytes, baseline.memory_bytes
    if mem is not None and base_mem is not None and mem < base_mem and gain >= -tie:
        return f"{1 - mem / base_mem:.0%} less memory at goodput {gain:+.0%}"
    if gain > least:
        return f"goodput {gain:+.0%}, beyond the {least:.0%} one window a side tells from noise"
    return None


def bake_degradation(
    promised: TrialResult | None, baked: TrialResult, tolerance_ratio: float
) -> str | None:
    """Why the bake window says the promoted flags degraded, or None when they held."""
    if not baked.feasible:
        return f"the promoted flags are infeasible under load: {baked.reason}"
    if promised is None or promised.goodput_tokens_per_s is None:
        return None
    floor = (1 - tolerance_ratio) * promised.goodput_tokens_per_s
    got = baked.goodput_tokens_per_s
    if got is None or got < floor:
        shown = "unknown" if got is None else f"{got:.1f}"
        return (
            f"goodput {shown} tok/s below {floor:.1f} ({1 - tolerance_ratio:.0%} of the canary's)"
        )
    return None
