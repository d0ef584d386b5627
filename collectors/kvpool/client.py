"""Agent side: read one kvpool plugin port back into frozen samples; never raises."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.fragmentation import Fragmentation, kv_blocks_fragmentation
from kvpilot.collectors.promtext import MetricSample, MetricsParseError, parse_samples

PREFIX = "kvpool_"


@dataclass(frozen=True, slots=True)
class KvBlockSample:
    """One engine's block pool as the plugin saw it at a step boundary."""

    engine: str
    model_name: str
    taken_at_s: float  # monotonic, when the agent's scrape started
    blocks_total: int | None
    blocks_free: int | None
    blocks_free_cached: int | None
    blocks_empty: int | None
    longest_free_run_blocks: int | None
    # Recomputed with the one formula from the counts; None (with reason) while guarded.
    fragmentation: Fragmentation | None
    internal_fragmentation_slots: int | None
    internal_fragmentation_ratio: float | None
    requests_running: int | None
    block_size_tokens: int | None
    preemptions_total: int | None
    last_preemption_wall_s: float | None
    scheduler_steps_total: int | None
    snapshot_age_s: float | None

    @property
    def key(self) -> tuple[str, str]:
        """The engine's identity across scrapes, as the rolling window keys it."""
        return (self.model_name, self.engine)


@dataclass(frozen=True, slots=True)
class AllocatorSample:
    """One device's CUDA caching allocator, from the worker rank that owns it."""

    device: str
    rank: str
    reserved_bytes: int | None
    allocated_bytes: int | None
    active_bytes: int | None
    inactive_split_bytes: int | None
    free_in_reserved_bytes: int | None
    largest_free_block_bytes: int | None
    segments: int | None
    fragmentation_ratio: float | None


@dataclass(frozen=True, slots=True)
class KvPoolScrape:
    """Everything one plugin port served, stamped when the scrape started."""

    taken_at_s: float
    wall_time_s: float
    engines: tuple[KvBlockSample, ...]
    allocators: tuple[AllocatorSample, ...]
    plugin_errors: tuple[tuple[str, int], ...] = ()


def _labels(sample: MetricSample) -> dict[str, str]:
    return dict(sample.labels)


def _as_int(value: float | None) -> int | None:
    return int(value) if value is not None else None


