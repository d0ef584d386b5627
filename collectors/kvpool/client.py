"""Agent side: read one kvpool plugin port back into frozen, checked samples; never raises.

Every figure is checked at the edge (``collectors.checks``): counts that are not whole
non-negative numbers, ratios outside 0..1, series exported twice with different values, and
block counts that cannot all be true (a longest free run above the free blocks, more free
blocks than the pool holds) become None with the reason, so no rule acts on them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvpilot.collectors.checks import Refused, SampleChecks
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.fragmentation import Fragmentation, kv_blocks_fragmentation
from kvpilot.collectors.kvpool.ledger_client import (
    LEDGER_PREFIX,
    LedgerSample,
    ledgers_from_samples,
)
from kvpilot.collectors.kvpool.listen_address import WORKER_PORT_FAMILY
from kvpilot.collectors.kvpool.worker_urls import worker_urls
from kvpilot.collectors.limits import ScrapeLimits
from kvpilot.collectors.promtext import (
    Labels,
    MetricSample,
    MetricsParseError,
    SampleLimitError,
    parse_samples,
)
from kvpilot.collectors.scrape_client import ScrapeClient
from kvpilot.collectors.secrets import mask_url

PREFIX = "kvpool_"
WORKER_SOURCE = "kvpool_worker"  # errors of the workers' ports, read through the engine's


@dataclass(frozen=True, slots=True)
class GroupOccupancySample:
    """One KV group's blocks in use and the tokens in them; the ratio is recomputed here."""

    kv_group: str
    block_size_tokens: int | None
    blocks_in_use: int | None
    tokens: int | None
    ratio: float | None  # tokens / (blocks in use x block size)
    reason: str | None  # why the ratio is unknown


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
    refused: tuple[Refused, ...] = ()  # values the edge checks turned into None, and why
    occupancy: tuple[GroupOccupancySample, ...] = ()  # token occupancy per KV group
    # Block sizes the backend accepts: multiples of the step; a fixed size names its reason.
    block_size_step_tokens: int | None = None
    block_size_fixed_reason: str | None = None

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
    refused: tuple[Refused, ...] = ()


@dataclass(frozen=True, slots=True)
class KvPoolScrape:
    """Everything one plugin port served, stamped when the scrape started."""

    taken_at_s: float
    wall_time_s: float
    engines: tuple[KvBlockSample, ...]
    allocators: tuple[AllocatorSample, ...]
    plugin_errors: tuple[tuple[str, int], ...] = ()
    refused: tuple[Refused, ...] = ()  # outside any engine or device (plugin error counts)
    ledgers: tuple[LedgerSample, ...] = ()  # where the device's memory went (ledger_client)
    # Workers' ports (published by the engine) that gave nothing this time, and why.
    worker_errors: tuple[SourceError, ...] = ()


class _Figures:
    """The parsed samples by name and series key, with the series exported twice differently."""

    def __init__(self) -> None:
        self.by_name: dict[str, dict[Labels, float]] = {}
        self.conflicts: set[tuple[str, Labels]] = set()

    def get(self, checks: SampleChecks, field: str, name: str, key: Labels) -> float | None:
        """One figure; None (refused) when its series came twice with different values."""
        if (name, key) in self.conflicts:
            checks.refuse(field, "duplicate_series", f"{name} is exported twice, differently")
            return None
        return self.by_name.get(name, {}).get(key)


