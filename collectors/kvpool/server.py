"""The plugin's own exposition: a custom collector on a private registry, on its own port.

vLLM unregisters every `vllm:` collector it did not make, so everything here is `kvpool_`.
`collect()` runs on the HTTP server's thread and never raises: a reading that fails is
counted in `kvpool_plugin_errors_total{part}` and its families are left out. The server bounds
what a client can hold (`bounded_http`): it lives in vLLM's engine process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvpilot.collectors.kvpool.allocator import AllocatorStats
from kvpilot.collectors.kvpool.blocks import BlockPoolSnapshot
from kvpilot.collectors.kvpool.bounded_http import BoundedHttpServer, ConnectionLimits, listen

log = logging.getLogger("kvpilot.kvpool")

ENGINE_LABELS = ("engine", "model_name")
ALLOCATOR_LABELS = ("device", "rank")


class PartErrors:
    """Errors per plugin part: counted always, logged once per part (thread safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def record(self, part: str, exc: BaseException) -> None:
        with self._lock:
            first = part not in self._counts
            self._counts[part] = self._counts.get(part, 0) + 1
        if first:
            log.warning("kvpool: %s failed, that part is disabled or skipped: %r", part, exc)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


@dataclass(frozen=True, slots=True)
class EngineReading:
    """One engine's figures at scrape time; `snapshot` is None when the pool could not be read."""

    engine: str
    model_name: str
    snapshot: BlockPoolSnapshot | None
    preemptions_total: int
    last_preemption_wall_s: float | None
    scheduler_steps_total: int
    engine_snapshots_total: int = 0  # block-pool passes on the engine thread
    engine_snapshot_seconds_total: float = 0.0  # the engine thread's time in them
    # (rank on the node, port) of the engine's workers, where their ledgers are served.
    worker_ports: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class AllocatorReading:
    """One device's allocator figures, labelled with the worker rank that owns it."""

    rank: str
    stats: AllocatorStats


class KvPoolCollector:
    """prometheus_client collector (anything with `collect()`) over the plugin's readings."""

    def __init__(
        self,
        *,
        engines: Callable[[], Sequence[EngineReading]],
        allocators: Callable[[], Sequence[AllocatorReading]],
        errors: PartErrors,
        clock: Callable[[], float],
    ) -> None:
        self._engines = engines
        self._allocators = allocators
        self._errors = errors
        self._clock = clock

    @property
    def errors(self) -> PartErrors:
        return self._errors

    def collect(self) -> Iterator[Metric]:
        families: list[Metric] = []
        try:
            families.extend(self._engine_families(self._engines()))
        except Exception as exc:  # a scrape must never take the server down
            self._errors.record("collect_engines", exc)
        try:
            families.extend(self._allocator_families(self._allocators()))
        except Exception as exc:
            self._errors.record("collect_allocators", exc)
        families.append(self._error_family())
        return iter(families)

    def _engine_families(self, readings: Sequence[EngineReading]) -> list[Metric]:
        if not readings:
            return []

        def gauge(name: str, doc: str, labels: Sequence[str] = ENGINE_LABELS) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=list(labels))

        total = gauge("kvpool_blocks_usable", "Usable KV blocks (the null block excluded).")
        free = gauge("kvpool_blocks_free", "KV blocks with ref_cnt 0 (evictable cached included).")
        cached = gauge("kvpool_blocks_free_cached", "Free KV blocks that hold a prefix hash.")
        empty = gauge("kvpool_blocks_empty", "Free KV blocks without a prefix hash.")
        run = gauge("kvpool_longest_free_run_blocks", "Longest run of consecutive free block ids.")
        frag = gauge(
            "kvpool_fragmentation_ratio",
            "1 - longest free run / free; absent while too few blocks are free.",
            labels=(*ENGINE_LABELS, "source"),
        )
        slots = gauge(
            "kvpool_internal_fragmentation_slots",
            "Token slots reserved but unused in running requests' tail blocks.",
        )
        slots_ratio = gauge(
            "kvpool_internal_fragmentation_ratio",
            "Unused / reserved token slots of running requests.",
        )
        running = gauge("kvpool_requests_running", "Running requests seen in the snapshot.")
        block_size = gauge("kvpool_block_size_tokens", "Tokens per KV block.")
        age = gauge("kvpool_snapshot_age_seconds", "Age of the block-pool snapshot served.")
        preempt = CounterMetricFamily(
            "kvpool_preemptions", "Preemptions counted in the scheduler.", labels=ENGINE_LABELS
        )
        last = gauge(
            "kvpool_last_preemption_timestamp_seconds", "Wall time of the latest preemption."
        )
        steps = CounterMetricFamily(
            "kvpool_scheduler_steps", "Scheduler steps completed.", labels=ENGINE_LABELS
        )
        passes = CounterMetricFamily(
            "kvpool_engine_snapshots",
            "Block-pool passes the engine thread made for scrapes (at most one per interval).",
            labels=ENGINE_LABELS,
        )
        pass_s = CounterMetricFamily(
            "kvpool_engine_snapshot_seconds",
            "Engine-thread seconds spent in block-pool passes for scrapes.",
            labels=ENGINE_LABELS,
        )
        now_s = self._clock()
        for reading in readings:
            labels = [reading.engine, reading.model_name]
            preempt.add_metric(labels, reading.preemptions_total)
            steps.add_metric(labels, reading.scheduler_steps_total)
            passes.add_metric(labels, reading.engine_snapshots_total)
            pass_s.add_metric(labels, reading.engine_snapshot_seconds_total)
            if reading.last_preemption_wall_s is not None:
                last.add_metric(labels, reading.last_preemption_wall_s)
            snap = reading.snapshot
            if snap is None:
                continue
            counts = snap.counts
            total.add_metric(labels, counts.blocks_total)
            free.add_metric(labels, counts.blocks_free)
            cached.add_metric(labels, counts.blocks_free_cached)
            empty.add_metric(labels, counts.blocks_empty)
            run.add_metric(labels, counts.longest_free_run_blocks)
            if counts.fragmentation.ratio is not None:
                frag.add_metric([*labels, "kv_blocks"], counts.fragmentation.ratio)
            running.add_metric(labels, snap.internal.running_requests)
            if snap.internal.unused_slots is not None:
                slots.add_metric(labels, snap.internal.unused_slots)
            if snap.internal.ratio is not None:
                slots_ratio.add_metric(labels, snap.internal.ratio)
            if snap.block_size_tokens is not None:
                block_size.add_metric(labels, snap.block_size_tokens)
            age.add_metric(labels, max(now_s - snap.taken_at_s, 0.0))
        return [
            *(total, free, cached, empty, run, frag, slots, slots_ratio),
            *(running, block_size, age, preempt, last, steps, passes, pass_s),
        ]

    def _allocator_families(self, readings: Sequence[AllocatorReading]) -> list[Metric]:
        if not readings:
            return []
        labels = list(ALLOCATOR_LABELS)
        fields = (
            ("reserved_bytes", "Bytes reserved by the CUDA caching allocator."),
            ("allocated_bytes", "Bytes allocated to tensors."),
            ("active_bytes", "Bytes in active blocks (allocated or awaiting free)."),
            ("inactive_split_bytes", "Bytes in inactive, split blocks (unusable for big asks)."),
            ("free_in_reserved_bytes", "Free bytes inside reserved segments."),
            ("largest_free_block_bytes", "Largest free block inside reserved segments."),
        )
        gauges = {
            name: GaugeMetricFamily(f"kvpool_allocator_{name}", doc, labels=labels)
            for name, doc in fields
        }
        segments = GaugeMetricFamily(
            "kvpool_allocator_segments", "Reserved segments (cudaMalloc calls held).", labels=labels
        )
        retries = CounterMetricFamily(
            "kvpool_allocator_alloc_retries",
            "Allocations retried after a cache flush.",
            labels=labels,
        )
        ooms = CounterMetricFamily(
            "kvpool_allocator_ooms", "Out-of-memory errors raised.", labels=labels
        )
        frag = GaugeMetricFamily(
            "kvpool_fragmentation_ratio",
            "1 - largest free block / free bytes in reserved segments.",
            labels=["source", *labels],
        )
        for reading in readings:
            stats = reading.stats
            values = [str(stats.device), reading.rank]
            for name, family in gauges.items():
                value = getattr(stats, name)
                if value is not None:
                    family.add_metric(values, value)
            segments.add_metric(values, stats.segments)
            if stats.alloc_retries_total is not None:
                retries.add_metric(values, stats.alloc_retries_total)
            if stats.ooms_total is not None:
                ooms.add_metric(values, stats.ooms_total)
            if stats.fragmentation.ratio is not None:
                frag.add_metric(["allocator", *values], stats.fragmentation.ratio)
        return [*gauges.values(), segments, retries, ooms, frag]

    def _error_family(self) -> Metric:
        family = CounterMetricFamily(
            "kvpool_plugin_errors", "Errors inside the kvpool plugin, by part.", labels=["part"]
        )
        for part, count in sorted(self._errors.counts().items()):
            family.add_metric([part], count)
        return family


@dataclass(frozen=True, slots=True)
class RunningServer:
    """A started exposition server; `close()` stops it (tests; vLLM just exits)."""

    host: str
    port: int
    stop: Callable[[], None]

    def close(self) -> None:
        self.stop()


def serve(
    collector: KvPoolCollector,
    host: str,
    port: int,
    limits: ConnectionLimits = ConnectionLimits(),  # noqa: B008 (frozen, shared safely)
) -> RunningServer:
    """Serve `collector` alone on host:port from daemon threads; raises OSError if taken.

    What a client may hold is bounded by `limits`; an unexpected error in the server's
    threads is counted as the part "server", like every other failure of the plugin."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server = BoundedHttpServer(
        listen(host, port),
        registry,
        limits=limits,
        on_error=lambda exc: collector.errors.record("server", exc),
    )
    server.start()
    return RunningServer(host=host, port=server.address[1], stop=server.close)
