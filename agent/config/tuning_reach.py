"""The `tuning:` section's word before the night: settings under which even a canary equal
to the stable cannot pass (`tuner.rollout.reachable`), said by `kvpilot config check` and at
every load, so that a scheduled run is not first refused at 3 a.m.

It judges the configured workload (a learned or trace workload may send more or fewer
requests a window: the run checks its own study again before it starts) and the configured
strategy. The shipped defaults are reachable (an equal canary passes by 32 windows), so a
section that leaves the judged settings as they are costs nothing here."""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.agent.config.tuning import CanaryConfig, TuningConfig
from kvpilot.tuner.judge.judgement import (
    DEFAULT_METRICS,
    LATENCY_METRICS,
    LIVE_METRICS,
    JudgeConfig,
    MetricSpec,
    with_margin_ratios,
    with_margins,
)
from kvpilot.tuner.problem.objective import Slo
from kvpilot.tuner.rollout.reachable import Reachability, live_reachability, reachability
from kvpilot.tuner.rollout.record import Strategy
from kvpilot.tuner.rollout.settings import RolloutSettings


def judged_metrics(tuning: TuningConfig, metrics: Sequence[MetricSpec]) -> tuple[MetricSpec, ...]:
    """The judge's `metrics` (replay's or live's) with the margins the section sets: the
    errors', the preemptions' where set (unset keeps the judge's own, which replay and live
    traffic differ in), and the latencies' ratio. The study's rollouts are judged so."""
    counts = {"errors_ratio": tuning.error_margin_ratio}
    if tuning.preemption_margin_per_request is not None:
        counts["preemptions_per_request"] = tuning.preemption_margin_per_request
    return with_margin_ratios(
        with_margins(metrics, **counts),
        **dict.fromkeys(LATENCY_METRICS, tuning.latency_margin_ratio),
    )


def unreachable_tuning(tuning: TuningConfig) -> str | None:
    """Why the section's settings cannot pass an equal canary, or None when they can."""
    if _judged(tuning) == _judged(TuningConfig()):
        return None  # the defaults are reachable (tests/agent/config/test_tuning_reach.py)
    found = tuning_reachability(tuning)
    return None if found.passes else f"tuning: {found.reason}"


def tuning_reachability(tuning: TuningConfig) -> Reachability:
    """Whether an equal canary can pass under the section's settings."""
    canary = tuning.canary
    replay = canary.traffic == "replay"
    metrics = judged_metrics(tuning, DEFAULT_METRICS if replay else LIVE_METRICS)
    settings = RolloutSettings(
        slo=Slo(ttft_p95_s=tuning.slo.ttft_p95_s, inter_token_p95_s=tuning.slo.inter_token_p95_s),
        judge=JudgeConfig(metrics),
        windows=tuning.windows if replay else 1,
    )
    return traffic_reachability(
        settings,
        canary,
        requests_per_window=tuning.workload.requests,
        strategy=Strategy(tuning.strategy),
        search_windows=False,  # seconds at every load: `kvpilot tune` searches them
    )


def traffic_reachability(
    settings: RolloutSettings,
    canary: CanaryConfig,
    *,
    requests_per_window: int,
    strategy: Strategy,
    search_windows: bool = True,
) -> Reachability:
    """Whether an equal canary can pass under `settings`, judged as the canary's traffic is:
    replayed windows of `requests_per_window`, or live traffic's one analysis of
    `canary.analysis_s` in intervals. The configuration's check and a run's share it."""
    if canary.traffic == "replay":
        return reachability(
            settings,
            requests_per_window=requests_per_window,
            strategy=strategy,
            search_windows=search_windows,
        )
    intervals = int(canary.analysis_s // canary.analysis_interval_s)
    return live_reachability(settings, intervals=intervals)


def _judged(tuning: TuningConfig) -> tuple[object, ...]:
    """The settings an equal canary's verdict depends on."""
    canary = tuning.canary
    return (
        tuning.windows,
        tuning.error_margin_ratio,
        tuning.preemption_margin_per_request,
        tuning.latency_margin_ratio,
        tuning.workload.requests,
        tuning.strategy,
        tuning.slo,
        canary.traffic,
        canary.analysis_s,
        canary.analysis_interval_s,
    )