def samples_to_scrape(
    samples: list[MetricSample], *, taken_at_s: float, wall_time_s: float
) -> KvPoolScrape:
    """Group parsed `kvpool_*` samples into per-engine and per-device values, each checked."""
    engine_keys: dict[tuple[str, str], None] = {}
    device_keys: dict[tuple[str, str], None] = {}
    errors: list[tuple[str, int]] = []
    scrape_checks = SampleChecks()
    figures = _Figures()
    seen: dict[tuple[str, Labels], float] = {}
    extras: dict[tuple[str, str], dict[tuple[str, str], float]] = {}  # per group, per reason
    ledger_samples: list[MetricSample] = []
    for sample in samples:
        if sample.name.startswith(LEDGER_PREFIX):  # labelled by device, but no allocator
            ledger_samples.append(sample)
            continue
        if sample.name == WORKER_PORT_FAMILY:  # where to read more (worker_urls), no figure
            continue
        series = (sample.name, sample.labels)
        earlier = seen.get(series)
        if earlier is None:
            seen[series] = sample.value
        labels = dict(sample.labels)
        if sample.name == "kvpool_plugin_errors_total":
            part = labels.get("part", "")
            count = scrape_checks.count(f"plugin_errors_total[{part}]", sample.value)
            if count is not None and earlier is None:
                errors.append((part, count))
            continue
        if "engine" in labels and sample.name in _GROUP_NAMES | _CHOICE_NAMES:
            engine_keys[(labels["engine"], labels.get("model_name", ""))] = None
            per_engine = extras.setdefault((labels["engine"], labels.get("model_name", "")), {})
            detail = labels.get("kv_group", labels.get("reason", ""))
            per_engine.setdefault((sample.name, detail), sample.value)
            continue
        if "engine" in labels:
            engine_keys[(labels["engine"], labels.get("model_name", ""))] = None
            key: Labels = (
                ("engine", labels["engine"]),
                ("model_name", labels.get("model_name", "")),
            )
        elif "device" in labels:
            device_keys[(labels["device"], labels.get("rank", ""))] = None
            key = (("device", labels["device"]), ("rank", labels.get("rank", "")))
        else:
            continue
        if earlier is not None:  # the same series again: nothing new, unless it disagrees
            if not (
                earlier == sample.value or (earlier != earlier and sample.value != sample.value)
            ):
                figures.conflicts.add((sample.name, key))
            continue
        figures.by_name.setdefault(sample.name, {})[key] = sample.value
    engines = [
        _with_occupancy(
            _engine(figures, engine, model_name, taken_at_s),
            extras.get((engine, model_name), {}),
        )
        for engine, model_name in engine_keys
    ]
    allocators = [_allocator(figures, device, rank) for device, rank in device_keys]
    return KvPoolScrape(
        taken_at_s=taken_at_s,
        wall_time_s=wall_time_s,
        engines=tuple(engines),
        allocators=tuple(allocators),
        plugin_errors=tuple(sorted(errors)),
        refused=scrape_checks.done(),
        ledgers=ledgers_from_samples(ledger_samples),
    )


def _engine(figures: _Figures, engine: str, model_name: str, taken_at_s: float) -> KvBlockSample:
    key = (("engine", engine), ("model_name", model_name))
    checks = SampleChecks()

    def count(field: str, name: str, least: int = 0) -> int | None:
        return checks.count(field, figures.get(checks, field, name, key), least=least)

    def number(field: str, name: str) -> float | None:
        return checks.counter(field, figures.get(checks, field, name, key))

    def ratio(field: str, name: str) -> float | None:
        return checks.ratio(field, figures.get(checks, field, name, key))

    blocks = _Blocks(
        total=count("blocks_total", "kvpool_blocks_usable"),
        free=count("blocks_free", "kvpool_blocks_free"),
        cached=count("blocks_free_cached", "kvpool_blocks_free_cached"),
        empty=count("blocks_empty", "kvpool_blocks_empty"),
        longest=count("longest_free_run_blocks", "kvpool_longest_free_run_blocks"),
    )
    blocks, fragmentation = blocks.checked(checks)
    return KvBlockSample(
        engine=engine,
        model_name=model_name,
        taken_at_s=taken_at_s,
        blocks_total=blocks.total,
        blocks_free=blocks.free,
        blocks_free_cached=blocks.cached,
        blocks_empty=blocks.empty,
        longest_free_run_blocks=blocks.longest,
        fragmentation=fragmentation,
        internal_fragmentation_slots=count(
            "internal_fragmentation_slots", "kvpool_internal_fragmentation_slots"
        ),
        internal_fragmentation_ratio=ratio(
            "internal_fragmentation_ratio", "kvpool_internal_fragmentation_ratio"
        ),
        requests_running=count("requests_running", "kvpool_requests_running"),
        block_size_tokens=count("block_size_tokens", "kvpool_block_size_tokens", least=1),
        preemptions_total=count("preemptions_total", "kvpool_preemptions_total"),
        last_preemption_wall_s=number(
            "last_preemption_wall_s", "kvpool_last_preemption_timestamp_seconds"
        ),
        scheduler_steps_total=count("scheduler_steps_total", "kvpool_scheduler_steps_total"),
        snapshot_age_s=number("snapshot_age_s", "kvpool_snapshot_age_seconds"),
        refused=checks.done(),
    )


_GROUP_NAMES = frozenset(
    {
        "kvpool_token_occupancy_ratio",
        "kvpool_group_blocks_in_use",
        "kvpool_group_tokens_in_use",
        "kvpool_group_block_size_tokens",
    }
)
_CHOICE_NAMES = frozenset({"kvpool_block_size_step_tokens", "kvpool_block_size_fixed"})
NO_BLOCKS_IN_USE = "no request holds KV blocks"


