"""The block-pool adapter against a real vLLM BlockPool, built on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvpilot.collectors.fragmentation import TOO_FEW_FREE_BLOCKS
from kvpilot.collectors.kvpool.blocks import (
    NO_REQUEST_BLOCKS,
    NO_RUNNING_REQUESTS,
    BlockPoolShapeError,
    count_blocks,
    internal_fragmentation,
    snapshot,
)


def _vllm(module: str):  # type: ignore[no-untyped-def]
    """vLLM's module, imported by the first test that needs it: importing vLLM takes
    seconds, which every collection of the suite would pay otherwise."""
    return pytest.importorskip(module)


BLOCK_SIZE = 16


def new_pool(num_gpu_blocks: int, *, caching: bool = True):
    return _vllm("vllm.v1.core.block_pool").BlockPool(num_gpu_blocks, caching, BLOCK_SIZE)


def allocate_all(pool) -> list:
    """Every usable block, in id order (a fresh pool hands them out 1, 2, 3, ...)."""
    blocks = pool.get_new_blocks(pool.get_num_free_blocks())
    assert [b.block_id for b in blocks] == list(range(1, pool.num_gpu_blocks))
    return blocks


def test_all_free() -> None:
    pool = new_pool(101)
    counts = count_blocks(pool)
    assert counts.blocks_total == 100
    assert counts.blocks_free == pool.get_num_free_blocks() == 100
    assert counts.longest_free_run_blocks == 100
    assert counts.fragmentation.ratio == 0.0
    assert counts.blocks_free_cached == 0 and counts.blocks_empty == 100


def test_one_hole() -> None:
    pool = new_pool(101)
    blocks = allocate_all(pool)
    pool.free_blocks([b for b in blocks if b.block_id != 30])
    counts = count_blocks(pool)
    assert counts.blocks_free == pool.get_num_free_blocks() == 99
    assert counts.longest_free_run_blocks == 70
    assert counts.fragmentation.ratio == pytest.approx(1 - 70 / 99)


def test_checkerboard() -> None:
    pool = new_pool(201)
    blocks = allocate_all(pool)
    pool.free_blocks([b for b in blocks if b.block_id % 2 == 1])
    counts = count_blocks(pool)
    assert counts.blocks_free == pool.get_num_free_blocks() == 100
    assert counts.longest_free_run_blocks == 1
    assert counts.fragmentation.ratio == pytest.approx(0.99)


def test_none_free_is_guarded() -> None:
    pool = new_pool(101)
    allocate_all(pool)
    counts = count_blocks(pool)
    assert counts.blocks_free == 0 and counts.longest_free_run_blocks == 0
    assert counts.fragmentation.ratio is None
    assert counts.fragmentation.reason == TOO_FEW_FREE_BLOCKS


def test_few_free_is_guarded() -> None:
    pool = new_pool(1001)
    blocks = allocate_all(pool)
    pool.free_blocks(blocks[:19])  # 19 < max(16, 2 % of 1000 = 20)
    counts = count_blocks(pool)
    assert counts.blocks_free == 19 and counts.longest_free_run_blocks == 19
    assert counts.fragmentation.ratio is None


def test_free_cached_and_empty() -> None:
    pool = new_pool(41)
    blocks = pool.get_new_blocks(6)
    hashes = [_vllm("vllm.v1.core.kv_cache_utils").BlockHash(bytes([i]) * 32) for i in range(6)]
    request = SimpleNamespace(block_hashes=hashes, request_id="r0")
    # The real prefix-caching path: the first four blocks become full and cached.
    pool.cache_full_blocks(request, blocks, 0, 4, BLOCK_SIZE, 0)
    pool.free_blocks(blocks)
    counts = count_blocks(pool)
    assert counts.blocks_free == pool.get_num_free_blocks() == 40
    assert counts.blocks_free_cached == 4
    assert counts.blocks_empty == 36
    # A cached block that is in use again is not free.
    pool.touch([blocks[0]])
    again = count_blocks(pool)
    assert again.blocks_free == pool.get_num_free_blocks() == 39
    assert again.blocks_free_cached == 3


def test_broken_pool_raises_shape_error() -> None:
    with pytest.raises(BlockPoolShapeError):
        count_blocks(object())
    with pytest.raises(BlockPoolShapeError):
        count_blocks(SimpleNamespace(blocks=[object(), object()]))


def fake_scheduler(pool, running, req_to_blocks):
    group = SimpleNamespace(req_to_blocks=req_to_blocks, block_size=BLOCK_SIZE)
    manager = SimpleNamespace(
        block_pool=pool, coordinator=SimpleNamespace(single_type_managers=(group,))
    )
    return SimpleNamespace(kv_cache_manager=manager, running=running, block_size=BLOCK_SIZE)


def test_internal_fragmentation_counts_tail_slots() -> None:
    pool = new_pool(41)
    a_blocks, b_blocks = pool.get_new_blocks(3), pool.get_new_blocks(1)
    running = [
        SimpleNamespace(request_id="a", num_computed_tokens=35),  # 48 slots, 13 unused
        SimpleNamespace(request_id="b", num_computed_tokens=16),  # 16 slots, 0 unused
    ]
    scheduler = fake_scheduler(pool, running, {"a": a_blocks, "b": b_blocks})
    internal = internal_fragmentation(scheduler)
    assert internal.running_requests == 2
    assert internal.reserved_slots == 64 and internal.unused_slots == 13
    assert internal.ratio == pytest.approx(13 / 64)
    snap = snapshot(scheduler, taken_at_s=5.0, wall_time_s=1e9)
    assert snap.block_size_tokens == BLOCK_SIZE and snap.taken_at_s == 5.0
    assert snap.counts.blocks_free == pool.get_num_free_blocks() == 36


def test_internal_fragmentation_unknown_without_requests_or_shape() -> None:
    pool = new_pool(41)
    idle = internal_fragmentation(fake_scheduler(pool, [], {}))
    assert idle.unused_slots is None and idle.reason == NO_RUNNING_REQUESTS
    bare = internal_fragmentation(SimpleNamespace(running=[]))
    assert bare.ratio is None and bare.reason == NO_REQUEST_BLOCKS


def test_snapshot_without_pool_raises_shape_error() -> None:
    with pytest.raises(BlockPoolShapeError):
        snapshot(SimpleNamespace(), taken_at_s=0.0, wall_time_s=0.0)
