"""The one place that builds sources and the ticker from the agent's settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

from kvpilot.agent.tick.calibration import PlannerCheck
from kvpilot.agent.tick.snapshot import SnapshotTaker
from kvpilot.agent.tick.ticker import Ticker
from kvpilot.collectors.kvpool.client import KvPoolSource
from kvpilot.collectors.vllm_metrics import VllmMetricsSource


@dataclass(frozen=True, slots=True)
class CollectSettings:
    vllm_url: str
    kvpool_url: str | None = None
    api_key: str | None = None
    timeout_s: float = 2.0
    rate_span_s: float = 60.0
    quantile_span_s: float = 60.0
    # The served model's config.json: the planner's prediction is compared with the server.
    model_config: Path | None = None


def build_ticker(
    settings: CollectSettings,
    client: httpx.AsyncClient,
) -> Ticker:
    """Sources and windows for one vLLM target; the caller owns (and closes) the client and
    reads NVML once per tick for every target (`read_nvml`)."""
    vllm = VllmMetricsSource(
        settings.vllm_url, client=client, timeout_s=settings.timeout_s, api_key=settings.api_key
    )
    kvpool = (
        KvPoolSource(settings.kvpool_url, client=client, timeout_s=settings.timeout_s)
        if settings.kvpool_url
        else None
    )
    taker = SnapshotTaker(vllm=vllm, kvpool=kvpool)
    return Ticker(
        taker,
        rate_span_s=settings.rate_span_s,
        quantile_span_s=settings.quantile_span_s,
        planner=PlannerCheck(settings.model_config) if settings.model_config else None,
    )
