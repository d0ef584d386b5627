"""Per-engine figures a tick derives from the windows: rates and latency quantiles."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.agent.readings.snapshot import Snapshot
from kvpilot.collectors.histogram import quantile
from kvpilot.collectors.kvpool.client import KvBlockSample
from kvpilot.collectors.vllm_metrics import EngineSample, VllmScrape
from kvpilot.collectors.window import RollingWindow

QUANTILES = (0.5, 0.95, 0.99)
# Our name for each latency histogram, and the EngineSample field holding it.
LATENCY_FIELDS = (
    ("ttft", "ttft"),
    ("inter_token", "inter_token_latency"),
    ("e2e", "e2e_latency"),
    ("queue", "queue_time"),
)


@dataclass(frozen=True, slots=True)
class EngineFigures:
    """Rates and quantiles of one engine.

    `span_s` is the time between the oldest and newest scrape the quantiles cover; None
    means a single scrape, so the quantiles are since the server started.
    """

    model_name: str
    engine: str
    span_s: float | None
    preemption_rate_per_s: float | None
    kvpool_preemption_rate_per_s: float | None
    prefix_cache_hit_ratio: float | None
    generation_tokens_per_s: float | None
    iterations_per_s: float | None
    latency_quantiles_s: tuple[tuple[str, float, float | None], ...]


def derive_figures(
    snapshot: Snapshot,
    vllm_window: RollingWindow[EngineSample],
    kvpool_window: RollingWindow[KvBlockSample],
    *,
    rate_span_s: float,
    quantile_span_s: float,
) -> tuple[EngineFigures, ...]:
    """Figures over the windows; with a single scrape, latency quantiles since start-up."""
    if not isinstance(snapshot.vllm, VllmScrape):
        return ()
    figures = []
    for sample in snapshot.vllm.engines:
        key = (sample.model_name, sample.engine)
        # Two scrapes make a window; one alone gives quantiles since the server started.
        covered_s = vllm_window.covered_s(key, quantile_span_s)
        latency: list[tuple[str, float, float | None]] = []
        for name, field in LATENCY_FIELDS:
            if covered_s is not None:
                values = vllm_window.quantiles(key, field, quantile_span_s, QUANTILES)
            else:
                histogram = getattr(sample, field)
                values = {
                    q: None if histogram is None else quantile(q, histogram) for q in QUANTILES
                }
            latency.extend((name, q, values[q]) for q in QUANTILES)
        queries = vllm_window.rate(key, "prefix_cache_queries_total", rate_span_s)
        hits = vllm_window.rate(key, "prefix_cache_hits_total", rate_span_s)
        figures.append(
            EngineFigures(
                model_name=sample.model_name,
                engine=sample.engine,
                span_s=covered_s,
                preemption_rate_per_s=vllm_window.rate(key, "preemptions_total", rate_span_s),
                kvpool_preemption_rate_per_s=_kvpool_rate(
                    kvpool_window, sample.engine, rate_span_s
                ),
                prefix_cache_hit_ratio=None if not queries or hits is None else hits / queries,
                generation_tokens_per_s=vllm_window.rate(
                    key, "generation_tokens_total", rate_span_s
                ),
                iterations_per_s=vllm_window.rate(key, "iterations_total", rate_span_s),
                latency_quantiles_s=tuple(latency),
            )
        )
    return tuple(figures)


def _kvpool_rate(window: RollingWindow[KvBlockSample], engine: str, span_s: float) -> float | None:
    for key in window.keys():  # noqa: SIM118 - a RollingWindow is not a mapping
        if key[1] == engine:
            return window.rate(key, "preemptions_total", span_s)
    return None
