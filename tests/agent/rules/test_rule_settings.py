"""A rule carries its own `for_s` and `action` on every condition it emits: no table of rule
names joins them back, so a renamed or new rule still waits its `for_s`."""

from __future__ import annotations

from pathlib import Path

from kvpilot.agent.app.parts import tick_settings
from kvpilot.agent.config import AgentConfig
from kvpilot.agent.model import Action
from kvpilot.agent.rules.config import RulesConfig
from kvpilot.agent.rules.engine import build_rules
from kvpilot.agent.rules.saturation import KvSaturationRule
from kvpilot.agent.state import StateStore
from kvpilot.agent.state.write_failures import WriteFailures
from kvpilot.agent.tick.alert_commit import AlertCommit
from kvpilot.collectors.errors import SourceError
from tests.agent.rules.rules_helpers import Driver, engine

# Each rule a `for_s` of its own and, where it has a choice, an action other than its default.
SETTINGS: dict[str, tuple[float, str]] = {
    "fragmentation_kv_blocks": (11.0, "restart"),
    "fragmentation_allocator": (12.0, "alert"),
    "preemption_spike": (13.0, "restart"),
    "server_down": (14.0, "alert"),
    "kv_saturation": (15.0, "restart"),
    "engine_stall": (16.0, "restart"),
    "requests_deferred": (19.0, "restart"),
    "token_occupancy": (20.0, "alert"),
    "gpu_memory_growth": (17.0, "restart"),
    "gpu_neighbour_pressure": (18.0, "alert"),
    "memory_headroom": (21.0, "alert"),
}


def _rules_config() -> RulesConfig:
    def section(name: str) -> dict[str, object]:
        for_s, action = SETTINGS[name]
        return {"for_s": for_s, "action": action}

    return RulesConfig.model_validate(
        {
            "fragmentation": {
                "kv_blocks": section("fragmentation_kv_blocks"),
                "allocator": section("fragmentation_allocator"),
            },
            **{name: section(name) for name in SETTINGS if not name.startswith("fragmentation_")},
        }
    )


def test_every_rule_puts_its_own_for_s_and_action_on_each_condition() -> None:
    rules = build_rules(_rules_config())
    assert sorted(r.name for r in rules) == sorted(SETTINGS)
    for rule in rules:
        # Every source down: each rule says unknown, once, for the instance.
        conditions = Driver(rule).tick(
            1.0,
            engines=SourceError("vllm", "refused", "connection refused"),
            kvpool_error=SourceError("kvpool", "refused", "connection refused"),
            gpu_state=SourceError("nvml", "timeout", "NVML did not answer"),
        )
        for_s, action = SETTINGS[rule.name]
        assert conditions, rule.name
        assert {(c.for_s, c.facts.action) for c in conditions} == {(for_s, Action(action))}


def test_an_active_condition_carries_the_settings_and_says_the_action_to_people() -> None:
    (rule,) = [r for r in build_rules(_rules_config()) if r.name == "kv_saturation"]
    (c,) = Driver(rule).tick(1.0, engines=[engine(1.0, kv_usage_ratio=1.0, requests_waiting=4)])
    assert c.active is True
    assert (c.for_s, c.facts.action) == (15.0, Action.RESTART)
    assert dict(c.annotations)["action"] == "restart"


class _RenamedSaturation(KvSaturationRule):
    """The saturation rule under a name nothing else in kvpilot knows."""

    name = "kv_cache_full"


def test_a_renamed_rule_still_waits_its_for_s_before_firing(tmp_path: Path) -> None:
    """Through the tick's commit step, as the agent builds it from its configuration."""
    config = AgentConfig.model_validate(
        {
            "state_dir": str(tmp_path),
            "runtime": {
                "kind": "local",
                "instances": [{"name": "vllm", "argv": ["vllm", "serve"]}],
            },
            "rules": {"kv_saturation": {"for_s": 10.0}},
        }
    )
    driver = Driver(_RenamedSaturation(config.rules.kv_saturation))
    wall = 1_700_000_000.0

    def full(t: float) -> list[str]:
        conditions = driver.tick(t, engines=[engine(t, kv_usage_ratio=1.0, requests_waiting=4)])
        assert [c.rule for c in conditions] == ["kv_cache_full"]
        return [t.to_state for t in commit.advance(conditions, [], t, wall + t)]

    with StateStore.open(tmp_path) as store:
        commit = AlertCommit(
            tick_settings(config), store, wall_clock=lambda: wall, write_failures=WriteFailures()
        )
        assert full(0.0) == ["pending"]
        assert full(9.0) == []
        assert full(10.0) == ["firing"]
