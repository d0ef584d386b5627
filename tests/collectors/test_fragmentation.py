"""The fragmentation formula: runs over free block ids, the guard, allocator chunks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.collectors.fragmentation import (
    NO_FREE_BYTES,
    TOO_FEW_FREE_BLOCKS,
    from_free_chunks,
    from_free_flags,
    guard_min_free_blocks,
    kv_blocks_fragmentation,
    scan_free_flags,
)


def flags_with_null(free_ids: set[int], total: int) -> list[bool]:
    """Flags indexed by block id; index 0 is the null block, flagged free to prove it is ignored."""
    return [True] + [block_id in free_ids for block_id in range(1, total + 1)]


def test_all_free_is_zero() -> None:
    frag = from_free_flags(flags_with_null(set(range(1, 101)), 100))
    assert (frag.free, frag.longest_free_run, frag.total) == (100, 100, 100)
    assert frag.ratio == 0.0 and frag.reason is None


def test_one_hole_splits_the_run() -> None:
    free = set(range(1, 101)) - {41}
    frag = from_free_flags(flags_with_null(free, 100))
    assert frag.free == 99 and frag.longest_free_run == 59
    assert frag.ratio == pytest.approx(1 - 59 / 99)


def test_checkerboard_is_nearly_one() -> None:
    free = set(range(1, 201, 2))
    frag = from_free_flags(flags_with_null(free, 200))
    assert frag.free == 100 and frag.longest_free_run == 1
    assert frag.ratio == pytest.approx(0.99)


def test_null_block_is_never_counted() -> None:
    # Block 0 free would otherwise join the run starting at block 1.
    frag = from_free_flags([True, True, False] + [True] * 20)
    assert frag.free == 21 and frag.longest_free_run == 20 and frag.total == 22


def test_guard_thresholds() -> None:
    assert guard_min_free_blocks(100) == 16
    assert guard_min_free_blocks(800) == 16
    assert guard_min_free_blocks(801) == 17  # 2 % of 801 is 16.02, rounded up
    assert guard_min_free_blocks(10_000) == 200


def test_guarded_below_threshold_is_unknown_not_zero() -> None:
    frag = kv_blocks_fragmentation(free=15, longest_free_run=15, total=100)
    assert frag.ratio is None and frag.reason == TOO_FEW_FREE_BLOCKS
    at_threshold = kv_blocks_fragmentation(free=16, longest_free_run=8, total=100)
    assert at_threshold.ratio == pytest.approx(0.5) and at_threshold.reason is None


def test_none_free_is_guarded() -> None:
    frag = from_free_flags(flags_with_null(set(), 50))
    assert frag.free == 0 and frag.ratio is None and frag.reason == TOO_FEW_FREE_BLOCKS


def test_empty_pool() -> None:
    assert scan_free_flags([]) == (0, 0)
    assert from_free_flags([True]).total == 0


def test_allocator_chunks() -> None:
    frag = from_free_chunks([2 << 20, 1 << 20, 0, 1 << 20], total=64 << 20)
    assert frag.free == 4 << 20 and frag.longest_free_run == 2 << 20
    assert frag.ratio == pytest.approx(0.5) and frag.total == 64 << 20


def test_allocator_without_free_bytes_is_unknown() -> None:
    frag = from_free_chunks([], total=1 << 20)
    assert frag.ratio is None and frag.reason == NO_FREE_BYTES


def brute_force_longest(flags: list[bool]) -> int:
    best = 0
    for start in range(1, len(flags)):
        length = 0
        while start + length < len(flags) and flags[start + length]:
            length += 1
        best = max(best, length)
    return best


@given(st.lists(st.booleans(), min_size=1, max_size=300))
def test_scan_matches_brute_force(flags: list[bool]) -> None:
    free, longest = scan_free_flags(flags)
    assert free == sum(flags[1:])
    assert longest == brute_force_longest(flags)
    frag = from_free_flags(flags)
    if frag.ratio is not None:
        assert 0.0 <= frag.ratio < 1.0
        assert frag.free >= guard_min_free_blocks(frag.total)
