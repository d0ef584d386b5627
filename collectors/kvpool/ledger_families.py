"""The memory ledger as `kvpool_memory_*` families, served beside the plugin's own.

`kvpool_memory_part_bytes{part, source}` holds disjoint parts, `unattributed` included, so
that `sum by (device, rank)` equals `kvpool_memory_used_bytes`. A ledger that fails to read
is counted in `kvpool_plugin_errors_total{part="ledger"}` and left out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric

from kvpilot.collectors.kvpool.ledger import UNATTRIBUTED, UNATTRIBUTED_SOURCE, MemoryLedger
from kvpilot.collectors.kvpool.server import (
    AllocatorReading,
    EngineReading,
    KvPoolCollector,
    PartErrors,
)

LEDGER_LABELS = ("device", "rank")


def ledger_families(ledgers: Sequence[MemoryLedger]) -> list[Metric]:
    """Gauges for each ledger; figures a ledger lacks are absent, never zero."""
    if not ledgers:
        return []
    labels = list(LEDGER_LABELS)
    parts = GaugeMetricFamily(
        "kvpool_memory_part_bytes",
        "Memory ledger: disjoint parts of the used memory, each with the source it was read "
        "from; `unattributed` is the used memory minus the others.",
        labels=[*labels, "part", "source"],
    )
    used = GaugeMetricFamily(
        "kvpool_memory_used_bytes",
        "Used memory the ledger accounts for: the device's (GPU) or the engine process's "
        "proportional set size (CPU).",
        labels=[*labels, "source"],
    )
    kv_used = GaugeMetricFamily(
        "kvpool_memory_kv_used_bytes",
        "KV cache bytes in blocks held by requests (source: the block pool), a share of the "
        "kv_cache part.",
        labels=labels,
    )
    block = GaugeMetricFamily(
        "kvpool_memory_kv_block_bytes", "Bytes of one KV block over all layers.", labels=labels
    )
    budget = GaugeMetricFamily(
        "kvpool_memory_budget_bytes",
        "The memory budget vLLM computed at start-up (requested memory).",
        labels=[*labels, "source"],
    )
    drift = GaugeMetricFamily(
        "kvpool_memory_drift_bytes",
        "Used memory beyond the budget vLLM computed (negative: under it).",
        labels=labels,
    )
    headroom = GaugeMetricFamily(
        "kvpool_memory_headroom_bytes",
        "The device's capacity beyond vLLM's budget: the margin before out-of-memory.",
        labels=labels,
    )
    unallocated = GaugeMetricFamily(
        "kvpool_memory_unallocated_bytes",
        "Device memory held by no process (cuda_mem_get_info free).",
        labels=labels,
    )
    for ledger in ledgers:
        values = [ledger.device, ledger.rank]
        for part in ledger.parts:
            parts.add_metric([*values, part.name, part.source], part.size_bytes)
        unattributed = ledger.unattributed_bytes
        if unattributed is not None and ledger.used_bytes is not None:
            parts.add_metric([*values, UNATTRIBUTED, UNATTRIBUTED_SOURCE], unattributed)
            used.add_metric([*values, ledger.used_source], ledger.used_bytes)
        optional = (
            (kv_used, ledger.kv_used_bytes),
            (block, ledger.kv_block_bytes),
            (drift, ledger.drift_bytes),
            (headroom, ledger.headroom_bytes),
            (unallocated, ledger.unallocated_bytes),
        )
        for family, value in optional:
            if value is not None:
                family.add_metric(values, value)
        if ledger.budget_bytes is not None:
            budget.add_metric([*values, ledger.budget_source], ledger.budget_bytes)
    return [parts, used, kv_used, block, budget, drift, headroom, unallocated]


class LedgerCollector(KvPoolCollector):
    """The plugin's collector plus the ledgers of the workers in this process."""

    def __init__(
        self,
        *,
        engines: Callable[[], Sequence[EngineReading]],
        allocators: Callable[[], Sequence[AllocatorReading]],
        ledgers: Callable[[], Sequence[MemoryLedger]],
        errors: PartErrors,
        clock: Callable[[], float],
    ) -> None:
        super().__init__(engines=engines, allocators=allocators, errors=errors, clock=clock)
        self._ledgers = ledgers
        self._ledger_errors = errors

    def collect(self) -> Iterator[Metric]:
        own: list[Metric] = []
        try:  # before the base families, so a failure shows in this scrape's error count
            own = ledger_families(self._ledgers())
        except Exception as exc:  # a scrape must never take the server down
            self._ledger_errors.record("ledger", exc)
        return iter([*super().collect(), *own])