def _with_occupancy(sample: KvBlockSample, found: dict[tuple[str, str], float]) -> KvBlockSample:
    """The engine's sample with its per-group occupancy and block-size choice, each checked:
    the ratio is recomputed from the counts, and counts that cannot be true refuse it."""
    if not found:
        return sample
    checks = SampleChecks()
    groups = sorted({detail for name, detail in found if name in _GROUP_NAMES})
    occupancy = []
    for group in groups:

        def count(field: str, name: str, least: int = 0, group: str = group) -> int | None:
            return checks.count(f"{field}[{group}]", found.get((name, group)), least=least)

        size = count("block_size_tokens", "kvpool_group_block_size_tokens", least=1)
        blocks = count("blocks_in_use", "kvpool_group_blocks_in_use")
        tokens = count("tokens", "kvpool_group_tokens_in_use")
        ratio: float | None = None
        reason: str | None = None
        if size is None or blocks is None or tokens is None:
            reason = "the plugin did not report the group's blocks and tokens"
        elif tokens > blocks * size:
            reason = f"{tokens} tokens in {blocks} blocks of {size}: the counts contradict"
            checks.refuse(f"occupancy[{group}]", "contradictory", reason)
        elif blocks == 0:
            reason = NO_BLOCKS_IN_USE
        else:
            ratio = tokens / (blocks * size)
        occupancy.append(GroupOccupancySample(group, size, blocks, tokens, ratio, reason))
    step = checks.count(
        "block_size_step_tokens", found.get(("kvpool_block_size_step_tokens", "")), least=1
    )
    fixed = next(
        (detail for name, detail in found if name == "kvpool_block_size_fixed" and detail), None
    )
    return replace(
        sample,
        occupancy=tuple(occupancy),
        block_size_step_tokens=step,
        block_size_fixed_reason=fixed,
        refused=(*sample.refused, *checks.done()),
    )


@dataclass(frozen=True, slots=True)
class _Blocks:
    """One engine's block counts, each already checked on its own."""

    total: int | None
    free: int | None
    cached: int | None
    empty: int | None
    longest: int | None

    def contradiction(self) -> str | None:
        """Why these counts cannot all be true, if they cannot (the plugin counts them in one
        pass: free = cached + empty, longest run <= free <= total, a free block is a run)."""
        total, free, cached, empty, longest = (
            self.total,
            self.free,
            self.cached,
            self.empty,
            self.longest,
        )
        if total is not None and free is not None and free > total:
            return f"{free} free blocks of {total}"
        if free is not None and longest is not None and longest > free:
            return f"a longest free run of {longest} blocks with {free} free"
        if free and longest == 0:
            return f"no free run with {free} blocks free"
        if free is not None and cached is not None and empty is not None and cached + empty != free:
            return f"{cached} cached + {empty} empty blocks with {free} free"
        return None

    def checked(self, checks: SampleChecks) -> tuple[_Blocks, Fragmentation | None]:
        """The counts and the rate from them; when they contradict, no count is kept and the
        rate is unknown with the reason (the figures read stay in it, for the message)."""
        total, free, longest = self.total, self.free, self.longest
        why = self.contradiction()
        if why is None:
            if total is None or free is None or longest is None:
                return self, None
            return self, kv_blocks_fragmentation(free, longest, total)
        checks.refuse("blocks", "contradictory", why)
        unknown = _Blocks(None, None, None, None, None)
        if total is None or free is None or longest is None:
            return unknown, None
        reason = f"the plugin's block counts contradict each other: {why}"
        return unknown, Fragmentation(free, longest, total, None, reason)


def _allocator(figures: _Figures, device: str, rank: str) -> AllocatorSample:
    key = (("device", device), ("rank", rank))
    checks = SampleChecks()

    def count(field: str, name: str) -> int | None:
        return checks.count(field, figures.get(checks, field, name, key))

    reserved = count("reserved_bytes", "kvpool_allocator_reserved_bytes")
    allocated = count("allocated_bytes", "kvpool_allocator_allocated_bytes")
    active = count("active_bytes", "kvpool_allocator_active_bytes")
    free = count("free_in_reserved_bytes", "kvpool_allocator_free_in_reserved_bytes")
    largest = count("largest_free_block_bytes", "kvpool_allocator_largest_free_block_bytes")
    ratio = checks.ratio(
        "fragmentation_ratio",
        figures.get(checks, "fragmentation_ratio", "kvpool_fragmentation_ratio", key),
    )
    # Pairs read from one call each (memory_stats, or one memory_snapshot): never apart.
    why = None
    if reserved is not None and allocated is not None and allocated > reserved:
        why = f"{allocated} bytes allocated of {reserved} reserved"
    elif reserved is not None and active is not None and active > reserved:
        why = f"{active} bytes active of {reserved} reserved"
    elif free is not None and largest is not None and largest > free:
        why = f"a largest free block of {largest} bytes with {free} free"
    if why is not None:
        checks.refuse("allocator", "contradictory", why)
        reserved = allocated = active = free = largest = None
        ratio = None
    return AllocatorSample(
        device=device,
        rank=rank,
        reserved_bytes=reserved,
        allocated_bytes=allocated,
        active_bytes=active,
        inactive_split_bytes=count("inactive_split_bytes", "kvpool_allocator_inactive_split_bytes"),
        free_in_reserved_bytes=free,
        largest_free_block_bytes=largest,
        segments=count("segments", "kvpool_allocator_segments"),
        fragmentation_ratio=ratio,
        refused=checks.done(),
    )


