"""One snapshot per tick: every source read once, concurrently, and stamped."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpilot.collectors.dcgm import DcgmSnapshot
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.gpu_samples import NvmlSnapshot
from kvpilot.collectors.kvpool.client import KvPoolScrape, KvPoolSource
from kvpilot.collectors.nvml import NvmlCollector
from kvpilot.collectors.vllm_metrics import VllmMetricsSource, VllmScrape

SOURCES = ("vllm", "kvpool", "nvml", "dcgm")


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What every source said at one tick; a source that is not configured is None."""

    taken_at_s: float
    wall_time_s: float
    vllm: VllmScrape | SourceError
    kvpool: KvPoolScrape | SourceError | None
    nvml: NvmlSnapshot | SourceError
    durations_s: tuple[tuple[str, float], ...]
    # dcgm-exporter's device memory of this pod's GPUs, through Prometheus; None: not set up.
    dcgm: DcgmSnapshot | SourceError | None = None

    def duration_s(self, source: str) -> float | None:
        return dict(self.durations_s).get(source)


@dataclass(frozen=True, slots=True)
class NvmlReading:
    """One NVML read, shared by every server of the tick: its result, how long it took, and
    the collector's per-call error counts (one device or one reading failing) at that time."""

    value: NvmlSnapshot | SourceError
    duration_s: float
    call_errors: Mapping[str, int] = field(default_factory=dict)
    # Read once per tick beside NVML, for the rules where NVML sees nothing; None: not set up.
    dcgm: DcgmSnapshot | SourceError | None = None
    dcgm_duration_s: float = 0.0


async def read_nvml(
    collector: NvmlCollector, clock: Callable[[], float] = time.monotonic
) -> NvmlReading:
    """Reads NVML once, off the event loop (its calls block, briefly); while NVML is known
    to be unavailable, the cached error without a trip to a worker thread."""
    resting = collector.resting()
    if resting is not None:
        return NvmlReading(resting, 0.0, dict(collector.errors_by_reason()))
    start = clock()
    value = await asyncio.to_thread(collector.collect)
    return NvmlReading(value, clock() - start, dict(collector.errors_by_reason()))


class SnapshotTaker:
    """Reads a server's sources concurrently; never raises for a source's failure."""

    def __init__(
        self,
        *,
        vllm: VllmMetricsSource,
        kvpool: KvPoolSource | None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._vllm = vllm
        self._kvpool = kvpool
        self._clock = clock
        self._wall_clock = wall_clock

    async def take(self, nvml: NvmlReading) -> Snapshot:
        """Read the server's sources; `nvml` is the reading the tick took once for all."""
        taken_at_s, wall_time_s = self._clock(), self._wall_clock()
        reads: dict[str, Awaitable[Any]] = {"vllm": self._vllm.scrape()}
        if self._kvpool is not None:
            reads["kvpool"] = self._kvpool.scrape()
        timed = await asyncio.gather(*(self._timed(read) for read in reads.values()))
        results = dict(zip(reads, timed, strict=True))
        durations = [(name, result[1]) for name, result in results.items()]
        return Snapshot(
            taken_at_s=taken_at_s,
            wall_time_s=wall_time_s,
            vllm=results["vllm"][0],
            kvpool=results["kvpool"][0] if "kvpool" in results else None,
            nvml=nvml.value,
            durations_s=(
                durations[0],
                ("nvml", nvml.duration_s),
                *durations[1:],
                *((("dcgm", nvml.dcgm_duration_s),) if nvml.dcgm is not None else ()),
            ),
            dcgm=nvml.dcgm,
        )

    async def _timed(self, read: Awaitable[Any]) -> tuple[Any, float]:
        start = self._clock()
        value = await read
        return value, self._clock() - start
