from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvpilot.agent.model import Condition
from kvpilot.agent.rules.base import RuleContext
from kvpilot.agent.rules.config import RulesConfig
from kvpilot.agent.rules.engine import RuleEngine, build_rules
from tests.agent.rules.rules_helpers import Driver, engine, instance, label


class _Broken:
    name = "broken"

    def evaluate(self, ctx: RuleContext) -> list[Condition]:
        raise RuntimeError("boom")


class _Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[RuleContext] = []

    def evaluate(self, ctx: RuleContext) -> list[Condition]:
        self.seen.append(ctx)
        return []


def test_defaults_build_every_rule_and_disabled_ones_are_left_out() -> None:
    names = [r.name for r in build_rules(RulesConfig())]
    assert names == [
        "fragmentation_kv_blocks",
        "fragmentation_allocator",
        "preemption_spike",
        "server_down",
        "kv_saturation",
        "memory_headroom",
        "engine_stall",
        "requests_deferred",
        "token_occupancy",
        "gpu_memory_growth",
        "gpu_neighbour_pressure",
    ]
    cfg = RulesConfig.model_validate({"engine_stall": {"enabled": False}})
    assert "engine_stall" not in [r.name for r in build_rules(cfg)]


def test_every_rule_sees_the_same_context_and_a_broken_rule_is_unknown() -> None:
    first, second = _Recorder(), _Recorder()
    rules = RuleEngine([first, _Broken(), second])
    driver = Driver(first, instance("canary-1", role="canary"))
    driver.tick(1.0, engines=[engine(1.0)])  # fills the windows
    ctx = first.seen[-1]
    out = rules.evaluate_context(ctx)
    assert second.seen[-1] is ctx and first.seen[-1] is ctx
    assert len(out) == 1
    assert out[0].active is None and "boom" in (out[0].reason or "")
    assert label(out[0], "role") == "canary"
    assert rules.errors_total == {"broken": 1}


def test_engine_on_defaults_evaluates_a_real_snapshot() -> None:
    rules = RuleEngine.from_config(RulesConfig())
    recorder = _Recorder()
    driver = Driver(recorder)
    sample = engine(
        1.0,
        kv_usage_ratio=1.0,
        requests_waiting=4,
        requests_running=3,
        iterations_total=5.0,
        preemptions_total=0.0,
    )
    driver.tick(1.0, engines=[sample])
    out = rules.evaluate_context(recorder.seen[-1])
    by_rule = {c.rule: c.active for c in out}
    assert by_rule == {
        "preemption_spike": None,  # one reading only
        "kv_saturation": True,
        "engine_stall": None,  # no progress seen yet
        "requests_deferred": None,  # the by-reason gauge not given
        "server_down": None,  # no runtime state given
        # Neither NVML nor dcgm-exporter here: unknown with the reason, never nothing.
        "gpu_memory_growth": None,
        "gpu_neighbour_pressure": None,
    }


@pytest.mark.parametrize(
    ("data", "where", "words"),
    [
        ({"kv_saturaton": {}}, "kv_saturaton", "Extra inputs"),
        ({"preemption_spike": {"window_s": 0}}, "preemption_spike.window_s", "greater than 0"),
        (
            {"preemption_spike": {"window_s": 60, "baseline_window_s": 30}},
            "preemption_spike",
            "must be longer",
        ),
        ({"fragmentation": {"kv_blocks": {"threshold_ratio": 1.5}}}, "threshold_ratio", "less"),
        ({"fragmentation": {"allocator": {"action": "reboot"}}}, "action", "'alert'"),
        ({"gpu_neighbour_pressure": {"action": "restart"}}, "action", "'alert'"),
        ({"kv_saturation": {"labels": {"instance": "x"}}}, "labels", "set by kvpilot"),
        ({"kv_saturation": {"labels": {"1bad": "x"}}}, "labels", "not a valid"),
        ({"engine_stall": {"severity": "meh"}}, "severity", "critical"),
    ],
)
def test_invalid_configs_name_the_field_and_problem(data, where, words) -> None:
    with pytest.raises(ValidationError) as info:
        RulesConfig.model_validate(data)
    text = str(info.value)
    assert where in text and words in text


def test_schema_has_descriptions_everywhere_and_models_are_frozen() -> None:
    schema = RulesConfig.model_json_schema()
    for model in schema["$defs"].values():
        for name, prop in model.get("properties", {}).items():
            assert prop.get("description"), (model["title"], name)
    cfg = RulesConfig()
    with pytest.raises(ValidationError):
        cfg.kv_saturation.for_s = 3  # type: ignore[misc]
    assert cfg.preemption_spike.action == "ladder"
    assert {"alert", "ladder", "restart"} == set(
        schema["$defs"]["PreemptionSpikeConfig"]["properties"]["action"]["enum"]
    )
