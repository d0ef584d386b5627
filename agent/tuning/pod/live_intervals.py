"""What a live canary is judged on: per-interval figures from two scrapes of one pod's /metrics.

Latencies are per-interval *means* (the deltas of a histogram's `_sum` over its `_count`),
not quantile estimates. A mean is exact; a quantile interpolated inside vLLM's coarse buckets
from the handful of requests a 10 % share finishes in an interval moves in steps and ties,
which blunts the judge's rank test. The SLO, a p95, is held against each interval's p95
estimated from the bucket deltas (as `histogram_quantile` does): the only p95 there is, and
the one the objective uses for the whole window.

Errors are what clients got: 5xx answers of the `/v1/` endpoints (`http_requests_total`,
which vLLM's API server exports) plus requests the engine finished with `error`, over every
answer. An engine error in a request that is not streamed may count twice: an upper bound,
the safe side for a canary. Goodput is the generation-token rate divided by the share of the
traffic the pod received, and 0 in an interval whose p95s break the SLO.

The judge pairs the two pods' intervals of the same scrape ticks (`interval_samples`): they
shared the arrivals and the load, which a busy interval brings to both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

from kvpilot.collectors.histogram import Histogram, add, delta, quantile
from kvpilot.collectors.promtext import scan
from kvpilot.collectors.vllm_parse import EngineSample, VllmScrape, parse_vllm_metrics
from kvpilot.tuner.judge.evidence import Counts, Samples
from kvpilot.tuner.problem.objective import Slo
from kvpilot.tuner.rollout.ports import IntervalSamples

_HTTP = "http_requests_total"
_FINISHED = "vllm:request_success_total"


@dataclass(frozen=True, slots=True)
class PodReading:
    """One scrape of one pod: its engines, and the request counters the engine sample omits."""

    scrape: VllmScrape
    answered_total: float | None  # http_requests_total of the /v1/ endpoints, every status
    failed_total: float | None  # 5xx answers plus the engine's finished_reason="error"

    @property
    def taken_at_s(self) -> float:
        return self.scrape.taken_at_s


def read_pod(
    text: str, *, taken_at_s: float, wall_time_s: float, sample_limit: int | None = None
) -> PodReading | None:
    """The reading of one /metrics body; None when it has no vllm: family (stats disabled).
    Raises MetricsParseError (and its SampleLimitError) as the parser does."""
    engines = parse_vllm_metrics(
        text, taken_at_s=taken_at_s, wall_time_s=wall_time_s, sample_limit=sample_limit
    )
    if not engines:
        return None
    answered = failed = engine_errors = None
    for name, labels, value in scan(text, prefixes=(_HTTP, _FINISHED), sample_limit=sample_limit):
        label = dict(labels)
        if name == _HTTP and label.get("handler", "").startswith("/v1/"):
            answered = (answered or 0.0) + value
            if label.get("status", "").startswith("5"):
                failed = (failed or 0.0) + value
            else:
                failed = failed or 0.0
        elif name == _FINISHED and label.get("finished_reason") == "error":
            engine_errors = (engine_errors or 0.0) + value
    if engine_errors is not None:
        failed = (failed or 0.0) + engine_errors
    scrape = VllmScrape(taken_at_s, wall_time_s, engines, None)
    return PodReading(scrape, answered, failed)


@dataclass(frozen=True, slots=True)
class Interval:
    """What one pod did between two scrapes; None where its /metrics could not tell."""

    span_s: float
    finished: float  # requests the engines finished (the end-to-end histogram's count)
    ttft_mean_s: float | None
    inter_token_mean_s: float | None
    e2e_mean_s: float | None
    ttft_p95_s: float | None
    inter_token_p95_s: float | None
    preemptions: float | None
    generation_tokens: float | None
    answered: float | None
    failed: float | None

    @property
    def errors_ratio(self) -> float | None:
        if self.answered is None or self.failed is None or self.answered <= 0:
            return None
        return min(1.0, self.failed / self.answered)

    @property
    def preemptions_per_request(self) -> float | None:
        if self.preemptions is None or self.finished <= 0:
            return None
        return self.preemptions / self.finished

    def latency_breach(self, slo: Slo) -> str | None:
        """Why the interval's p95s break the SLO's latency limits, or None."""
        if self.ttft_p95_s is not None and self.ttft_p95_s > slo.ttft_p95_s:
            return f"TTFT p95 {self.ttft_p95_s:.3g} s > {slo.ttft_p95_s:g} s"
        if self.inter_token_p95_s is not None and self.inter_token_p95_s > slo.inter_token_p95_s:
            return f"inter-token p95 {self.inter_token_p95_s:.3g} s > {slo.inter_token_p95_s:g} s"
        return None

    def slo_breach(self, slo: Slo) -> str | None:
        """Why the interval breaks the SLO (latency p95s, failed requests), or None."""
        ratio = self.errors_ratio
        if ratio is not None and ratio > slo.max_failed_ratio:
            return (
                f"{self.failed:g} of {self.answered:g} requests failed "
                f"(allowed ratio {slo.max_failed_ratio:g})"
            )
        return self.latency_breach(slo)


def interval(older: PodReading, newer: PodReading) -> Interval:
    """The figures between two readings of one pod; counters that went down restarted at 0."""
    before = {e.key: e for e in older.scrape.engines}
    ttft = itl = e2e = None
    preemptions = tokens = None
    for engine in newer.scrape.engines:
        old = before.get(engine.key)
        ttft = _sum_hist(ttft, _hist_delta(engine, old, "ttft"))
        itl = _sum_hist(itl, _hist_delta(engine, old, "inter_token_latency"))
        e2e = _sum_hist(e2e, _hist_delta(engine, old, "e2e_latency"))
        preemptions = _plus(preemptions, _counter_delta(engine, old, "preemptions_total"))
        tokens = _plus(tokens, _counter_delta(engine, old, "generation_tokens_total"))
    return Interval(
        span_s=newer.taken_at_s - older.taken_at_s,
        finished=e2e.count if e2e is not None else 0.0,
        ttft_mean_s=_mean(ttft),
        inter_token_mean_s=_mean(itl),
        e2e_mean_s=_mean(e2e),
        ttft_p95_s=_p95(ttft),
        inter_token_p95_s=_p95(itl),
        preemptions=preemptions,
        generation_tokens=tokens,
        answered=_delta(older.answered_total, newer.answered_total),
        failed=_delta(older.failed_total, newer.failed_total),
    )


def restarted(older: PodReading, newer: PodReading) -> bool:
    """Whether the pod's process restarted between the readings: a cumulative counter (its
    finished requests, generated tokens, answered requests) went down."""
    before = {e.key: e for e in older.scrape.engines}
    for engine in newer.scrape.engines:
        old = before.get(engine.key)
        if old is None:
            continue
        new_e2e, old_e2e = engine.e2e_latency, old.e2e_latency
        pairs = [
            (getattr(engine, field), getattr(old, field))
            for field in ("generation_tokens_total", "preemptions_total")
        ]
        pairs.append((new_e2e and new_e2e.count, old_e2e and old_e2e.count))
        if any(new is not None and was is not None and new < was for new, was in pairs):
            return True
    new_answered, old_answered = newer.answered_total, older.answered_total
    return new_answered is not None and old_answered is not None and new_answered < old_answered


def intervals(readings: Sequence[PodReading]) -> list[Interval]:
    """The intervals between consecutive readings."""
    return [interval(a, b) for a, b in pairwise(readings)]


# Preemptions per request over fewer finished requests than this are noise, not a breach.
MIN_FINISHED_FOR_PREEMPTION_BREACH = 10


def preemption_breach(spans: Iterable[Interval], slo: Slo) -> str | None:
    """Why the analysis so far breaks the SLO's preemptions per request, or None: taken over
    every interval since it began (one interval's two requests would abort on one preemption)."""
    finished = preempted = 0.0
    for span in spans:
        if span.preemptions is None:
            continue
        finished += span.finished
        preempted += span.preemptions
    if finished < MIN_FINISHED_FOR_PREEMPTION_BREACH:
        return None
    ratio = preempted / finished
    if ratio <= slo.max_preemptions_per_request:
        return None
    return (
        f"{preempted:g} preemptions in {finished:g} finished requests, {ratio:.2g} per request "
        f"(allowed {slo.max_preemptions_per_request:g})"
    )


def judge_samples(
    spans: Iterable[Interval], readings: Sequence[PodReading], share_ratio: float, slo: Slo
) -> dict[str, Samples]:
    """The judge's samples: one per interval and metric where the interval tells it; errors
    and preemptions as counts over the whole analysis (failed of answered requests,
    preemptions over finished requests)."""
    out: dict[str, list[float]] = {
        "ttft_s": [],
        "inter_token_s": [],
        "e2e_s": [],
        "goodput_tokens_per_s": [],
        "kv_usage_ratio": [],
    }
    failed = answered = preempted = finished = 0.0
    errors_known = preemptions_known = False
    for span in spans:
        for name, value in (
            ("ttft_s", span.ttft_mean_s),
            ("inter_token_s", span.inter_token_mean_s),
            ("e2e_s", span.e2e_mean_s),
        ):
            if value is not None:
                out[name].append(value)
        if span.errors_ratio is not None and span.failed is not None and span.answered:
            failed += min(span.failed, span.answered)
            answered += span.answered
            errors_known = True
        if span.preemptions is not None:
            preempted += span.preemptions
            finished += span.finished
            preemptions_known = True
        if span.generation_tokens is not None and span.span_s > 0:
            rate = span.generation_tokens / span.span_s / share_ratio
            out["goodput_tokens_per_s"].append(0.0 if span.latency_breach(slo) else rate)
    for reading in readings:
        usage = [e.kv_usage_ratio for e in reading.scrape.engines if e.kv_usage_ratio is not None]
        if usage:
            out["kv_usage_ratio"].append(max(usage))
    judged: dict[str, Samples] = {name: tuple(values) for name, values in out.items()}
    judged["errors_ratio"] = Counts(failed, answered) if errors_known else ()
    judged["preemptions_per_request"] = Counts(preempted, finished) if preemptions_known else ()
    return judged


def interval_samples(
    ticks: Sequence[int], readings: Sequence[PodReading], share_ratio: float, slo: Slo
) -> tuple[IntervalSamples, ...]:
    """The judge's samples interval by interval (`judge_samples` of each alone), each with
    the scrape ticks it spans; `ticks[i]` is the tick `readings[i]` was taken on. A failed
    scrape's gap makes one interval of two ticks: the other side has no interval like it."""
    taken = list(zip(ticks, readings, strict=True))
    return tuple(
        IntervalSamples(
            start, end, judge_samples([interval(older, newer)], [newer], share_ratio, slo)
        )
        for (start, older), (end, newer) in pairwise(taken)
    )


def _hist_delta(engine: EngineSample, old: EngineSample | None, field: str) -> Histogram | None:
    new_h: Histogram | None = getattr(engine, field)
    old_h: Histogram | None = None if old is None else getattr(old, field)
    if new_h is None:
        return None
    return new_h if old_h is None else delta(new_h, old_h)


def _sum_hist(total: Histogram | None, more: Histogram | None) -> Histogram | None:
    if total is None or more is None:
        return more if total is None else total
    summed = add(total, more)
    return summed if summed is not None else total  # engines with other buckets: keep one


def _counter_delta(engine: EngineSample, old: EngineSample | None, field: str) -> float | None:
    new_v: float | None = getattr(engine, field)
    old_v: float | None = None if old is None else getattr(old, field)
    if new_v is None:
        return None
    return new_v if old_v is None else _delta(old_v, new_v)


def _delta(old: float | None, new: float | None) -> float | None:
    if old is None or new is None:
        return None
    return new - old if new >= old else new  # a restart counts from 0


def _plus(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else a + b


def _mean(h: Histogram | None) -> float | None:
    return h.sum / h.count if h is not None and h.count > 0 else None


def _p95(h: Histogram | None) -> float | None:
    return quantile(0.95, h) if h is not None and h.count > 0 else None
