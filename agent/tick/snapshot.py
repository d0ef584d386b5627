"""One snapshot per tick: every source read once, concurrently, and stamped."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.gpu_samples import NvmlSnapshot
from kvpilot.collectors.kvpool.client import KvPoolScrape, KvPoolSource
from kvpilot.collectors.nvml import NvmlCollector
from kvpilot.collectors.vllm_metrics import VllmMetricsSource, VllmScrape

SOURCES = ("vllm", "kvpool", "nvml")


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What every source said at one tick; a source that is not configured is None."""

    taken_at_s: float
    wall_time_s: float
    vllm: VllmScrape | SourceError
    kvpool: KvPoolScrape | SourceError | None
    nvml: NvmlSnapshot | SourceError
    durations_s: tuple[tuple[str, float], ...]

    def duration_s(self, source: str) -> float | None:
        return dict(self.durations_s).get(source)


class SnapshotTaker:
    """Reads the configured sources concurrently; never raises for a source's failure."""

    def __init__(
        self,
        *,
        vllm: VllmMetricsSource,
        kvpool: KvPoolSource | None,
        nvml: NvmlCollector,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._vllm = vllm
        self._kvpool = kvpool
        self._nvml = nvml
        self._clock = clock
        self._wall_clock = wall_clock

    async def take(self, nvml: NvmlReading | None = None) -> Snapshot:
        """Read every source; `nvml`, when given, is a reading the caller already took
        this tick (one NVML read serves every server the agent watches)."""
        taken_at_s, wall_time_s = self._clock(), self._wall_clock()
        reads: dict[str, Awaitable[Any]] = {"vllm": self._vllm.scrape()}
        if nvml is None:
            reads["nvml"] = self.read_nvml()
        else:
            reads["nvml"] = _given(nvml)
        if self._kvpool is not None:
            reads["kvpool"] = self._kvpool.scrape()
        timed = await asyncio.gather(*(self._timed(read) for read in reads.values()))
        results = dict(zip(reads, timed, strict=True))
        return Snapshot(
            taken_at_s=taken_at_s,
            wall_time_s=wall_time_s,
            vllm=results["vllm"][0],
            kvpool=results["kvpool"][0] if "kvpool" in results else None,
            nvml=results["nvml"][0],
            durations_s=tuple((name, result[1]) for name, result in results.items()),
        )

    async def read_nvml(self) -> NvmlSnapshot | SourceError:
        # NVML calls block (briefly); keep them off the event loop.
        return await asyncio.to_thread(self._nvml.collect)

    async def _timed(self, read: Awaitable[Any]) -> tuple[Any, float]:
        start = self._clock()
        value = await read
        if isinstance(value, NvmlReading):
            return value.value, value.duration_s
        return value, self._clock() - start


@dataclass(frozen=True, slots=True)
class NvmlReading:
    """An NVML result taken once for the tick, and how long it took."""

    value: NvmlSnapshot | SourceError
    duration_s: float


async def _given(reading: NvmlReading) -> NvmlReading:
    return reading
