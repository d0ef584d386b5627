"""`tuning.canary`: replayed or live traffic, and the checks that keep its windows judgeable."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvpilot.agent.config.tuning import CanaryConfig, TuningConfig


def test_the_default_is_todays_replay() -> None:
    canary = TuningConfig().canary
    assert canary.traffic == "replay"
    assert (canary.weight_percent, canary.warmup_s, canary.analysis_s) == (10, 120, 600)
    assert (canary.analysis_interval_s, canary.bake_s, canary.gateway) == (30, 600, None)


def test_gateway_traffic_reads_its_route_and_services() -> None:
    canary = CanaryConfig.model_validate(
        {"traffic": "gateway", "weight_percent": 5, "gateway": {"httproute": "llm"}}
    )
    assert canary.gateway is not None
    assert (canary.gateway.httproute, canary.gateway.stable_service) == ("llm", "vllm")
    assert canary.gateway.canary_service == "vllm-kvpilot-canary"


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"traffic": "gateway"}, "traffic: gateway needs a gateway block"),
        ({"traffic": "service", "gateway": {}}, "read only with traffic: gateway, not service"),
        ({"weight_percent": 0}, "greater than or equal to 1"),
        ({"weight_percent": 80}, "less than or equal to 50"),
        ({"analysis_s": 60, "analysis_interval_s": 30}, "the judge needs at least 5 samples"),
        ({"analysis_interval_s": 0.5}, "greater than or equal to 1"),
        ({"warmup_s": -1}, "greater than or equal to 0"),
        ({"traffic": "mirror"}, "'replay', 'service' or 'gateway'"),
        ({"gateway": {"httproute": ""}, "traffic": "gateway"}, "at least 1 character"),
    ],
)
def test_bad_canary_settings_say_what_is_wrong(given: dict[str, object], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        CanaryConfig.model_validate(given)


def test_live_traffic_needs_a_canary_beside_the_stable_pod() -> None:
    with pytest.raises(ValidationError, match="canary traffic service needs strategy: parallel"):
        TuningConfig.model_validate({"strategy": "sequential", "canary": {"traffic": "service"}})
    assert TuningConfig.model_validate({"strategy": "sequential"}).canary.traffic == "replay"
