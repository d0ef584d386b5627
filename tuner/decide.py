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
    """Whether to promote, and why: a judge's pass, feasible, and better than the baseline."""
    if not judgement.promote:
        return False, f"judged {judgement.classification.value}: {judgement.reason}"
    if not result.feasible:
        return False, f"judged pass but infeasible: {result.reason}"
    if settings.require_improvement and not better(result, baseline, settings.slo):
        return False, "judged pass but its objective does not beat the stable instance's"
    return True, f"judged pass ({judgement.reason}) and better than the stable instance"


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
