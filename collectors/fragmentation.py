"""The fragmentation formula, the one place it lives: 1 - longest_free_run / free.

Two pools use it. The KV block pool passes free flags indexed by block id (block 0 is
vLLM's null block and is never counted); the CUDA caching allocator passes the sizes of
the free chunks inside its reserved segments.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

TOO_FEW_FREE_BLOCKS = "too few free blocks"
NO_FREE_BYTES = "no free bytes in reserved segments"

# The guard: below max(16, 2 % of total) free blocks the rate says nothing useful.
GUARD_MIN_FREE_BLOCKS = 16
GUARD_MIN_FREE_PERCENT = 2


@dataclass(frozen=True, slots=True)
class Fragmentation:
    """One reading of a pool: `ratio` is None exactly when `reason` says why."""

    free: int
    longest_free_run: int
    total: int
    ratio: float | None
    reason: str | None


def guard_min_free_blocks(total: int) -> int:
    """The fewest free blocks for which the KV-block rate is defined."""
    # Integer ceil of 2 % so the threshold never depends on float rounding.
    return max(GUARD_MIN_FREE_BLOCKS, -(-total * GUARD_MIN_FREE_PERCENT // 100))


def scan_free_flags(flags: Sequence[object]) -> tuple[int, int]:
    """(free, longest run of consecutive free ids) over flags indexed by block id, skipping 0."""
    free = longest = run = 0
    # One tight loop: it runs inside the engine, and measured faster than split/groupby.
    for flag in islice(flags, 1, None):
        if flag:
            free += 1
            run += 1
        else:
            if run > longest:
                longest = run
            run = 0
    if run > longest:
        longest = run
    return free, longest


def kv_blocks_fragmentation(free: int, longest_free_run: int, total: int) -> Fragmentation:
    """The KV-block rate from counts already taken; guarded when few blocks are free."""
    if free < guard_min_free_blocks(total):
        return Fragmentation(free, longest_free_run, total, None, TOO_FEW_FREE_BLOCKS)
    return Fragmentation(free, longest_free_run, total, 1.0 - longest_free_run / free, None)


def from_free_flags(flags: Sequence[object]) -> Fragmentation:
    """The KV-block rate over free flags indexed by block id (flags[0], the null block, ignored)."""
    free, longest = scan_free_flags(flags)
    return kv_blocks_fragmentation(free, longest, max(len(flags) - 1, 0))


def from_free_chunks(chunk_sizes: Iterable[int], total: int) -> Fragmentation:
    """The allocator rate over free chunk sizes (bytes); `total` is the reserved bytes."""
    sizes = [size for size in chunk_sizes if size > 0]
    free = sum(sizes)
    longest = max(sizes, default=0)
    if free == 0:
        return Fragmentation(0, 0, total, None, NO_FREE_BYTES)
    return Fragmentation(free, longest, total, 1.0 - longest / free, None)
