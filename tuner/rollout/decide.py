"""The rollout's two decisions: promote after the judge, revert after the bake."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from kvpilot.tuner.judge import evidence
from kvpilot.tuner.judge.judgement import Judgement
from kvpilot.tuner.judge.windows import MIN_WINDOWS
from kvpilot.tuner.problem.objective import TrialResult, better
from kvpilot.tuner.rollout.settings import RolloutSettings


@dataclass(frozen=True, slots=True)
class WindowGoodputs:
    """Each window's goodput a side, in window order; `paired`: the windows ran at the same
    time on both sides (a parallel canary)."""

    canary: tuple[float | None, ...]
    baseline: tuple[float | None, ...]
    paired: bool


def typical(results: Sequence[TrialResult]) -> TrialResult:
    """One side's result over its windows: the first infeasible one (the SLO must hold in
    every window), else the window of median goodput."""
    infeasible = [r for r in results if not r.feasible]
    if infeasible:
        return infeasible[0]
    ranked = sorted(results, key=lambda r: r.goodput_tokens_per_s or 0.0)
    return ranked[(len(ranked) - 1) // 2]


def promotion_decision(
    result: TrialResult,
    baseline: TrialResult,
    judgement: Judgement,
    settings: RolloutSettings,
    windows: WindowGoodputs | None = None,
) -> tuple[bool, str]:
    """Whether to promote, and why: a judge's pass, feasible, and better than the baseline
    by more than noise (`improvement`)."""
    if not judgement.promote:
        return False, f"judged {judgement.classification.value}: {judgement.reason}"
    if not result.feasible:
        return False, f"judged pass but infeasible: {result.reason}"
    if settings.require_improvement:
        gain = improvement(result, baseline, settings, windows)
        if gain is None:
            return False, "judged pass but its objective does not beat the stable instance's"
        return True, f"judged pass ({judgement.reason}) and better than the stable instance: {gain}"
    return True, f"judged pass ({judgement.reason}) and better than the stable instance"


def improvement(
    result: TrialResult,
    baseline: TrialResult,
    settings: RolloutSettings,
    windows: WindowGoodputs | None = None,
) -> str | None:
    """How the candidate beats the stable instance by more than noise, in words, or None.
    Feasible against infeasible is a gain; so is less memory at a goodput no more than the
    SLO's `memory_tie_ratio` below the stable's (the judge has shown it is not worse). More
    goodput alone counts when it stands out from the windows' own spread (`windows_gain`,
    from `MIN_WINDOWS` windows a side), or, with fewer, beyond `min_gain_ratio`: one window
    a side cannot tell a smaller gain from noise (one configuration measured twice differs
    by tens of percent)."""
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
    if windows is not None and len(windows.canary) >= MIN_WINDOWS:
        return windows_gain(windows, settings.judge.alpha)
    if gain > least:
        return f"goodput {gain:+.0%}, beyond the {least:.0%} one window a side tells from noise"
    return None


def windows_gain(windows: WindowGoodputs, alpha: float) -> str | None:
    """The goodput gain over the windows when it stands out from their spread at `alpha`:
    paired windows by the signed-rank test of their log ratios, others by Mann-Whitney U."""
    canary = [g for g in windows.canary if g is not None and g > 0]
    baseline = [g for g in windows.baseline if g is not None and g > 0]
    if len(canary) != len(windows.canary) or len(baseline) != len(windows.baseline):
        return None  # a window without goodput: no gain can be shown
    if windows.paired:
        logs = [math.log(c / b) for c, b in zip(canary, baseline, strict=True)]
        p = evidence.signed_rank_p(logs, "greater")
        gain = math.exp(statistics.median(logs)) - 1
        how = f"median of {len(logs)} paired windows"
    else:
        p = evidence.shift_harm_p(canary, baseline)
        gain = statistics.median(canary) / statistics.median(baseline) - 1
        how = f"medians of {len(canary)} and {len(baseline)} windows"
    if p >= alpha or gain <= 0:
        return None
    return f"goodput {gain:+.0%} ({how}, p={p:.2g}), beyond the windows' own spread"


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
