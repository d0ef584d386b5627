"""Per-interval figures from two readings of one pod's /metrics: deltas, restarts, errors."""

from __future__ import annotations

import pytest

from kvpilot.agent.tuning.pod.live_intervals import (
    interval,
    interval_samples,
    intervals,
    judge_samples,
    preemption_breach,
    read_pod,
)
from kvpilot.tuner.judge.evidence import Counts
from kvpilot.tuner.problem.objective import Slo
from tests.agent.tuning.test_live_observer import PodScript, Step

SLO = Slo(ttft_p95_s=1.0, inter_token_p95_s=0.2)


def reading(text: str, at_s: float):
    got = read_pod(text, taken_at_s=at_s, wall_time_s=1e9 + at_s)
    assert got is not None
    return got


def test_an_interval_is_the_difference_of_two_readings() -> None:
    pod = PodScript([Step(4, ttft_s=0.2, e2e_s=1.2, preemptions=2, failed=1)])
    first, second = reading(pod.render(), 0.0), reading(pod.render(), 5.0)

    span = interval(first, second)

    assert (span.span_s, span.finished, span.preemptions) == (5.0, 4.0, 2.0)
    assert span.ttft_mean_s == pytest.approx(0.2) and span.e2e_mean_s == pytest.approx(1.2)
    assert span.ttft_p95_s is not None and 0.1 < span.ttft_p95_s <= 0.25  # the bucket's
    assert (span.answered, span.failed, span.errors_ratio) == (5.0, 1.0, 0.2)
    assert span.slo_breach(SLO) == "1 of 5 requests failed (allowed ratio 0)"


def test_a_pod_that_restarted_counts_from_zero_not_below_it() -> None:
    before = PodScript([Step(50, tokens_each=10)])
    for _ in range(3):
        old = before.render()
    restarted = PodScript([Step(2, ttft_s=3.0, tokens_each=10)])
    restarted.render()
    new = restarted.render()

    span = interval(reading(old, 0.0), reading(new, 2.0))

    assert (span.finished, span.generation_tokens, span.answered) == (2.0, 20.0, 2.0)
    assert span.ttft_mean_s == pytest.approx(3.0)
    assert span.latency_breach(SLO) is not None and span.latency_breach(SLO).startswith("TTFT")
    samples = judge_samples([span], [], 0.5, SLO)
    assert samples["goodput_tokens_per_s"] == (0.0,)  # an interval that broke the SLO


def test_metrics_without_vllm_families_are_not_a_reading() -> None:
    assert read_pod("up 1\n", taken_at_s=0.0, wall_time_s=0.0) is None


def test_preemptions_per_request_breach_over_the_analysis_not_one_interval() -> None:
    slo = Slo(ttft_p95_s=1.0, inter_token_p95_s=0.2, max_preemptions_per_request=0.1)
    pod = PodScript([Step(2, preemptions=1)])
    readings = [reading(pod.render(), 2.0 * i) for i in range(7)]  # six intervals, 2 each

    # 1 preemption in 2 requests is 0.5 per request, but too few requests to say so.
    assert preemption_breach(intervals(readings[:5]), slo) is None  # 8 finished
    said = preemption_breach(intervals(readings[:6]), slo)  # 10 finished
    assert said == "5 preemptions in 10 finished requests, 0.5 per request (allowed 0.1)"
    calm = PodScript([Step(10, preemptions=1)])
    calm_readings = [reading(calm.render(), 2.0 * i) for i in range(4)]
    assert preemption_breach(intervals(calm_readings), slo) is None  # 0.1: within the limit


def test_each_interval_keeps_the_ticks_it_spans_and_its_own_samples() -> None:
    pod = PodScript([Step(2, ttft_s=0.1), Step(4, ttft_s=0.3, preemptions=1), Step(3)])
    texts = [pod.render() for _ in range(4)]
    # The scrape at tick 2 failed: its reading is missing, the next interval spans 1-3.
    kept = [reading(texts[0], 0.0), reading(texts[1], 10.0), reading(texts[3], 30.0)]

    first, gap = interval_samples([0, 1, 3], kept, 0.5, SLO)

    assert (first.start_tick, first.end_tick, gap.start_tick, gap.end_tick) == (0, 1, 1, 3)
    assert first.samples["ttft_s"] == pytest.approx((0.1,))
    assert first.samples["errors_ratio"] == Counts(0.0, 2.0)
    # Both steps in one mean: (4 x 0.3 + 3 x 0.05) / 7 requests.
    assert gap.samples["ttft_s"] == pytest.approx(((4 * 0.3 + 3 * 0.05) / 7,))
    assert gap.samples["preemptions_per_request"] == Counts(1.0, 7.0)
    assert gap.samples["goodput_tokens_per_s"] == pytest.approx((70 / 20.0 / 0.5,))
