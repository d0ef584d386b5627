"""Allocator arithmetic on fixtures shaped like torch.cuda.memory_stats() / memory_snapshot()."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvpilot.collectors.fragmentation import NO_FREE_BYTES
from kvpilot.collectors.kvpool.allocator import allocator_stats_from, read_allocator_stats

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "allocator"


@pytest.fixture(scope="module")
def stats() -> dict:
    return json.loads((FIXTURES / "memory_stats_device0.json").read_text())


@pytest.fixture(scope="module")
def segments() -> list[dict]:
    return json.loads((FIXTURES / "memory_snapshot.json").read_text())


def inactive_sizes(segments: list[dict], device: int) -> list[int]:
    return [
        block["size"]
        for seg in segments
        if seg["device"] == device
        for block in seg["blocks"]
        if block["state"] == "inactive"
    ]


def test_device0_figures(stats: dict, segments: list[dict]) -> None:
    got = allocator_stats_from(0, stats, segments, taken_at_s=3.0, wall_time_s=2e9)
    free = inactive_sizes(segments, 0)
    assert got.reserved_bytes == stats["reserved_bytes.all.current"]
    assert got.allocated_bytes == stats["allocated_bytes.all.current"]
    assert got.inactive_split_bytes == stats["inactive_split_bytes.all.current"]
    assert got.free_in_reserved_bytes == sum(free)
    assert got.largest_free_block_bytes == max(free)
    assert got.segments == sum(1 for seg in segments if seg["device"] == 0)
    assert got.fragmentation.ratio == pytest.approx(1 - max(free) / sum(free))
    assert got.alloc_retries_total == stats["num_alloc_retries"]
    # The fixture is self-consistent: the free split blocks are what torch calls inactive split.
    assert got.free_in_reserved_bytes == got.inactive_split_bytes
    assert (got.taken_at_s, got.wall_time_s) == (3.0, 2e9)


def test_device_filter(stats: dict, segments: list[dict]) -> None:
    other = allocator_stats_from(1, {}, segments, taken_at_s=0.0, wall_time_s=0.0)
    free = inactive_sizes(segments, 1)
    assert other.free_in_reserved_bytes == sum(free) and other.fragmentation.ratio == 0.0
    assert other.reserved_bytes is None  # no stats given: unknown, not zero


def test_no_free_blocks_is_unknown(stats: dict) -> None:
    got = allocator_stats_from(0, stats, [], taken_at_s=0.0, wall_time_s=0.0)
    assert got.fragmentation.ratio is None and got.fragmentation.reason == NO_FREE_BYTES


def test_read_allocator_stats_calls_torch_shape(stats: dict, segments: list[dict]) -> None:
    calls: list[object] = []

    def memory_snapshot(*args, **kwargs):
        calls.append(kwargs)
        if kwargs:
            raise TypeError("older torch: no include_traces")
        return segments

    fake = SimpleNamespace(
        memory_stats=lambda device: stats if device == 0 else {},
        memory_snapshot=memory_snapshot,
    )
    got = read_allocator_stats(0, clock=lambda: 7.0, wall_clock=lambda: 8.0, torch_cuda=fake)
    assert calls == [{"include_traces": False}, {}]
    assert got.device == 0 and got.taken_at_s == 7.0
    assert got.largest_free_block_bytes == max(inactive_sizes(segments, 0))
