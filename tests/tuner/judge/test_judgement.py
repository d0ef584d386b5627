"""The judge on synthetic samples whose answer is known: it passes a canary only on evidence
that it is not worse by more than each metric's margin."""

from __future__ import annotations

import random

import pytest

from kvpilot.tuner.judge.judgement import (
    DEFAULT_METRICS,
    Classification,
    Direction,
    JudgeConfig,
    MetricKind,
    MetricSpec,
    Verdict,
    judge,
    judge_metric,
)


def normal(mean: float, sd: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(mean, sd) for _ in range(n)]


LATENCY = MetricSpec("ttft_s", Direction.INCREASE, tolerance_ratio=0.1)
ERRORS = next(m for m in DEFAULT_METRICS if m.name == "errors_ratio")
# The per-second preemption rate the judge used before it counted per finished request: the
# rate machinery's tests keep it.
PREEMPTIONS = MetricSpec(
    "preemptions_per_s",
    Direction.INCREASE,
    tolerance_ratio=0.2,
    tolerance_abs=0.2,
    kind=MetricKind.RATE,
    required=True,
    min_samples=0,
)


def test_same_distribution_passes() -> None:
    v = judge_metric(LATENCY, normal(1.0, 0.1, 200, 1), normal(1.0, 0.1, 200, 2), 0.05)
    assert v.verdict is Verdict.PASS and not v.counts_against


def test_a_clear_slowdown_is_high_and_counts_against() -> None:
    v = judge_metric(LATENCY, normal(1.5, 0.1, 200, 1), normal(1.0, 0.1, 200, 2), 0.05)
    assert v.verdict is Verdict.HIGH and v.counts_against
    assert v.shift == pytest.approx(0.5, abs=0.05)
    assert v.p_value is not None and v.p_value < 1e-6


def test_a_significant_shift_inside_the_margin_passes() -> None:
    # 3 % slower, measured precisely: significant, yet shown to be inside the 10 % margin.
    v = judge_metric(LATENCY, normal(1.03, 0.01, 300, 1), normal(1.0, 0.01, 300, 2), 0.05)
    assert v.p_value is not None and v.p_value < 0.05
    assert v.verdict is Verdict.PASS and "not worse by 0.1 or more" in v.reason
    assert v.noninferior_p is not None and v.noninferior_p < 0.05


def test_direction_decides_whether_low_counts_against() -> None:
    faster = normal(0.5, 0.05, 100, 1), normal(1.0, 0.05, 100, 2)
    latency = judge_metric(LATENCY, *faster, 0.05)
    assert latency.verdict is Verdict.PASS and not latency.counts_against  # better: not worse
    throughput = MetricSpec("tokens_per_s", Direction.DECREASE)
    assert judge_metric(throughput, *faster, 0.05).counts_against
    either = MetricSpec("kv_usage_ratio", Direction.EITHER)
    assert judge_metric(either, *faster, 0.05).counts_against


def test_a_latency_with_too_few_samples_is_nodata_and_is_left_out_and_said() -> None:
    config = JudgeConfig(metrics=(LATENCY, MetricSpec("e2e_s", Direction.INCREASE)))
    same = normal(1.0, 0.1, 50, 3)
    result = judge({"ttft_s": same, "e2e_s": [1.0]}, {"ttft_s": same, "e2e_s": same}, config)
    assert [m.verdict for m in result.metrics] == [Verdict.PASS, Verdict.NODATA]
    assert result.score_ratio == 1.0 and result.classification is Classification.PASS
    assert result.promote and "left out for want of data: e2e_s" in result.reason


def test_zero_errors_pass_only_with_enough_requests() -> None:
    # No failure on either side: the half-point margin needs about 550 requests a side.
    assert judge_metric(ERRORS, [0.0] * 500, [0.0] * 500, 0.05).verdict is Verdict.INCONCLUSIVE
    enough = judge_metric(ERRORS, [0.0] * 560, [0.0] * 560, 0.05)
    assert enough.verdict is Verdict.PASS and enough.upper_bound is not None
    assert 0 < enough.upper_bound < 0.005


def specs(n: int) -> tuple[MetricSpec, ...]:
    return tuple(MetricSpec(f"m{i}", Direction.INCREASE) for i in range(n))


def test_score_classifies_pass_marginal_fail() -> None:
    base = {f"m{i}": normal(1.0, 0.1, 100, i) for i in range(10)}

    def canary(worse: int) -> dict[str, list[float]]:
        return {f"m{i}": normal(2.0 if i < worse else 1.0, 0.1, 100, 100 + i) for i in range(10)}

    config = JudgeConfig(metrics=specs(10), marginal_score_ratio=0.75)
    assert judge(canary(0), base, config).classification is Classification.PASS
    marginal = judge(canary(2), base, config)
    assert marginal.classification is Classification.MARGINAL and not marginal.promote
    assert marginal.score_ratio == pytest.approx(0.8)
    assert judge(canary(5), base, config).classification is Classification.FAIL


def test_a_failing_critical_metric_fails_the_whole() -> None:
    config = JudgeConfig(
        metrics=(*specs(9), MetricSpec("errors_ratio", Direction.INCREASE, critical=True))
    )
    base = {f"m{i}": normal(1.0, 0.1, 60, i) for i in range(9)}
    canary = {f"m{i}": normal(1.0, 0.1, 60, 50 + i) for i in range(9)}
    base["errors_ratio"] = [0.0] * 60
    canary["errors_ratio"] = [0.0] * 30 + [1.0] * 30
    result = judge(canary, base, config)
    assert result.score_ratio == pytest.approx(0.9)
    assert result.classification is Classification.FAIL
    assert "errors_ratio" in result.reason


def test_nothing_to_judge_is_inconclusive_and_does_not_promote() -> None:
    result = judge({}, {})
    assert result.classification is Classification.INCONCLUSIVE and not result.promote


def test_a_shift_small_against_the_slo_limit_passes() -> None:
    # Inter-token gaps from 3 ms to 7 ms: far beyond 10 % of the baseline, yet under a 100 ms
    # limit the user would not notice; with a 20 ms limit the same shift counts against.
    itl = MetricSpec(
        "inter_token_s", Direction.INCREASE, tolerance_ratio=0.1, slo_tolerance_ratio=0.1
    )
    canary, baseline = normal(0.007, 0.001, 300, 1), normal(0.003, 0.001, 300, 2)
    assert judge_metric(itl, canary, baseline, 0.05).verdict is Verdict.HIGH
    loose = judge_metric(itl, canary, baseline, 0.05, slo_limit=0.1)
    assert loose.verdict is Verdict.PASS and "not worse by 0.01 or more" in loose.reason
    tight = judge_metric(itl, canary, baseline, 0.05, slo_limit=0.02)
    assert tight.verdict is Verdict.HIGH and tight.counts_against


def test_judge_passes_the_slo_limits_by_metric_name() -> None:
    config = JudgeConfig(
        metrics=(MetricSpec("inter_token_s", Direction.INCREASE, slo_tolerance_ratio=0.1),)
    )
    canary, baseline = normal(0.007, 0.001, 300, 1), normal(0.003, 0.001, 300, 2)
    assert judge({"inter_token_s": canary}, {"inter_token_s": baseline}, config).promote is False
    loose = judge(
        {"inter_token_s": canary},
        {"inter_token_s": baseline},
        config,
        slo_limits={"inter_token_s": 0.1},
    )
    assert loose.classification is Classification.PASS
