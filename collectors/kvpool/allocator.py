"""Adapter over PyTorch's CUDA caching allocator, in the process that owns the device.

`torch.cuda.memory_stats(device)` gives the byte counters; `torch.cuda.memory_snapshot()`
gives the reserved segments (all devices, each with a `device` key) and their blocks, whose
`inactive` ones are free memory the allocator holds. The arithmetic takes those plain
dicts, so it is tested on fixtures without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.collectors.fragmentation import Fragmentation, from_free_chunks

FREE_BLOCK_STATE = "inactive"


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    """The caching allocator of one device, as seen from the process that owns it."""

    taken_at_s: float
    wall_time_s: float
    device: int
    reserved_bytes: int | None
    allocated_bytes: int | None
    active_bytes: int | None
    inactive_split_bytes: int | None
    free_in_reserved_bytes: int
    largest_free_block_bytes: int
    segments: int
    alloc_retries_total: int | None
    ooms_total: int | None
    fragmentation: Fragmentation


def _stat(stats: Mapping[str, Any], key: str) -> int | None:
    value = stats.get(key)
    return int(value) if isinstance(value, int | float) else None


def allocator_stats_from(
    device: int,
    memory_stats: Mapping[str, Any],
    segments: Sequence[Mapping[str, Any]],
    *,
    taken_at_s: float,
    wall_time_s: float,
) -> AllocatorStats:
    """Combine `memory_stats(device)` and `memory_snapshot()` output for one device."""
    own = [seg for seg in segments if seg.get("device", device) == device]
    free_chunks = [
        int(block.get("size", 0))
        for seg in own
        for block in seg.get("blocks", ())
        if block.get("state") == FREE_BLOCK_STATE
    ]
    reserved = _stat(memory_stats, "reserved_bytes.all.current")
    segment_total = sum(int(seg.get("total_size", 0)) for seg in own)
    fragmentation = from_free_chunks(
        free_chunks, reserved if reserved is not None else segment_total
    )
    return AllocatorStats(
        taken_at_s=taken_at_s,
        wall_time_s=wall_time_s,
        device=device,
        reserved_bytes=reserved,
        allocated_bytes=_stat(memory_stats, "allocated_bytes.all.current"),
        active_bytes=_stat(memory_stats, "active_bytes.all.current"),
        inactive_split_bytes=_stat(memory_stats, "inactive_split_bytes.all.current"),
        free_in_reserved_bytes=fragmentation.free,
        largest_free_block_bytes=fragmentation.longest_free_run,
        segments=len(own),
        alloc_retries_total=_stat(memory_stats, "num_alloc_retries"),
        ooms_total=_stat(memory_stats, "num_ooms"),
        fragmentation=fragmentation,
    )


def _snapshot_segments(torch_cuda: Any) -> Sequence[Mapping[str, Any]]:
    segments: Sequence[Mapping[str, Any]]
    try:
        # Traces are not needed and can be large; older torch has no such argument.
        segments = torch_cuda.memory_snapshot(include_traces=False)
    except TypeError:
        segments = torch_cuda.memory_snapshot()
    return segments


def read_allocator_stats(
    device: int,
    *,
    clock: Callable[[], float],
    wall_clock: Callable[[], float],
    torch_cuda: Any = None,
) -> AllocatorStats:
    """Read the live allocator of `device`; raises whatever torch raises (the caller guards)."""
    if torch_cuda is None:
        import torch.cuda as torch_cuda  # imported late: only processes that own a GPU get here
    taken_at_s, wall_time_s = clock(), wall_clock()
    stats = torch_cuda.memory_stats(device)
    segments = _snapshot_segments(torch_cuda)
    return allocator_stats_from(
        device, stats, segments, taken_at_s=taken_at_s, wall_time_s=wall_time_s
    )
