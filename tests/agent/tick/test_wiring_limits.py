"""The `scrape:` section becomes every source's limits; the deadline follows the interval."""

from __future__ import annotations

import pytest

from kvpilot.agent.config import ConfigError, validate_config
from kvpilot.agent.tick.wiring import scrape_limits
from kvpilot.collectors.limits import ScrapeLimits

RUNTIME = {"kind": "attach", "servers": [{"name": "a", "url": "http://127.0.0.1:8000"}]}


@pytest.mark.parametrize(
    ("interval_s", "deadline_s"), [(0.5, 2.0), (1.0, 2.0), (3.0, 3.0), (60.0, 5.0)]
)
def test_the_default_deadline_is_the_interval_within_two_to_five_seconds(
    interval_s: float, deadline_s: float
) -> None:
    config = validate_config({"runtime": RUNTIME, "interval_s": interval_s}, warn=False)
    assert scrape_limits(config.scrape, config.interval_s) == ScrapeLimits(timeout_s=deadline_s)


def test_the_section_sets_every_limit() -> None:
    scrape = {"timeout_s": 0.25, "body_size_limit_bytes": 4096, "sample_limit": 50}
    config = validate_config({"runtime": RUNTIME, "scrape": scrape}, warn=False)
    assert scrape_limits(config.scrape, config.interval_s) == ScrapeLimits(0.25, 4096, 50)


@pytest.mark.parametrize(
    "scrape", [{"timeout_s": 0}, {"body_size_limit_bytes": -1}, {"sample_limit": 0}, {"x": 1}]
)
def test_impossible_limits_are_configuration_errors(scrape: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        validate_config({"runtime": RUNTIME, "scrape": scrape}, warn=False)
