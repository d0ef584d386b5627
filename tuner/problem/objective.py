"""The objective: goodput under an SLO from one instance's measurement window.

Per-request SLO attainment: a request *attains* the SLO when it succeeded, its time to first
token is at most `ttft_p95_s`, and the 95th percentile of its own inter-token gaps is at most
`inter_token_p95_s` (a request with a single output token has no gaps; TTFT alone decides).
The window meets the SLO when at least `attainment_target_ratio` of its requests attain it
(with the default 0.95 this is exactly "TTFT p95 and inter-token p95 within the limits",
taken per request). Goodput is the output tokens of attaining requests per second of window.

Preemptions per finished request and the failed-request ratio are constraints. Memory is
priced: among feasible results within `memory_tie_ratio` (5 %) of the best goodput, the one
with the least memory wins (memory kept free is worth something to the neighbours on the
device). The memory is what the server reports as its KV budget (`server_kv_budget_bytes`).

Without client-side timings (live traffic, only scraped samples) attainment cannot be judged
per request: the window's histogram p95s are held against the limits and goodput is the
engine's generation-token rate when they hold (`WindowMetrics.source == "histograms"`),
divided by the share of live traffic the instance received (`Measurement.traffic_share_ratio`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvpilot.collectors.vllm_metrics import EngineSample, VllmScrape
from kvpilot.collectors.window import RollingWindow
from kvpilot.tuner.load.generator import LoadReport, RequestResult, percentile
from kvpilot.tuner.problem.startup_errors import StartupFailure, parse_startup_failure


@dataclass(frozen=True, slots=True)
class Slo:
    """The service-level objective a trial is held to."""

    ttft_p95_s: float = 2.0
    inter_token_p95_s: float = 0.25
    attainment_target_ratio: float = 0.95
    max_preemptions_per_request: float = 0.1
    max_failed_ratio: float = 0.0
    memory_tie_ratio: float = 0.05

    def __post_init__(self) -> None:
        if self.ttft_p95_s <= 0 or self.inter_token_p95_s <= 0:
            raise ValueError("SLO latency limits must be positive")
        if not 0 < self.attainment_target_ratio <= 1:
            raise ValueError("attainment_target_ratio must be in (0, 1]")

    def judge_limits(self) -> dict[str, float]:
        """The latency limits by the judge's metric names (for its SLO-aware tolerance)."""
        return {"ttft_s": self.ttft_p95_s, "inter_token_s": self.inter_token_p95_s}


class TrialOutcome(StrEnum):
    """A trial's verdict; everything but FEASIBLE is infeasible, with a reason."""

    FEASIBLE = "feasible"
    CRASHED = "crashed"
    FAILED_TO_START = "failed_to_start"
    SLO_BROKEN = "slo_broken"
    PREEMPTED = "preempted"
    REQUESTS_FAILED = "requests_failed"
    NO_DATA = "no_data"


@dataclass(frozen=True, slots=True)
class WindowMetrics:
    """What one window measured; None where the window could not tell."""

    source: str  # "client" (the load generator's per-request timings) or "histograms"
    duration_s: float
    requests_total: int
    requests_failed: int
    attaining_requests: int | None
    attainment_ratio: float | None
    ttft_p95_s: float | None
    inter_token_p95_s: float | None
    output_tokens_per_s: float | None
    preemptions_total: float | None
    preemptions_per_request: float | None