def with_workers(
    engine: KvPoolScrape, workers: Sequence[KvPoolScrape | SourceError]
) -> KvPoolScrape:
    """The engine port's scrape with what its workers' ports served: their devices' ledgers
    and allocators (a device served on two ports counts once: the first), the plugin's
    error counts summed over the processes, and each worker port that failed."""
    ledgers = {(item.device, item.rank): item for item in engine.ledgers}
    allocators = {(item.device, item.rank): item for item in engine.allocators}
    errors = dict(engine.plugin_errors)
    refused = list(engine.refused)
    failed = list(engine.worker_errors)
    for worker in workers:
        if isinstance(worker, SourceError):
            failed.append(worker)
            continue
        for ledger in worker.ledgers:
            ledgers.setdefault((ledger.device, ledger.rank), ledger)
        for allocator in worker.allocators:
            allocators.setdefault((allocator.device, allocator.rank), allocator)
        for part, count in worker.plugin_errors:
            errors[part] = errors.get(part, 0) + count
        refused.extend(worker.refused)
    return replace(
        engine,
        ledgers=tuple(ledgers.values()),
        allocators=tuple(allocators.values()),
        plugin_errors=tuple(sorted(errors.items())),
        refused=tuple(refused),
        worker_errors=tuple(failed),
    )


class KvPoolSource:
    """Scrapes one plugin port (`url`, e.g. http://127.0.0.1:8474/metrics) within its limits."""

    def __init__(
        self,
        url: str,
        *,
        client: ScrapeClient,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        limits: ScrapeLimits | None = None,
        name: str = "kvpool",
    ) -> None:
        self.url = url
        self._shown_url = mask_url(url)  # what messages say: no secrets in it
        self.name = name
        self._client = client
        self._clock = clock
        self._wall_clock = wall_clock
        self._limits = limits or ScrapeLimits()

    async def scrape(self) -> KvPoolScrape | SourceError:
        """The engine's port, then the workers' ports it publishes, all within one deadline,
        the size cap and the sample limit each; any failure is a SourceError value."""
        taken_at_s, wall_time_s = self._clock(), self._wall_clock()
        got = await self._read(self.url, self._limits, taken_at_s, wall_time_s)
        if isinstance(got, SourceError):
            return got
        engine, samples = got
        urls, refused = worker_urls(samples, self.url)
        if not urls:
            return replace(engine, refused=(*engine.refused, *refused))
        left_s = self._limits.timeout_s - (self._clock() - taken_at_s)
        if left_s <= 0:
            late = SourceError(
                WORKER_SOURCE,
                "timeout",
                f"{self._shown_url}: no time left within {self._limits.timeout_s:g} s for the "
                f"{len(urls)} worker ports",
            )
            workers: list[KvPoolScrape | SourceError] = [late]
        else:
            limits = dataclasses.replace(self._limits, timeout_s=left_s)
            read = await asyncio.gather(
                *(self._read(url, limits, taken_at_s, wall_time_s, worker=True) for url in urls)
            )
            workers = [item if isinstance(item, SourceError) else item[0] for item in read]
        merged = with_workers(engine, workers)
        return replace(merged, refused=(*merged.refused, *refused))

    async def _read(
        self,
        url: str,
        limits: ScrapeLimits,
        taken_at_s: float,
        wall_time_s: float,
        *,
        worker: bool = False,
    ) -> tuple[KvPoolScrape, list[MetricSample]] | SourceError:
        """One GET within `limits`, parsed and checked."""
        name = WORKER_SOURCE if worker else self.name
        shown = mask_url(url)
        got = await self._client.get(url, source=name, limits=limits)
        if isinstance(got, SourceError):
            return got
        if got.status_code != 200:
            return SourceError(name, "http_status", f"{shown}: {got.status_code}")
        try:
            samples = parse_samples(got.text, prefixes=(PREFIX,), sample_limit=limits.sample_limit)
        except SampleLimitError as exc:
            return SourceError(name, "too_many_samples", f"{shown}: {exc}")
        except MetricsParseError as exc:
            return SourceError(name, "parse_error", f"{shown}: {exc}")
        if not samples:
            return SourceError(name, "not_metrics", f"{shown}: no kvpool_ samples")
        try:
            scrape = samples_to_scrape(samples, taken_at_s=taken_at_s, wall_time_s=wall_time_s)
        except Exception as exc:  # a reading bug must not take the tick down; reported
            return SourceError(name, "error", f"{shown}: {exc!r}")
        return scrape, samples
