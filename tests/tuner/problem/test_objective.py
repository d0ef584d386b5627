"""Goodput under an SLO, the constraints, and the ranking of results."""

from __future__ import annotations

import math

import pytest

from kvpilot.collectors.histogram import Histogram
from kvpilot.collectors.vllm_metrics import EngineSample, VllmScrape
from kvpilot.tuner.load.generator import LoadReport, RequestResult
from kvpilot.tuner.problem.objective import (
    Measurement,
    Slo,
    TrialOutcome,
    TrialResult,
    attains,
    best_index,
    better,
    evaluate,
)
from kvpilot.tuner.problem.startup_errors import StartupFailureKind

SLO = Slo(
    ttft_p95_s=1.0,
    inter_token_p95_s=0.1,
    attainment_target_ratio=0.75,
    max_preemptions_per_request=0.5,
)


def request(
    index: int, ttft_s: float, gap_s: float, tokens: int, *, start_s: float = 0.0, error=None
) -> RequestResult:
    first = start_s + ttft_s
    times = tuple(first + i * gap_s for i in range(tokens))
    return RequestResult(
        index=index,
        prompt_tokens=10,
        output_tokens_requested=tokens,
        start_s=start_s,
        end_s=times[-1],
        first_token_s=first,
        token_times_s=times,
        output_tokens=0 if error else tokens,
        error=error,
    )


def report(*results: RequestResult, duration_s: float = 10.0) -> LoadReport:
    return LoadReport(started_s=0.0, finished_s=duration_s, results=results)


def scrapes(*preemptions: float) -> tuple[VllmScrape, ...]:
    out = []
    for i, value in enumerate(preemptions):
        engine = EngineSample(
            "m", "0", taken_at_s=float(i), wall_time_s=1e9 + i, preemptions_total=value
        )
        out.append(VllmScrape(float(i), 1e9 + i, (engine,), "0.32.0"))
    return tuple(out)


def test_a_request_attains_only_with_both_limits_met() -> None:
    assert attains(request(0, 0.5, 0.05, 20), SLO)
    assert not attains(request(0, 1.5, 0.05, 20), SLO)  # first token too late
    assert not attains(request(0, 0.5, 0.2, 20), SLO)  # its inter-token p95 too slow
    assert attains(request(0, 0.5, 9.9, 1), SLO)  # one token: no gaps, TTFT decides
    assert not attains(request(0, 0.5, 0.05, 20, error="HTTP 500"), SLO)


def test_goodput_counts_only_the_tokens_of_attaining_requests() -> None:
    window = report(
        request(0, 0.5, 0.05, 100),
        request(1, 0.5, 0.05, 50),
        request(2, 0.5, 0.05, 30),
        request(3, 2.0, 0.05, 40),  # misses the TTFT limit
    )
    result = evaluate(Measurement(window, memory_bytes=123), SLO)
    assert result.outcome is TrialOutcome.FEASIBLE and result.feasible
    assert result.goodput_tokens_per_s == pytest.approx((100 + 50 + 30) / 10.0)
    assert result.metrics is not None and result.metrics.attainment_ratio == 0.75
    assert result.memory_bytes == 123


def test_below_the_attainment_target_the_slo_is_broken_with_the_share() -> None:
    window = report(request(0, 0.5, 0.05, 10), request(1, 2.0, 0.05, 10))
    result = evaluate(Measurement(window), SLO)
    assert result.outcome is TrialOutcome.SLO_BROKEN and not result.feasible
    assert result.reason is not None and result.reason.startswith("50% of requests met")
    assert result.goodput_tokens_per_s == pytest.approx(1.0)  # kept for the report


def test_failed_requests_are_a_constraint() -> None:
    window = report(request(0, 0.5, 0.05, 10), request(1, 0.5, 0.05, 10, error="HTTP 500"))
    result = evaluate(Measurement(window), SLO)
    assert result.outcome is TrialOutcome.REQUESTS_FAILED
    assert "1 of 2 requests failed" in (result.reason or "")


def test_preemptions_per_request_come_from_the_scrapes_across_a_reset() -> None:
    window = report(*(request(i, 0.5, 0.05, 10) for i in range(4)))
    # 5 -> 7 (+2), reset to 1 (+1): 3 preemptions over 4 requests.
    result = evaluate(Measurement(window, scrapes(5.0, 7.0, 1.0)), SLO)
    assert result.metrics is not None and result.metrics.preemptions_total == 3.0
    assert result.outcome is TrialOutcome.PREEMPTED
    assert result.reason == "0.75 preemptions per request (allowed 0.5)"
    calm = evaluate(Measurement(window, scrapes(5.0, 6.0)), SLO)
    assert calm.outcome is TrialOutcome.FEASIBLE


