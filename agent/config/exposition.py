"""What kvpilot's own /metrics carries."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvpilot.agent.strict_model import StrictModel


class ExpositionConfig(StrictModel):
    """Which families kvpilot's /metrics renders."""

    vllm_families: Literal["include", "exclude"] = Field(
        "include",
        description="The families that restate vLLM's own /metrics (as read, or as rates and "
        "percentiles over it; the README's metric table marks them): include, or exclude "
        "where Prometheus scrapes vLLM itself. The agent's own rules read vLLM directly either "
        "way; the dashboards' panels and Prometheus rules built on those families see nothing.",
    )
