"""Token occupancy per KV group, against a real vLLM BlockPool, through the plugin's exposition
and back through the agent's reader."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvpilot.collectors.kvpool.blocks import snapshot
from kvpilot.collectors.kvpool.client import NO_BLOCKS_IN_USE, samples_to_scrape
from kvpilot.collectors.kvpool.occupancy import (
    FIXED_HYBRID,
    FIXED_MLA,
    block_size_choice,
    group_occupancy,
)
from kvpilot.collectors.kvpool.occupancy_export import OccupancyCollector
from kvpilot.collectors.kvpool.server import EngineReading, PartErrors
from kvpilot.collectors.promtext import parse_samples

BLOCK_SIZE = 32


def new_pool(num_gpu_blocks: int):  # type: ignore[no-untyped-def]
    module = pytest.importorskip("vllm.v1.core.block_pool")
    return module.BlockPool(num_gpu_blocks, False, BLOCK_SIZE)


def scheduler(pool, requests, req_to_blocks, *, device="cpu", use_mla=False, groups=1):  # type: ignore[no-untyped-def]
    group = SimpleNamespace(req_to_blocks=req_to_blocks, block_size=BLOCK_SIZE)
    manager = SimpleNamespace(
        block_pool=pool, coordinator=SimpleNamespace(single_type_managers=(group,) * groups)
    )
    config = SimpleNamespace(
        model_config=SimpleNamespace(use_mla=use_mla),
        device_config=SimpleNamespace(device_type=device),
    )
    return SimpleNamespace(
        kv_cache_manager=manager,
        requests={r.request_id: r for r in requests},
        running=list(requests),
        block_size=BLOCK_SIZE,
        vllm_config=config,
    )


def test_33_token_prompts_fill_two_blocks_of_32_to_33_of_64() -> None:
    pool = new_pool(101)
    requests = [SimpleNamespace(request_id=f"r{i}", num_computed_tokens=33) for i in range(4)]
    held = {r.request_id: pool.get_new_blocks(2) for r in requests}
    (group,) = group_occupancy(scheduler(pool, requests, held))
    assert (group.blocks_in_use, group.tokens) == (8, 4 * 33)
    assert group.ratio == pytest.approx(33 / 64)
    # Block usage on the same pool says 8 of 100 used whatever the fill: the two differ.
    assert pool.get_num_free_blocks() == 92


def test_a_shared_block_counts_once_with_its_fullest_holder_and_null_blocks_not_at_all() -> None:
    pool = new_pool(41)
    shared, tail_a, tail_b = pool.get_new_blocks(3)
    null = pool.null_block
    requests = [
        SimpleNamespace(request_id="a", num_computed_tokens=40),  # 32 in shared, 8 in tail_a
        SimpleNamespace(request_id="b", num_computed_tokens=50),  # 32 in shared, 18 in tail_b
        SimpleNamespace(request_id="c", num_computed_tokens=64),  # a skipped window, then 32
    ]
    held = {"a": [shared, tail_a], "b": [shared, tail_b], "c": [null, shared]}
    (group,) = group_occupancy(scheduler(pool, requests, held))
    assert group.blocks_in_use == 3
    assert group.tokens == 32 + 8 + 18
    assert group.ratio == pytest.approx(58 / 96)


def test_no_blocks_in_use_is_unknown_not_zero() -> None:
    (group,) = group_occupancy(scheduler(new_pool(41), [], {}))
    assert group.blocks_in_use == 0 and group.ratio is None
    assert group_occupancy(SimpleNamespace()) == ()


@pytest.mark.parametrize(
    ("device", "use_mla", "groups", "step", "fixed"),
    [
        ("cpu", False, 1, 32, None),
        ("cuda", False, 1, 16, None),
        ("cuda", True, 1, None, FIXED_MLA),
        ("cuda", False, 2, None, FIXED_HYBRID),
        ("tpu", False, 1, None, None),
    ],
)
def test_block_sizes_the_backend_accepts(
    device: str, use_mla: bool, groups: int, step: int | None, fixed: str | None
) -> None:
    sched = scheduler(None, [], {}, device=device, use_mla=use_mla)
    choice = block_size_choice(sched, groups)
    assert (choice.step_tokens, choice.fixed_reason) == (step, fixed)


def _round_trip(readings: list[EngineReading]):  # type: ignore[no-untyped-def]
    """The plugin's exposition text, read back as the agent reads it."""
    collector = OccupancyCollector(
        engines=lambda: readings, allocators=list, errors=PartErrors(), clock=lambda: 0.0
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = generate_latest(registry).decode()
    return text, samples_to_scrape(
        parse_samples(text, prefixes=("kvpool_",)), taken_at_s=1.0, wall_time_s=2.0
    )


def test_exported_and_read_back_per_group() -> None:
    pool = new_pool(101)
    requests = [SimpleNamespace(request_id=f"r{i}", num_computed_tokens=33) for i in range(4)]
    held = {r.request_id: pool.get_new_blocks(2) for r in requests}
    snap = snapshot(scheduler(pool, requests, held), taken_at_s=0.0, wall_time_s=0.0)
    reading = EngineReading("0", "m", snap, 0, None, 7)
    text, scrape = _round_trip([reading])
    assert 'kvpool_token_occupancy_ratio{engine="0",kv_group="0",model_name="m"} 0.515625' in text
    (sample,) = scrape.engines
    (group,) = sample.occupancy
    assert (group.kv_group, group.blocks_in_use, group.tokens) == ("0", 8, 132)
    assert group.ratio == pytest.approx(33 / 64)
    assert sample.block_size_step_tokens == 32 and sample.block_size_fixed_reason is None
    assert sample.blocks_total == 100 and sample.blocks_free == 92  # the base families stay


def test_idle_group_reads_back_unknown_with_its_reason() -> None:
    snap = snapshot(scheduler(new_pool(41), [], {}), taken_at_s=0.0, wall_time_s=0.0)
    _, scrape = _round_trip([EngineReading("0", "m", snap, 0, None, 0)])
    (group,) = scrape.engines[0].occupancy
    assert group.ratio is None and group.reason == NO_BLOCKS_IN_USE


def test_contradictory_counts_are_refused() -> None:
    lines = [
        'kvpool_blocks_usable{engine="0",model_name="m"} 100',
        'kvpool_group_blocks_in_use{engine="0",kv_group="0",model_name="m"} 2',
        'kvpool_group_tokens_in_use{engine="0",kv_group="0",model_name="m"} 65',
        'kvpool_group_block_size_tokens{engine="0",kv_group="0",model_name="m"} 32',
    ]
    samples = parse_samples("\n".join(lines) + "\n", prefixes=("kvpool_",))
    (sample,) = samples_to_scrape(samples, taken_at_s=0.0, wall_time_s=0.0).engines
    (group,) = sample.occupancy
    assert group.ratio is None and "contradict" in (group.reason or "")
    assert any(r.field == "occupancy[0]" for r in sample.refused)