def samples_to_scrape(
    samples: list[MetricSample], *, taken_at_s: float, wall_time_s: float
) -> KvPoolScrape:
    """Group parsed `kvpool_*` samples into per-engine and per-device values."""
    engine_keys: dict[tuple[str, str], None] = {}
    device_keys: dict[tuple[str, str], None] = {}
    errors: list[tuple[str, int]] = []
    by_name: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for sample in samples:
        labels = _labels(sample)
        if sample.name == "kvpool_plugin_errors_total":
            errors.append((labels.get("part", ""), int(sample.value)))
            continue
        if "engine" in labels:
            engine_keys[(labels["engine"], labels.get("model_name", ""))] = None
            key = (("engine", labels["engine"]), ("model_name", labels.get("model_name", "")))
        elif "device" in labels:
            device_keys[(labels["device"], labels.get("rank", ""))] = None
            key = (("device", labels["device"]), ("rank", labels.get("rank", "")))
        else:
            continue
        by_name.setdefault(sample.name, {})[key] = sample.value

    def get(name: str, key: tuple[tuple[str, str], ...]) -> float | None:
        return by_name.get(name, {}).get(key)

    engines = []
    for engine, model_name in engine_keys:
        key = (("engine", engine), ("model_name", model_name))
        total = _as_int(get("kvpool_blocks_usable", key))
        free = _as_int(get("kvpool_blocks_free", key))
        longest = _as_int(get("kvpool_longest_free_run_blocks", key))
        fragmentation = (
            kv_blocks_fragmentation(free, longest, total)
            if total is not None and free is not None and longest is not None
            else None
        )
        engines.append(
            KvBlockSample(
                engine=engine,
                model_name=model_name,
                taken_at_s=taken_at_s,
                blocks_total=total,
                blocks_free=free,
                blocks_free_cached=_as_int(get("kvpool_blocks_free_cached", key)),
                blocks_empty=_as_int(get("kvpool_blocks_empty", key)),
                longest_free_run_blocks=longest,
                fragmentation=fragmentation,
                internal_fragmentation_slots=_as_int(
                    get("kvpool_internal_fragmentation_slots", key)
                ),
                internal_fragmentation_ratio=get("kvpool_internal_fragmentation_ratio", key),
                requests_running=_as_int(get("kvpool_requests_running", key)),
                block_size_tokens=_as_int(get("kvpool_block_size_tokens", key)),
                preemptions_total=_as_int(get("kvpool_preemptions_total", key)),
                last_preemption_wall_s=get("kvpool_last_preemption_timestamp_seconds", key),
                scheduler_steps_total=_as_int(get("kvpool_scheduler_steps_total", key)),
                snapshot_age_s=get("kvpool_snapshot_age_seconds", key),
            )
        )
    allocators = []
    for device, rank in device_keys:
        key = (("device", device), ("rank", rank))
        allocators.append(
            AllocatorSample(
                device=device,
                rank=rank,
                reserved_bytes=_as_int(get("kvpool_allocator_reserved_bytes", key)),
                allocated_bytes=_as_int(get("kvpool_allocator_allocated_bytes", key)),
                active_bytes=_as_int(get("kvpool_allocator_active_bytes", key)),
                inactive_split_bytes=_as_int(get("kvpool_allocator_inactive_split_bytes", key)),
                free_in_reserved_bytes=_as_int(get("kvpool_allocator_free_in_reserved_bytes", key)),
                largest_free_block_bytes=_as_int(
                    get("kvpool_allocator_largest_free_block_bytes", key)
                ),
                segments=_as_int(get("kvpool_allocator_segments", key)),
                fragmentation_ratio=get("kvpool_fragmentation_ratio", key),
            )
        )
    return KvPoolScrape(
        taken_at_s=taken_at_s,
        wall_time_s=wall_time_s,
        engines=tuple(engines),
        allocators=tuple(allocators),
        plugin_errors=tuple(sorted(errors)),
    )


class KvPoolSource:
    """Scrapes one plugin port (`url`, e.g. http://127.0.0.1:9400/metrics)."""

    def __init__(
        self,
        url: str,
        *,
        client: httpx.AsyncClient,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        timeout_s: float = 2.0,
        name: str = "kvpool",
    ) -> None:
        self.url = url
        self.name = name
        self._client = client
        self._clock = clock
        self._wall_clock = wall_clock
        self._timeout_s = timeout_s

    async def scrape(self) -> KvPoolScrape | SourceError:
        """One GET; any failure comes back as a SourceError value."""
        taken_at_s, wall_time_s = self._clock(), self._wall_clock()
        try:
            response = await self._client.get(self.url, timeout=self._timeout_s)
        except httpx.ConnectError as exc:
            return SourceError(self.name, "refused", f"{self.url}: {exc}")
        except httpx.TimeoutException as exc:
            return SourceError(self.name, "timeout", f"{self.url}: {exc!r}")
        except Exception as exc:  # the agent's loop must survive any transport error
            return SourceError(self.name, "error", f"{self.url}: {exc!r}")
        if response.status_code != 200:
            return SourceError(self.name, "http_status", f"{self.url}: {response.status_code}")
        try:
            samples = parse_samples(response.text, prefixes=(PREFIX,))
        except MetricsParseError as exc:
            return SourceError(self.name, "parse_error", f"{self.url}: {exc}")
        if not samples:
            return SourceError(self.name, "not_metrics", f"{self.url}: no kvpool_ samples")
        try:
            return samples_to_scrape(samples, taken_at_s=taken_at_s, wall_time_s=wall_time_s)
        except Exception as exc:
            return SourceError(self.name, "error", f"{self.url}: {exc!r}")
