from __future__ import annotations

from kvpilot.agent.rules.config import FragmentationSourceConfig, RulesConfig
from kvpilot.agent.rules.fragmentation import FragmentationRule
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.fragmentation import NO_FREE_BYTES, TOO_FEW_FREE_BLOCKS
from tests.agent.rules.rules_helpers import (
    Driver,
    allocator,
    annotation,
    instance,
    kv_block,
    label,
    only,
)


def kv_rule(**cfg: object) -> FragmentationRule:
    return FragmentationRule("kv_blocks", FragmentationSourceConfig(**cfg))  # type: ignore[arg-type]


def test_kv_blocks_above_threshold_is_active_with_labels_and_figures() -> None:
    driver = Driver(kv_rule(labels={"team": "ml"}))
    # 100 free, longest run 50: 1 - 50/100 = 0.5 > 0.30.
    c = only(driver.tick(1.0, kv_blocks=[kv_block(total=1000, free=100, longest=50)]))
    assert c.active is True
    assert c.value == 0.5
    assert c.rule == "fragmentation_kv_blocks"
    assert dict(c.labels) == {
        "alertname": "VllmKvFragmentationHigh",
        "instance": "vllm-0",
        "role": "stable",
        "model_name": "tiny",
        "engine": "0",
        "source": "kv_blocks",
        "severity": "warning",
        "team": "ml",
    }
    assert "0.500" in c.summary and "0.300" in c.summary
    assert "120 s" in (annotation(c, "description") or "")
    assert annotation(c, "runbook")
    assert annotation(c, "action") == "alert"


def test_kv_blocks_below_threshold_is_inactive() -> None:
    driver = Driver(kv_rule())
    c = only(driver.tick(1.0, kv_blocks=[kv_block(total=1000, free=100, longest=80)]))
    assert c.active is False
    assert c.value is not None and abs(c.value - 0.2) < 1e-9


def test_threshold_is_configurable() -> None:
    driver = Driver(kv_rule(threshold_ratio=0.1))
    c = only(driver.tick(1.0, kv_blocks=[kv_block(total=1000, free=100, longest=80)]))
    assert c.active is True


def test_guard_gives_unknown_not_inactive() -> None:
    driver = Driver(kv_rule())
    # 10 free of 1000: below max(16, 2 %) = 20, the guard holds even if it looks scattered.
    c = only(driver.tick(1.0, kv_blocks=[kv_block(total=1000, free=10, longest=1)]))
    assert c.active is None
    assert c.reason == TOO_FEW_FREE_BLOCKS
    assert c.value is None


def test_kvpool_down_makes_known_targets_unknown_with_the_same_labels() -> None:
    driver = Driver(kv_rule())
    first = only(driver.tick(1.0, kv_blocks=[kv_block(total=1000, free=100, longest=50)]))
    error = SourceError("kvpool", "refused", "connection refused")
    c = only(driver.tick(2.0, kvpool_error=error))
    assert c.active is None
    assert c.labels == first.labels
    assert "refused" in (c.reason or "")


def test_kvpool_down_before_any_reading_gives_one_instance_level_unknown() -> None:
    driver = Driver(kv_rule())
    c = only(driver.tick(1.0, kvpool_error=SourceError("kvpool", "timeout", "slow")))
    assert c.active is None
    assert label(c, "alertname") == "VllmKvFragmentationHigh"
    assert label(c, "engine") is None


def test_no_plugin_configured_says_nothing() -> None:
    assert Driver(kv_rule()).tick(1.0) == []


def test_canary_conditions_carry_the_role() -> None:
    driver = Driver(kv_rule(), instance("canary-1", role="canary"))
    c = only(driver.tick(1.0, kv_blocks=[kv_block(total=1000, free=100, longest=50)]))
    assert c.active is True
    assert label(c, "role") == "canary"
    assert label(c, "instance") == "canary-1"


def test_allocator_defaults_to_restart_and_fires_above_threshold() -> None:
    cfg = RulesConfig().fragmentation.allocator
    assert cfg.action == "restart"
    rule = FragmentationRule("allocator", cfg)
    driver = Driver(rule)
    high = only(driver.tick(1.0, allocators=[allocator(0.6)]))
    assert high.active is True
    assert label(high, "source") == "allocator"
    assert label(high, "device") == "0"
    assert annotation(high, "action") == "restart"
    low = only(driver.tick(2.0, allocators=[allocator(0.1)]))
    assert low.active is False
    assert low.labels == high.labels


def test_allocator_without_free_bytes_is_unknown() -> None:
    driver = Driver(FragmentationRule("allocator", FragmentationSourceConfig()))
    c = only(driver.tick(1.0, allocators=[allocator(None, free_in_reserved=0)]))
    assert c.active is None
    assert c.reason == NO_FREE_BYTES


def test_kv_blocks_default_action_is_alert_only() -> None:
    assert RulesConfig().fragmentation.kv_blocks.action == "alert"
    assert RulesConfig().fragmentation.kv_blocks.threshold_ratio == 0.30
