"""What a tick reads from the configuration: the sections it needs, handed over by composition
(`kvpilot.agent.app.parts.tick_settings`), never the whole configuration."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.agent.config import NotifierConfig, RetentionConfig
from kvpilot.agent.config.gpu import GpuConfig
from kvpilot.agent.config.runtime import RuntimeConfig
from kvpilot.agent.rules.config import RulesConfig
from kvpilot.collectors.limits import ScrapeLimits


@dataclass(frozen=True, slots=True)
class TickSettings:
    """The tick's sections. A reload replaces `rules` and `notifiers` (`dataclasses.replace`)."""

    interval_s: float
    rules: RulesConfig
    notifiers: tuple[NotifierConfig, ...]
    retention: RetentionConfig
    runtime: RuntimeConfig  # the servers' API key, the configured flags beside the live ones
    gpu: GpuConfig
    scrape_limits: ScrapeLimits  # the `scrape:` section, its deadline resolved
    learn_workload: bool  # `tuning.learn.enabled`: the stable server's traffic is learned
    alerts_url: str  # the control API's alert list, the notifications' generator URL
