"""The one place that builds sources and the ticker from the agent's settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvpilot.agent.config.agent import ScrapeConfig
from kvpilot.agent.readings.snapshot import SnapshotTaker
from kvpilot.agent.tick.calibration import PlannerCheck
from kvpilot.agent.tick.ticker import Ticker
from kvpilot.collectors.kvpool.client import KvPoolSource
from kvpilot.collectors.limits import ScrapeLimits
from kvpilot.collectors.scrape_client import ScrapeClient
from kvpilot.collectors.vllm_metrics import VllmMetricsSource


@dataclass(frozen=True, slots=True)
class CollectSettings:
    vllm_url: str
    kvpool_url: str | None = None
    api_key: str | None = None
    # Every source's deadline for a whole response, body-size cap and sample limit.
    limits: ScrapeLimits = field(default_factory=ScrapeLimits)
    rate_span_s: float = 60.0
    quantile_span_s: float = 60.0
    # The served model's config.json: the planner's prediction is compared with the server.
    model_config: Path | None = None


def scrape_limits(section: ScrapeConfig, interval_s: float) -> ScrapeLimits:
    """The limits the `scrape:` section sets, its deadline resolved against the interval."""
    return ScrapeLimits(
        timeout_s=section.deadline_s(interval_s),
        body_size_limit_bytes=section.body_size_limit_bytes,
        sample_limit=section.sample_limit,
    )


def build_taker(settings: CollectSettings, client: ScrapeClient) -> SnapshotTaker:
    """The sources of one vLLM target, at the addresses `settings` gives."""
    vllm = VllmMetricsSource(
        settings.vllm_url, client=client, limits=settings.limits, api_key=settings.api_key
    )
    kvpool = (
        KvPoolSource(settings.kvpool_url, client=client, limits=settings.limits)
        if settings.kvpool_url
        else None
    )
    return SnapshotTaker(vllm=vllm, kvpool=kvpool)


def build_ticker(
    settings: CollectSettings,
    client: ScrapeClient,
) -> Ticker:
    """Sources and windows for one vLLM target; the caller owns (and closes) the client and
    reads NVML once per tick for every target (`read_nvml`)."""
    return Ticker(
        build_taker(settings, client),
        rate_span_s=settings.rate_span_s,
        quantile_span_s=settings.quantile_span_s,
        planner=PlannerCheck(settings.model_config) if settings.model_config else None,
    )
