"""Agent side: the `kvpool_memory_*` families of one scrape back into checked ledger samples."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvpilot.collectors.kvpool.ledger import UNATTRIBUTED
from kvpilot.collectors.promtext import MetricSample

LEDGER_PREFIX = "kvpool_memory_"
_SCALARS = {
    "kvpool_memory_used_bytes": "used_bytes",
    "kvpool_memory_kv_used_bytes": "kv_used_bytes",
    "kvpool_memory_budget_bytes": "budget_bytes",
    "kvpool_memory_drift_bytes": "drift_bytes",
    "kvpool_memory_headroom_bytes": "headroom_bytes",
    "kvpool_memory_unallocated_bytes": "unallocated_bytes",
}


@dataclass(frozen=True, slots=True)
class LedgerSample:
    """One device's ledger as served: (part, source, bytes), `unattributed` included."""

    device: str
    rank: str
    parts: tuple[tuple[str, str, float], ...]
    used_bytes: float | None = None
    kv_used_bytes: float | None = None
    budget_bytes: float | None = None
    drift_bytes: float | None = None
    headroom_bytes: float | None = None
    unallocated_bytes: float | None = None

    def part(self, name: str) -> float | None:
        return next((size for part, _, size in self.parts if part == name), None)

    @property
    def unattributed_bytes(self) -> float | None:
        return self.part(UNATTRIBUTED)


def ledgers_from_samples(samples: Iterable[MetricSample]) -> tuple[LedgerSample, ...]:
    """Group ledger samples per (device, rank); a figure that is not finite is left out, and
    a drift is only believed with a non-negative headroom beside it."""
    parts: dict[tuple[str, str], dict[str, tuple[str, float]]] = {}
    scalars: dict[tuple[str, str], dict[str, float]] = {}
    for sample in samples:
        labels = dict(sample.labels)
        key = (labels.get("device", ""), labels.get("rank", ""))
        if not math.isfinite(sample.value):
            continue
        if sample.name == "kvpool_memory_part_bytes" and "part" in labels:
            source = labels.get("source", "")
            parts.setdefault(key, {}).setdefault(labels["part"], (source, sample.value))
        elif sample.name in _SCALARS:
            scalars.setdefault(key, {}).setdefault(_SCALARS[sample.name], sample.value)
    out = []
    for key in sorted(parts.keys() | scalars.keys()):
        figures = scalars.get(key, {})
        if figures.get("headroom_bytes", 0.0) < 0:
            figures = {k: v for k, v in figures.items() if k != "headroom_bytes"}
        out.append(
            LedgerSample(
                device=key[0],
                rank=key[1],
                parts=tuple(
                    (name, source, size)
                    for name, (source, size) in sorted(parts.get(key, {}).items())
                ),
                **figures,
            )
        )
    return tuple(out)