def test_without_scrapes_preemptions_are_unknown_not_zero() -> None:
    result = evaluate(Measurement(report(request(0, 0.5, 0.05, 10))), SLO)
    assert result.metrics is not None
    assert result.metrics.preemptions_total is None
    assert result.metrics.preemptions_per_request is None


def test_an_empty_window_is_no_data() -> None:
    assert evaluate(Measurement(report()), SLO).outcome is TrialOutcome.NO_DATA
    assert evaluate(Measurement(), SLO).outcome is TrialOutcome.NO_DATA


def test_failed_start_carries_vllms_reason() -> None:
    log = "ValueError: No available memory for the cache blocks. Try increasing ..."
    result = TrialResult.failed_to_start(log, memory_bytes=1)
    assert result.outcome is TrialOutcome.FAILED_TO_START and not result.feasible
    assert result.startup_failure is not None
    assert result.startup_failure.kind is StartupFailureKind.NO_CACHE_MEMORY
    assert "No available memory for the cache blocks" in (result.reason or "")


def feasible(goodput: float, memory: int | None) -> TrialResult:
    return TrialResult(TrialOutcome.FEASIBLE, goodput, memory, None)


def test_memory_breaks_near_ties_and_only_near_ties() -> None:
    slo = Slo(memory_tie_ratio=0.02)
    assert better(feasible(100.0, 1000), feasible(101.0, 2000), slo)  # within 2 %: memory
    assert not better(feasible(101.0, 2000), feasible(100.0, 1000), slo)
    assert better(feasible(110.0, 2000), feasible(100.0, 1000), slo)  # clearly more goodput
    infeasible = TrialResult(TrialOutcome.SLO_BROKEN, 500.0, 10, "slow")
    assert better(feasible(1.0, None), infeasible, slo)
    assert best_index([infeasible, feasible(100.0, 2000), feasible(100.5, 1000)], slo) == 2
    assert best_index([infeasible], slo) is None


def hist(counts: tuple[float, float, float]) -> Histogram:
    """Cumulative counts at le=0.05, 0.5, +Inf."""
    bounds = (0.05, 0.5, math.inf)
    return Histogram(tuple(zip(bounds, counts, strict=True)), sum=0.0, count=counts[-1])


def engine_scrape(at_s: float, n: float, slow: float, tokens: float) -> VllmScrape:
    engine = EngineSample(
        "m",
        "0",
        taken_at_s=at_s,
        wall_time_s=1e9 + at_s,
        preemptions_total=0.0,
        generation_tokens_total=tokens,
        ttft=hist((n - slow, n, n)),
        inter_token_latency=hist((n * 10, n * 10, n * 10)),
        e2e_latency=hist((0.0, 0.0, n)),
    )
    return VllmScrape(at_s, 1e9 + at_s, (engine,), "0.32.0")


def test_without_client_timings_the_histograms_judge_the_window() -> None:
    fast = (engine_scrape(0.0, 0.0, 0.0, 0.0), engine_scrape(10.0, 100.0, 0.0, 2000.0))
    result = evaluate(Measurement(scrapes=fast), SLO)
    assert result.metrics is not None and result.metrics.source == "histograms"
    assert result.metrics.requests_total == 100
    assert result.outcome is TrialOutcome.FEASIBLE
    assert result.goodput_tokens_per_s == pytest.approx(200.0)
    # With a limit below the TTFT buckets' p95, the window breaks the SLO; goodput is unknown.
    strict = Slo(ttft_p95_s=0.01, inter_token_p95_s=0.1, max_preemptions_per_request=0.5)
    broken = evaluate(Measurement(scrapes=fast), strict)
    assert broken.outcome is TrialOutcome.SLO_BROKEN and broken.goodput_tokens_per_s is None
    assert broken.reason is not None and broken.reason.startswith("TTFT p95")


def test_histogram_goodput_is_divided_by_the_traffic_share() -> None:
    """A canary on 10 % of live traffic and a stable instance on 90 % compare per share."""
    canary = (engine_scrape(0.0, 0.0, 0.0, 0.0), engine_scrape(10.0, 10.0, 0.0, 200.0))
    stable = (engine_scrape(0.0, 0.0, 0.0, 0.0), engine_scrape(10.0, 90.0, 0.0, 1800.0))
    small = evaluate(Measurement(scrapes=canary, traffic_share_ratio=0.1), SLO)
    large = evaluate(Measurement(scrapes=stable, traffic_share_ratio=0.9), SLO)
    assert small.goodput_tokens_per_s == pytest.approx(200.0)
    assert large.goodput_tokens_per_s == pytest.approx(200.0)
    assert small.metrics is not None and small.metrics.output_tokens_per_s == pytest.approx(20.0)
    with pytest.raises(ValueError, match="traffic_share_ratio"):
        Measurement(scrapes=canary, traffic_share_ratio=0.0)
