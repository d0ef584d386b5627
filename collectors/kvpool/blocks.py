"""Adapter over vLLM's block pool: reads it once and converts it at once to our own values.

Every vLLM attribute is read with `getattr` (these are internals that change between
versions); a shape we do not recognise raises `BlockPoolShapeError`, which the plugin turns
into one log line and an error count. Nothing here keeps a vLLM object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpilot.collectors.fragmentation import (
    Fragmentation,
    kv_blocks_fragmentation,
    scan_free_flags,
)
from kvpilot.collectors.kvpool.occupancy import (
    BlockSizeChoice,
    GroupOccupancy,
    block_size_choice,
    group_occupancy,
)

NO_RUNNING_REQUESTS = "no running requests hold blocks"
NO_REQUEST_BLOCKS = "scheduler exposes no per-request blocks"


class BlockPoolShapeError(Exception):
    """The object does not look like the block pool this adapter knows."""


@dataclass(frozen=True, slots=True)
class BlockCounts:
    """One pass over the pool's blocks; ids run 1..total (block 0, the null block, is skipped)."""

    blocks_total: int
    blocks_free: int
    blocks_free_cached: int
    blocks_empty: int
    longest_free_run_blocks: int
    fragmentation: Fragmentation


@dataclass(frozen=True, slots=True)
class InternalFragmentation:
    """Token slots reserved but unused in the tail blocks of running requests."""

    running_requests: int
    reserved_slots: int
    unused_slots: int | None
    ratio: float | None
    reason: str | None


@dataclass(frozen=True, slots=True)
class BlockPoolSnapshot:
    """What the plugin exports for one engine, taken at one instant of the engine thread."""

    taken_at_s: float
    wall_time_s: float
    block_size_tokens: int | None
    counts: BlockCounts
    internal: InternalFragmentation
    occupancy: tuple[GroupOccupancy, ...] = ()  # per KV group
    block_size_choice: BlockSizeChoice | None = None


# Per-block state codes: one list built in one pass, then counted in C.
_USED, _EMPTY, _CACHED = 0, 1, 2


def count_blocks(pool: object) -> BlockCounts:
    """Free, cached, empty blocks and the longest free run, in one pass over `pool.blocks`."""
    blocks = getattr(pool, "blocks", None)
    if not isinstance(blocks, Sequence) or len(blocks) == 0:
        raise BlockPoolShapeError("block pool has no `blocks` list")
    try:
        # Each block is read once, its hash only when free. The run scan and the formula
        # live in collectors.fragmentation (the agent uses them too).
        states = [
            _USED if block.ref_cnt else (_EMPTY if block.block_hash is None else _CACHED)
            for block in blocks
        ]
    except AttributeError as exc:
        raise BlockPoolShapeError(f"block without ref_cnt/block_hash: {exc}") from exc
    free, longest = scan_free_flags(states)
    total = len(blocks) - 1
    # Block 0 (the null block) is skipped by the scan; keep it out of the cached count too.
    cached = states.count(_CACHED) - (states[0] == _CACHED)
    return BlockCounts(
        blocks_total=total,
        blocks_free=free,
        blocks_free_cached=cached,
        blocks_empty=free - cached,
        longest_free_run_blocks=longest,
        fragmentation=kv_blocks_fragmentation(free, longest, total),
    )


def internal_fragmentation(scheduler: object) -> InternalFragmentation:
    """Unused token slots in the blocks held by the scheduler's running requests."""
    running = list(getattr(scheduler, "running", None) or ())
    manager = getattr(scheduler, "kv_cache_manager", None)
    coordinator = getattr(manager, "coordinator", None)
    groups = getattr(coordinator, "single_type_managers", None)
    if not groups:
        return InternalFragmentation(len(running), 0, None, None, NO_REQUEST_BLOCKS)
    reserved = unused = 0
    for group in groups:
        req_to_blocks = getattr(group, "req_to_blocks", None)
        block_size = getattr(group, "block_size", None)
        if not isinstance(req_to_blocks, dict) or not isinstance(block_size, int):
            return InternalFragmentation(len(running), 0, None, None, NO_REQUEST_BLOCKS)
        for request in running:
            held = req_to_blocks.get(getattr(request, "request_id", None))
            if not held:
                continue
            real = sum(1 for block in held if not getattr(block, "is_null", False))
            # Null blocks (skipped sliding-window positions) sit before the written tail.
            covered = len(held) * block_size
            written = min(int(getattr(request, "num_computed_tokens", 0)), covered)
            reserved += real * block_size
            unused += covered - written
    if reserved == 0:
        return InternalFragmentation(len(running), 0, None, None, NO_RUNNING_REQUESTS)
    return InternalFragmentation(len(running), reserved, unused, unused / reserved, None)


def block_size_of(scheduler: object) -> int | None:
    """The scheduler's block size in tokens, when it says."""
    size = getattr(scheduler, "block_size", None)
    return size if isinstance(size, int) and size > 0 else None


def snapshot(scheduler: object, *, taken_at_s: float, wall_time_s: float) -> BlockPoolSnapshot:
    """Read one engine's block pool and running requests into our own values."""
    manager = getattr(scheduler, "kv_cache_manager", None)
    pool = getattr(manager, "block_pool", None)
    if pool is None:
        raise BlockPoolShapeError("scheduler has no kv_cache_manager.block_pool")
    occupancy = group_occupancy(scheduler)
    return BlockPoolSnapshot(
        taken_at_s=taken_at_s,
        wall_time_s=wall_time_s,
        block_size_tokens=block_size_of(scheduler),
        counts=count_blocks(pool),
        internal=internal_fragmentation(scheduler),
        occupancy=occupancy,
        block_size_choice=block_size_choice(scheduler, len(occupancy)),
    )