@dataclass(frozen=True, slots=True)
class Measurement:
    """One instance's window: the load generator's report and/or its scrapes, oldest first."""

    report: LoadReport | None = None
    scrapes: tuple[VllmScrape, ...] = ()
    memory_bytes: int | None = None  # the tie-breaker: KV budget or process memory
    # Live traffic: the share of it this instance received. Histogram goodput is divided by
    # it, so that a canary on 10 % and a stable instance on 90 % compare.
    traffic_share_ratio: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.traffic_share_ratio <= 1:
            raise ValueError("traffic_share_ratio must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class TrialResult:
    """The objective's verdict on one trial; goodput is kept even when infeasible."""

    outcome: TrialOutcome
    goodput_tokens_per_s: float | None
    memory_bytes: int | None
    reason: str | None
    metrics: WindowMetrics | None = None
    startup_failure: StartupFailure | None = None

    @property
    def feasible(self) -> bool:
        return self.outcome is TrialOutcome.FEASIBLE

    @classmethod
    def crashed(cls, detail: str, memory_bytes: int | None = None) -> TrialResult:
        return cls(TrialOutcome.CRASHED, None, memory_bytes, f"crashed: {detail}")

    @classmethod
    def failed_to_start(cls, log_text: str, memory_bytes: int | None = None) -> TrialResult:
        """A start that failed, with vLLM's own reason read from its log."""
        failure = parse_startup_failure(log_text)
        detail = f" ({failure.log_line})" if failure.log_line else ""
        reason = f"failed to start: {failure.message}{detail}"
        return cls(
            TrialOutcome.FAILED_TO_START, None, memory_bytes, reason, startup_failure=failure
        )


def evaluate(measurement: Measurement, slo: Slo) -> TrialResult:
    """Goodput and the constraints of one window, as a feasible or infeasible result."""
    metrics: WindowMetrics | None
    if measurement.report is not None:
        metrics, goodput = _client_metrics(measurement.report, measurement.scrapes, slo)
    else:
        metrics, goodput = _histogram_metrics(
            measurement.scrapes, slo, measurement.traffic_share_ratio
        )
    memory = measurement.memory_bytes
    if metrics is None or metrics.requests_total == 0:
        return TrialResult(TrialOutcome.NO_DATA, None, memory, "no requests in the window", metrics)
    failed_ratio = metrics.requests_failed / metrics.requests_total
    if failed_ratio > slo.max_failed_ratio:
        reason = (
            f"{metrics.requests_failed} of {metrics.requests_total} requests failed "
            f"(allowed ratio {slo.max_failed_ratio:g})"
        )
        return TrialResult(TrialOutcome.REQUESTS_FAILED, goodput, memory, reason, metrics)
    per_request = metrics.preemptions_per_request
    if per_request is not None and per_request > slo.max_preemptions_per_request:
        reason = (
            f"{per_request:.3g} preemptions per request "
            f"(allowed {slo.max_preemptions_per_request:g})"
        )
        return TrialResult(TrialOutcome.PREEMPTED, goodput, memory, reason, metrics)
    broken = _slo_broken(metrics, slo)
    if broken is not None:
        return TrialResult(TrialOutcome.SLO_BROKEN, goodput, memory, broken, metrics)
    return TrialResult(TrialOutcome.FEASIBLE, goodput, memory, None, metrics)


def attains(result: RequestResult, slo: Slo) -> bool:
    """Whether one request met the SLO (see the module docstring)."""
    ttft = result.ttft_s
    if not result.ok or ttft is None or ttft > slo.ttft_p95_s:
        return False
    gaps = result.inter_token_s
    p95 = percentile(gaps, 0.95)
    return p95 is None or p95 <= slo.inter_token_p95_s


def better(a: TrialResult, b: TrialResult, slo: Slo) -> bool:
    """Whether `a` beats `b`: feasible first, then less memory where the goodputs are within
    `memory_tie_ratio` of the higher one (both memories known), otherwise more goodput."""
    if a.feasible != b.feasible:
        return a.feasible
    if not a.feasible or a.goodput_tokens_per_s is None:
        return False
    if b.goodput_tokens_per_s is None:
        return True
    ga, gb = a.goodput_tokens_per_s, b.goodput_tokens_per_s
    if abs(ga - gb) > slo.memory_tie_ratio * max(ga, gb):
        return ga > gb
    if (
        a.memory_bytes is not None
        and b.memory_bytes is not None
        and a.memory_bytes != b.memory_bytes
    ):
        return a.memory_bytes < b.memory_bytes
    return ga > gb


def best_index(results: Sequence[TrialResult], slo: Slo) -> int | None:
    """The index of the memory-priced best feasible result: among those within
    `memory_tie_ratio` of the highest goodput, the least memory (unknown memory last), then
    the higher goodput; None when none is feasible."""
    feasible = [
        i for i, r in enumerate(results) if r.feasible and r.goodput_tokens_per_s is not None
    ]
    if not feasible:
        return next((i for i, r in enumerate(results) if r.feasible), None)
    top = max(results[i].goodput_tokens_per_s or 0.0 for i in feasible)
    floor = (1 - slo.memory_tie_ratio) * top
    near = [i for i in feasible if (results[i].goodput_tokens_per_s or 0.0) >= floor]

    def key(i: int) -> tuple[bool, float, float]:
        memory = results[i].memory_bytes
        return (memory is None, float(memory or 0), -(results[i].goodput_tokens_per_s or 0.0))

    return min(near, key=key)


def relative_result(
    result: TrialResult, baseline_goodput_tokens_per_s: float | None
) -> TrialResult | None:
    """The trial as a suggester is told it: goodput as the ratio to the stable server's in
    the same windows, so that the day's load (which sets both) cancels; outcome and memory
    as measured, so feasibility and the memory tie-break are unchanged. Without a positive
    baseline figure a feasible trial has no value on that scale: None (left out, as no
    made-up value is told); an infeasible one stays infeasible, its goodput unknown."""
    base = baseline_goodput_tokens_per_s
    if base is None or not math.isfinite(base) or base <= 0:
        if result.feasible:
            return None
        return dataclasses.replace(result, goodput_tokens_per_s=None)
    goodput = result.goodput_tokens_per_s
    ratio = goodput / base if goodput is not None else None
    return dataclasses.replace(result, goodput_tokens_per_s=ratio)


def server_kv_budget_bytes(scrapes: Sequence[VllmScrape]) -> int | None:
    """The KV budget the server reports: `vllm:cache_config_info`'s `kv_cache_memory_bytes`,
    summed over its engines, from the newest scrape that says it; None where no scrape does
    (the label reads "None" when the budget came from `--gpu-memory-utilization`)."""
    for scrape in reversed(scrapes):
        budgets = [
            _int_label(dict(e.cache_config).get("kv_cache_memory_bytes")) for e in scrape.engines
        ]
        if budgets and all(b is not None for b in budgets):
            return sum(b for b in budgets if b is not None)
    return None


def _int_label(text: str | None) -> int | None:
    try:
        value = int(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and value > 0 else None


def _client_metrics(
    report: LoadReport, scrapes: Sequence[VllmScrape], slo: Slo
) -> tuple[WindowMetrics, float | None]:
    duration = report.duration_s
    attaining = [r for r in report.results if attains(r, slo)]
    total = len(report.results)
    good_tokens = sum(r.output_tokens for r in attaining)
    goodput = good_tokens / duration if duration > 0 else None
    preemptions = _preemptions(scrapes)
    finished = len(report.ok)
    metrics = WindowMetrics(
        source="client",
        duration_s=duration,
        requests_total=total,
        requests_failed=len(report.failed),
        attaining_requests=len(attaining),
        attainment_ratio=len(attaining) / total if total else None,
        ttft_p95_s=percentile(report.ttfts_s(), 0.95),
        inter_token_p95_s=percentile(report.inter_tokens_s(), 0.95),
        output_tokens_per_s=report.output_tokens_per_s() if duration > 0 else None,
        preemptions_total=preemptions,
        preemptions_per_request=(
            preemptions / finished if preemptions is not None and finished else None
        ),
    )
    return metrics, goodput


def _histogram_metrics(
    scrapes: Sequence[VllmScrape], slo: Slo, share_ratio: float = 1.0
) -> tuple[WindowMetrics | None, float | None]:
    if len(scrapes) < 2:
        return None, None
    window = _window(scrapes)
    span = scrapes[-1].taken_at_s - scrapes[0].taken_at_s
    finished = ttft = itl = tokens = None
    keys = window.keys()
    for key in keys:
        hist = window.histogram_over(key, "e2e_latency", span)
        if hist is not None:
            finished = (finished or 0) + hist.count
        gained = window.increase(key, "generation_tokens_total", span)
        if gained is not None:
            tokens = (tokens or 0.0) + gained
        # One engine is the common case; with several, the worst p95 is the window's.
        ttft = _worst(ttft, window.quantiles(key, "ttft", span, (0.95,))[0.95])
        itl = _worst(itl, window.quantiles(key, "inter_token_latency", span, (0.95,))[0.95])
    preemptions = _preemptions(scrapes)
    requests = round(finished) if finished is not None else 0
    rate = tokens / span if tokens is not None and span > 0 else None
    metrics = WindowMetrics(
        source="histograms",
        duration_s=span,
        requests_total=requests,
        requests_failed=0,  # the engine's histograms see only finished requests
        attaining_requests=None,
        attainment_ratio=None,
        ttft_p95_s=ttft,
        inter_token_p95_s=itl,
        output_tokens_per_s=rate,
        preemptions_total=preemptions,
        preemptions_per_request=(
            preemptions / requests if preemptions is not None and requests else None
        ),
    )
    met = _slo_broken(metrics, slo) is None
    goodput = rate / share_ratio if rate is not None and met else None
    return metrics, goodput  # unknown when the SLO is not met: not per request


def _slo_broken(metrics: WindowMetrics, slo: Slo) -> str | None:
    if metrics.attainment_ratio is not None:
        if metrics.attainment_ratio < slo.attainment_target_ratio:
            return (
                f"{metrics.attainment_ratio:.0%} of requests met the SLO "
                f"(TTFT <= {slo.ttft_p95_s:g} s, inter-token p95 <= {slo.inter_token_p95_s:g} s); "
                f"{slo.attainment_target_ratio:.0%} required"
            )
        return None
    if metrics.ttft_p95_s is None or metrics.inter_token_p95_s is None:
        return "latency unknown: the window has no TTFT or inter-token observations"
    if metrics.ttft_p95_s > slo.ttft_p95_s:
        return f"TTFT p95 {metrics.ttft_p95_s:.3g} s > {slo.ttft_p95_s:g} s"
    if metrics.inter_token_p95_s > slo.inter_token_p95_s:
        return f"inter-token p95 {metrics.inter_token_p95_s:.3g} s > {slo.inter_token_p95_s:g} s"
    return None


def _window(scrapes: Sequence[VllmScrape]) -> RollingWindow[EngineSample]:
    span = max(1.0, scrapes[-1].taken_at_s - scrapes[0].taken_at_s + 1.0)
    window: RollingWindow[EngineSample] = RollingWindow(retention_s=span)
    for scrape in scrapes:
        window.add(scrape)
    return window


def _preemptions(scrapes: Sequence[VllmScrape]) -> float | None:
    """Preemptions over the scrapes, summed over engines, resets counted as Prometheus does."""
    if len(scrapes) < 2:
        return None
    window = _window(scrapes)
    span = scrapes[-1].taken_at_s - scrapes[0].taken_at_s
    keys = window.keys()
    values = [window.increase(key, "preemptions_total", span) for key in keys]
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _worst(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else max(a, b)
