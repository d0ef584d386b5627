"""Token occupancy (series from the plugin's own exposition), deferred requests (series derived
from vLLM 0.32's source, tests/fixtures/vllm) and the liveness actions each runtime defaults to."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvpilot.agent.config import AgentConfig
from kvpilot.agent.model import Action
from kvpilot.agent.rules.config import RequestsDeferredConfig, TokenOccupancyConfig
from kvpilot.agent.rules.deferred import RequestsDeferredRule
from kvpilot.agent.rules.occupancy import TokenOccupancyRule, recommended_block_size
from kvpilot.collectors.fragmentation import kv_blocks_fragmentation
from kvpilot.collectors.kvpool.blocks import BlockCounts, BlockPoolSnapshot, InternalFragmentation
from kvpilot.collectors.kvpool.client import KvBlockSample, samples_to_scrape
from kvpilot.collectors.kvpool.occupancy import BlockSizeChoice, GroupOccupancy
from kvpilot.collectors.kvpool.occupancy_export import OccupancyCollector
from kvpilot.collectors.kvpool.server import EngineReading, PartErrors
from kvpilot.collectors.promtext import parse_samples
from kvpilot.collectors.vllm_parse import parse_vllm_metrics
from tests.agent.rules.rules_helpers import Driver, annotation, label, only

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm"


def plugin_sample(
    *, used: int, tokens: int, block_size: int = 128, choice: BlockSizeChoice | None = None
) -> KvBlockSample:
    """One engine as the plugin exports it and the agent reads it: a pool of 100 blocks."""
    free = 100 - used
    snap = BlockPoolSnapshot(
        taken_at_s=0.0,
        wall_time_s=0.0,
        block_size_tokens=block_size,
        counts=BlockCounts(100, free, 0, free, free, kv_blocks_fragmentation(free, free, 100)),
        internal=InternalFragmentation(0, 0, None, None, "n/a"),
        occupancy=(GroupOccupancy(0, block_size, used, tokens),),
        block_size_choice=choice or BlockSizeChoice(32, None),
    )
    collector = OccupancyCollector(
        engines=lambda: [EngineReading("0", "m", snap, 0, None, 1)],
        allocators=list,
        errors=PartErrors(),
        clock=lambda: 0.0,
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = generate_latest(registry).decode()
    samples = parse_samples(text, prefixes=("kvpool_",))
    (sample,) = samples_to_scrape(samples, taken_at_s=0.0, wall_time_s=0.0).engines
    return sample


def test_full_blocks_mostly_empty_fire_and_name_a_cpu_block_size() -> None:
    rule = TokenOccupancyRule(TokenOccupancyConfig())
    # 90 blocks of 128 in use holding 40 tokens each: usage 0.9, occupancy 0.3125.
    c = only(Driver(rule).tick(1.0, kv_blocks=[plugin_sample(used=90, tokens=90 * 40)]))
    assert c.active is True and c.value == pytest.approx(40 / 128)
    assert label(c, "kv_group") == "0"
    assert c.for_s == 300.0 and c.facts.action is Action.ALERT
    assert "--block-size 64 (this backend accepts multiples of 32)" in (
        annotation(c, "description") or ""
    )


def test_full_and_well_filled_or_half_empty_pool_do_not_fire() -> None:
    rule = TokenOccupancyRule(TokenOccupancyConfig())
    well_filled = only(Driver(rule).tick(1.0, kv_blocks=[plugin_sample(used=90, tokens=90 * 100)]))
    assert well_filled.active is False
    roomy = only(Driver(rule).tick(1.0, kv_blocks=[plugin_sample(used=50, tokens=50 * 10)]))
    assert roomy.active is False  # low occupancy, but blocks to spare: no capacity lost


def test_thresholds_are_settable() -> None:
    config = TokenOccupancyConfig(usage_above_ratio=0.4, occupancy_below_ratio=0.2, for_s=5)
    c = only(
        Driver(TokenOccupancyRule(config)).tick(
            1.0, kv_blocks=[plugin_sample(used=50, tokens=50 * 20)]
        )
    )
    assert c.active is True and c.for_s == 5.0


def test_fixed_sizes_and_the_smallest_size_recommend_memory_instead() -> None:
    rule = TokenOccupancyRule(TokenOccupancyConfig())
    mla = plugin_sample(used=90, tokens=900, choice=BlockSizeChoice(None, "MLA fixes it"))
    c = only(Driver(rule).tick(1.0, kv_blocks=[mla]))
    assert "cannot change here (MLA fixes it)" in (annotation(c, "description") or "")
    smallest = plugin_sample(used=90, tokens=900, block_size=32)
    c = only(Driver(TokenOccupancyRule(TokenOccupancyConfig())).tick(1.0, kv_blocks=[smallest]))
    assert "already the smallest" in (annotation(c, "description") or "")
    assert [recommended_block_size(b, s) for b, s in ((128, 32), (48, 16), (16, 16))] == [
        64,
        16,
        None,
    ]


def _deferred_series() -> list:  # type: ignore[type-arg]
    return [
        parse_vllm_metrics(
            (FIXTURES / f"derived_deferred_{i}.prom").read_text(),
            taken_at_s=t,
            wall_time_s=t,
        )[0]
        for i, t in enumerate((0.0, 35.0, 70.0))
    ]


def test_requests_deferred_past_the_limit_while_others_run_fire_with_the_rejections() -> None:
    series = _deferred_series()
    assert [s.requests_deferred for s in series] == [2, 2, 2]
    assert [s.admission_rejections_total for s in series] == [0.0, 12.0, 31.0]
    driver = Driver(RequestsDeferredRule(RequestsDeferredConfig(action="restart")))
    first = only(driver.tick(0.0, engines=[series[0]]))
    assert first.active is None  # the start of the deferral was not seen
    assert only(driver.tick(35.0, engines=[series[1]])).active is None
    fired = only(driver.tick(70.0, engines=[series[2]]))
    assert fired.active is True and fired.value == 70.0
    assert fired.facts.action is Action.RESTART
    assert "31 requests refused by a queue limit" in (annotation(fired, "description") or "")


def test_deferral_that_ends_or_a_real_capture_does_not_fire() -> None:
    series = _deferred_series()
    real = parse_vllm_metrics(
        (FIXTURES / "v0_32_under_load.prom").read_text(), taken_at_s=10.0, wall_time_s=10.0
    )[0]
    assert real.requests_deferred == 0 and real.requests_waiting_capacity == 7
    driver = Driver(RequestsDeferredRule(RequestsDeferredConfig()))
    driver.tick(0.0, engines=[series[0]])
    assert only(driver.tick(10.0, engines=[real])).active is False
    # Deferred again from 35 s: 35 s of deferral is under the 60 s limit.
    assert only(driver.tick(35.0, engines=[series[1]])).active is False
    assert only(driver.tick(70.0, engines=[series[2]])).active is False


def _config(runtime: dict[str, object], rules: dict[str, object] | None = None) -> AgentConfig:
    data: dict[str, object] = {"runtime": runtime}
    if rules is not None:
        data["rules"] = rules
    return AgentConfig.model_validate(data)


LOCAL = {"kind": "local", "instances": [{"name": "a", "argv": ["vllm", "serve", "m"]}]}
ATTACH = {"kind": "attach", "servers": [{"name": "a", "url": "http://127.0.0.1:8000"}]}


def test_liveness_rules_restart_by_default_only_where_kvpilot_owns_the_server() -> None:
    local = _config(LOCAL)
    assert local.rules.engine_stall.action == "restart"
    assert local.rules.requests_deferred.action == "restart"
    attach = _config(ATTACH)
    assert attach.rules.engine_stall.action == "alert"
    assert attach.rules.requests_deferred.action == "alert"
    # A part given keeps the runtime's default for the rest; an action given is kept.
    partial = _config(LOCAL, {"engine_stall": {"stall_s": 10}})
    assert (partial.rules.engine_stall.stall_s, partial.rules.engine_stall.action) == (
        10.0,
        "restart",
    )
    kept = _config(LOCAL, {"engine_stall": {"action": "alert"}})
    assert kept.rules.engine_stall.action == "alert"
