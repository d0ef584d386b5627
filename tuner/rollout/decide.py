"""The rollout's two decisions: promote after the judge, revert after the bake.

Side doors closed: a side's feasibility comes from its windows pooled (a lower confidence
bound on attainment), not its first infeasible window; "feasible where the stable is not"
promotes only when that difference is itself significant; less memory counts only from a
minimum saving; no promotion may lose more than a cap against the deployed configuration."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from kvpilot.tuner.judge import evidence
from kvpilot.tuner.judge.evidence import Counts
from kvpilot.tuner.judge.judgement import Judgement
from kvpilot.tuner.judge.windows import MIN_WINDOWS
from kvpilot.tuner.problem.objective import Slo, TrialOutcome, TrialResult, WindowMetrics, better
from kvpilot.tuner.rollout.settings import RolloutSettings


@dataclass(frozen=True, slots=True)
class WindowGoodputs:
    """Each window's goodput a side, in window order; `paired`: the windows ran at the same
    time on both sides (a parallel canary)."""

    canary: tuple[float | None, ...]
    baseline: tuple[float | None, ...]
    paired: bool


def pooled(results: Sequence[TrialResult], slo: Slo, alpha: float) -> TrialResult:
    """One side's result over its windows, from the windows pooled: feasible only when the
    lower (1 - alpha) bound of the attaining share of all its requests (Wilson's, over the
    windows' over-dispersion) reaches the SLO's target, no more than `max_failed_ratio` of
    them failed and the preemptions per finished request stay within the limit; goodput is
    the median window's. One transient error in one window no longer decides a side. Where
    a window gives no per-request attainment (histograms), the first infeasible window."""
    metrics = [r.metrics for r in results]
    usable = [m for m in metrics if m is not None and m.attaining_requests is not None]
    median = _median_goodput(results)
    if len(usable) != len(results) or any(not _measured(r) for r in results):
        infeasible = [r for r in results if not r.feasible]
        return infeasible[0] if infeasible else median
    total = sum(m.requests_total for m in usable)
    attaining = sum(m.attaining_requests or 0 for m in usable)
    failed = sum(m.requests_failed for m in usable)
    if total == 0:
        return TrialResult(TrialOutcome.NO_DATA, None, median.memory_bytes, "no requests")
    phi = evidence.dispersion(
        [float(m.requests_total - (m.attaining_requests or 0)) for m in usable],
        [float(m.requests_total) for m in usable],
        binomial=True,
    )
    n = max(1, round(total / phi))
    lower, _ = evidence.wilson_interval(round(attaining / phi), n, _z(alpha))
    memory, goodput = median.memory_bytes, median.goodput_tokens_per_s
    windows = f"over {len(usable)} windows"
    together = _together(usable, median.metrics)
    if failed / total > slo.max_failed_ratio:
        why = f"{failed} of {total} requests failed {windows}"
        return TrialResult(TrialOutcome.REQUESTS_FAILED, goodput, memory, why, together)
    per_request = together.preemptions_per_request
    if per_request is not None and per_request > slo.max_preemptions_per_request:
        why = f"{per_request:.3g} preemptions per request {windows}"
        return TrialResult(TrialOutcome.PREEMPTED, goodput, memory, why, together)
    if lower < slo.attainment_target_ratio:
        why = (
            f"{attaining} of {total} requests attained the SLO {windows}: the lower bound "
            f"{lower:.3f} is below the target {slo.attainment_target_ratio:g}"
        )
        return TrialResult(TrialOutcome.SLO_BROKEN, goodput, memory, why, together)
    return TrialResult(TrialOutcome.FEASIBLE, goodput, memory, None, together)


def _together(windows: Sequence[WindowMetrics], median: WindowMetrics | None) -> WindowMetrics:
    """The windows' counts summed; their latencies the median window's."""
    total = sum(m.requests_total for m in windows)
    attaining = sum(m.attaining_requests or 0 for m in windows)
    failed = sum(m.requests_failed for m in windows)
    preempted = [m.preemptions_total for m in windows]
    known = None if any(p is None for p in preempted) else sum(p or 0.0 for p in preempted)
    return WindowMetrics(
        source=windows[0].source,
        duration_s=sum(m.duration_s for m in windows),
        requests_total=total,
        requests_failed=failed,
        attaining_requests=attaining,
        attainment_ratio=attaining / total if total else None,
        ttft_p95_s=median.ttft_p95_s if median else None,
        inter_token_p95_s=median.inter_token_p95_s if median else None,
        output_tokens_per_s=median.output_tokens_per_s if median else None,
        preemptions_total=known,
        preemptions_per_request=known / max(1, total - failed) if known is not None else None,
    )


def _measured(result: TrialResult) -> bool:
    return result.outcome not in (
        TrialOutcome.CRASHED,
        TrialOutcome.FAILED_TO_START,
        TrialOutcome.NO_DATA,
    )


def _median_goodput(results: Sequence[TrialResult]) -> TrialResult:
    ranked = sorted(results, key=lambda r: r.goodput_tokens_per_s or 0.0)
    return ranked[(len(ranked) - 1) // 2]


def _z(alpha: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(1 - alpha))


def promotion_decision(
    result: TrialResult,
    baseline: TrialResult,
    judgement: Judgement,
    settings: RolloutSettings,
    windows: WindowGoodputs | None = None,
    deployed: TrialResult | None = None,
) -> tuple[bool, str]:
    """Whether to promote, and why: a judge's pass, feasible, no more than
    `max_cumulative_loss_ratio` below the goodput of the configuration the operator deployed
    (`deployed`; each promotion becomes the next baseline, so small losses would add up),
    and better than the baseline by more than noise (`improvement`)."""
    if not judgement.promote:
        return False, f"judged {judgement.classification.value}: {judgement.reason}"
    if not result.feasible:
        return False, f"judged pass but infeasible: {result.reason}"
    loss = cumulative_loss(result, deployed, settings.max_cumulative_loss_ratio)
    if loss is not None:
        return False, f"judged pass but refused: {loss}"
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
        shown = significantly_more_feasible(result, baseline, settings.judge.alpha)
        if shown is not None:
            return f"feasible where the stable instance is not ({shown})"
        # Not shown: the stable's infeasibility may be one transient error; judge as equals.
    got, had = result.goodput_tokens_per_s, baseline.goodput_tokens_per_s
    if got is None or had is None or had <= 0:
        return None
    gain = got / had - 1
    tie, least = settings.slo.memory_tie_ratio, settings.min_gain_ratio
    mem, base_mem = result.memory_bytes, baseline.memory_bytes
    if mem is not None and base_mem is not None and gain >= -tie:
        if memory_saving(mem, base_mem, settings):
            return f"{1 - mem / base_mem:.0%} less memory at goodput {gain:+.0%}"
        if mem < base_mem:
            return None  # a saving below the minimum is no gain, and not a goodput gain
    if windows is not None and len(windows.canary) >= MIN_WINDOWS:
        return windows_gain(windows, settings.judge.alpha)
    if gain > least:
        return f"goodput {gain:+.0%}, beyond the {least:.0%} one window a side tells from noise"
    return None


def memory_saving(memory: int, baseline: int, settings: RolloutSettings) -> bool:
    """Whether `memory` saves at least `min_memory_saving_ratio` of the stable's and at
    least `min_memory_saving_bytes`: a few MiB less is noise to the neighbours on a device."""
    saved = baseline - memory
    return (
        saved > 0
        and saved >= settings.min_memory_saving_ratio * baseline
        and saved >= settings.min_memory_saving_bytes
    )


def cumulative_loss(
    result: TrialResult, deployed: TrialResult | None, cap_ratio: float
) -> str | None:
    """Why `result` loses too much goodput against the configuration the operator deployed,
    or None (also when either goodput is unknown)."""
    if deployed is None or deployed.goodput_tokens_per_s is None:
        return None
    had, got = deployed.goodput_tokens_per_s, result.goodput_tokens_per_s
    if had <= 0 or got is None or got >= (1 - cap_ratio) * had:
        return None
    return (
        f"goodput {got:.1f} tok/s is {1 - got / had:.0%} below the deployed configuration's "
        f"{had:.1f} (at most {cap_ratio:.0%} may be lost over all promotions)"
    )


def significantly_more_feasible(
    result: TrialResult, baseline: TrialResult, alpha: float
) -> str | None:
    """The evidence, in words, that the candidate meets the SLO where the stable instance does
    not, or None: more of its requests attained the SLO (Fisher's exact test, one-sided at
    `alpha`), or fewer preemptions per finished request (the conditional binomial test)."""
    c, b = result.metrics, baseline.metrics
    if c is None or b is None or c.requests_total == 0 or b.requests_total == 0:
        return None
    if baseline.outcome is TrialOutcome.PREEMPTED:
        if c.preemptions_total is None or b.preemptions_total is None:
            return None
        canary = Counts(b.preemptions_total, float(max(1, b.requests_total - b.requests_failed)))
        stable = Counts(c.preemptions_total, float(max(1, c.requests_total - c.requests_failed)))
        p = evidence.rate_harm_p(canary, stable)  # the stable's rate is the larger
        return f"fewer preemptions per request, p={p:.2g}" if p < alpha else None
    if c.attaining_requests is None or b.attaining_requests is None:
        return None
    missed_b = Counts(float(b.requests_total - b.attaining_requests), float(b.requests_total))
    missed_c = Counts(float(c.requests_total - c.attaining_requests), float(c.requests_total))
    p = evidence.proportion_harm_p(missed_b, missed_c)
    return f"more requests within the SLO, p={p:.2g}" if p < alpha else None


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
