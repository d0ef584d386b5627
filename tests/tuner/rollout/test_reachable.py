"""Whether a rollout's settings let an equal canary pass at all, asked of the judge itself:
the shipped defaults can, five windows of 64 requests under the half-point error margin
cannot (and the refusal says what would), the pairing is the strategy's, and the best case
is the best real data can give, not a tie's artefact."""

from __future__ import annotations

import dataclasses

import pytest

from kvpilot.tuner.judge.judgement import (
    DEFAULT_METRICS,
    LATENCY_METRICS,
    LIVE_METRICS,
    JudgeConfig,
    MetricSpec,
    with_margin_ratios,
    with_margins,
)
from kvpilot.tuner.judge.sequential import LookDecision
from kvpilot.tuner.judge.windows import judge_windows
from kvpilot.tuner.rollout.reachable import best_case, live_reachability, reachability
from kvpilot.tuner.rollout.record import Strategy
from kvpilot.tuner.rollout.settings import RolloutSettings


def _settings(
    windows: int = 64,
    *,
    error_margin: float = 0.005,
    latency_margin: float = 0.1,
    alpha: float = 0.05,
    metrics: tuple[MetricSpec, ...] = DEFAULT_METRICS,
) -> RolloutSettings:
    """Rollout settings as `agent.tuning.study.rollout_settings` builds them."""
    judged = with_margin_ratios(
        with_margins(metrics, errors_ratio=error_margin),
        **dict.fromkeys(LATENCY_METRICS, latency_margin),
    )
    return RolloutSettings(judge=JudgeConfig(judged, alpha), windows=windows)


@pytest.mark.parametrize("strategy", list(Strategy))
def test_the_shipped_defaults_let_an_equal_canary_pass_by_32_windows(strategy: Strategy) -> None:
    found = reachability(RolloutSettings(), requests_per_window=64, strategy=strategy)
    assert found.passes, found.reason
    # 16 windows (1,024 requests) cannot show the half-point error margin at that look's
    # share of alpha; 32 windows (2,048) can.
    assert found.look.windows == 32
    assert found.look.decision is LookDecision.PASS


@pytest.mark.parametrize("strategy", list(Strategy))
def test_five_windows_of_64_requests_cannot_show_the_half_point_error_margin(
    strategy: Strategy,
) -> None:
    found = reachability(_settings(5), requests_per_window=64, strategy=strategy)
    assert not found.passes
    assert found.look.decision is LookDecision.INCONCLUSIVE
    reason = found.reason
    assert reason.startswith("cannot pass: an equal canary")
    # The judge's reason in words: 320 requests a side bound the errors at 0.0084.
    assert "errors_ratio: with no failures in 320 requests a side" in reason
    assert "above the margin 0.005" in reason
    # What would do: looks at 8 and 15 windows (960 requests at the last look's alpha).
    assert found.windows_needed == 15
    assert "tuning.windows 15 or more" in reason
    assert found.error_margin_needed == pytest.approx(0.0084)
    assert "tuning.error_margin_ratio 0.0084 or more" in reason


def test_what_the_refusal_proposes_does_pass() -> None:
    found = reachability(_settings(5), requests_per_window=64, strategy=Strategy.PARALLEL)
    assert found.windows_needed is not None and found.error_margin_needed is not None
    more = reachability(
        _settings(found.windows_needed), requests_per_window=64, strategy=Strategy.PARALLEL
    )
    one_fewer = reachability(
        _settings(found.windows_needed - 1), requests_per_window=64, strategy=Strategy.PARALLEL
    )
    wider = reachability(
        _settings(5, error_margin=found.error_margin_needed),
        requests_per_window=64,
        strategy=Strategy.PARALLEL,
    )
    assert more.passes and wider.passes and not one_fewer.passes


def test_the_rigs_settings_are_reachable() -> None:
    # test_tune_e2e's RIG_TUNING and the sidecar's scheduled run: five windows of 64
    # requests, a five-point error margin (the sidecar's latencies at x3).
    for settings in (
        _settings(5, error_margin=0.05),
        _settings(5, error_margin=0.05, latency_margin=2.0),
    ):
        for strategy in Strategy:
            found = reachability(settings, requests_per_window=64, strategy=strategy)
            assert found.passes, found.reason


def test_parallel_and_sequential_canaries_are_both_judged_paired() -> None:
    # Five windows at alpha 0.01: five paired windows reach p = 1/32 at best (signed rank);
    # the sequential canary's are paired too (A-B-A: each with the stable's before and after
    # it), so neither passes, where five against five unpaired would (p = 1/252).
    settings = _settings(5, error_margin=0.05, alpha=0.01)
    parallel = reachability(settings, requests_per_window=128, strategy=Strategy.PARALLEL)
    sequential = reachability(settings, requests_per_window=128, strategy=Strategy.SEQUENTIAL)
    assert not parallel.passes and not sequential.passes
    assert "paired windows" in parallel.reason and "paired windows" in sequential.reason
    assert "ttft_s: 5 samples a side show it within its margin at p=0.031 at best" in (
        parallel.reason
    )
    assert parallel.error_margin_needed is None  # the margin is not what stops it
    assert parallel.windows_needed is not None


def test_the_best_case_is_distinct_data_not_ties() -> None:
    # Identical values would tie every difference: the signed-rank test's tie correction
    # then gives five paired windows p = 0.018, below 1/32, which no real data reaches. The
    # best case's values are distinct, so at alpha 0.03 five paired windows cannot pass.
    found = reachability(
        _settings(5, error_margin=0.05, alpha=0.03),
        requests_per_window=64,
        strategy=Strategy.PARALLEL,
    )
    assert not found.passes
    windows = best_case(DEFAULT_METRICS, 5, 64)
    ttfts = [v for w in windows for side in (w.canary, w.baseline) for v in side["ttft_s"]]
    assert len(set(ttfts)) == len(ttfts)
    assert max(ttfts) / min(ttfts) < 1.002  # a hair, far inside any margin
    # ...and the canary's windows are the baseline's, as the judge sees them: no harm.
    judged = judge_windows(windows, JudgeConfig(with_margins(DEFAULT_METRICS, errors_ratio=0.05)))
    assert judged.promote, judged.reason


def test_live_traffic_is_judged_over_the_analysis_intervals() -> None:
    live = dataclasses.replace(_settings(1, metrics=LIVE_METRICS))
    assert live_reachability(live, intervals=20).passes
    strict = _settings(1, metrics=LIVE_METRICS, alpha=0.001)
    found = live_reachability(strict, intervals=5)
    assert not found.passes
    assert "live traffic, 5 intervals of one analysis" in found.reason
    assert "a longer canary.analysis_s" in found.reason
    assert found.windows_needed is None  # windows are not what live traffic sets
    # Judged as the rollout judges live traffic: intervals paired, fewer than five never.
    few = live_reachability(live, intervals=4)
    assert not few.passes and "fewer than the 5 a paired judgement needs" in few.reason
    assert live_reachability(live, intervals=5).passes  # five pairs reach p = 1/32


def test_a_window_without_requests_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one request"):
        reachability(_settings(), requests_per_window=0, strategy=Strategy.PARALLEL)
