"""One collection tick: take a snapshot, feed the window, derive the figures, count errors.

Errors are counted by source and reason: a source that gave no sample by its kind
(`timeout`, `too_large`, ...), and each value the edge checks refused by its reason
(`out_of_range`, `duplicate_series`, ...), so a refused value is never silent.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvpilot.agent.readings.derive import EngineFigures, derive_figures
from kvpilot.agent.readings.snapshot import SOURCES, NvmlReading, Snapshot, SnapshotTaker
from kvpilot.agent.tick.calibration import EngineCalibration, PlannerCheck
from kvpilot.collectors.checks import Refused
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.kvpool.client import WORKER_SOURCE, KvBlockSample, KvPoolScrape
from kvpilot.collectors.vllm_metrics import EngineSample, VllmScrape
from kvpilot.collectors.vllm_parse import kept_for_counters
from kvpilot.collectors.window import RollingWindow

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TickState:
    """What the latest tick produced; read by the exposition, the API and the views.

    Written only by `Ticker.tick` on the event loop; readers take references to immutable
    values, so a scrape in another thread sees one tick or the next, never a mix.
    """

    latest: Snapshot | None = None
    figures: tuple[EngineFigures, ...] = ()
    ticks_total: int = 0
    last_tick_at_s: float | None = None
    errors_total: Counter[tuple[str, str]] = field(default_factory=Counter)
    calibrations: tuple[EngineCalibration, ...] = ()


class Ticker:
    """Reads every source once per tick and keeps the rolling windows."""

    def __init__(
        self,
        taker: SnapshotTaker,
        *,
        rate_span_s: float = 60.0,
        quantile_span_s: float = 60.0,
        retention_s: float = 600.0,
        planner: PlannerCheck | None = None,
    ) -> None:
        self._taker = taker
        self._planner = planner
        self.rate_span_s = rate_span_s
        self.quantile_span_s = quantile_span_s
        # Latency histograms are read over the rate and quantile spans only; older samples
        # keep their counters (the preemption baseline, the stall rule look back further).
        self.vllm_window: RollingWindow[EngineSample] = RollingWindow(
            retention_s=retention_s,
            thin_after_s=2 * max(rate_span_s, quantile_span_s),
            thin=kept_for_counters,
        )
        self.kvpool_window: RollingWindow[KvBlockSample] = RollingWindow(retention_s=retention_s)
        self.state = TickState()
        self._failing: set[str] = set()
        self._refusing: set[tuple[str, str, str]] = set()  # (source, field, reason)

    def use_taker(self, taker: SnapshotTaker) -> None:
        """Read the server at new addresses from the next tick on; the windows and counts
        stay (a restarted server's counters reset, which the rates handle)."""
        self._taker = taker

    async def tick(self, nvml: NvmlReading) -> Snapshot:
        snapshot = await self._taker.take(nvml)
        if isinstance(snapshot.vllm, VllmScrape):
            self.vllm_window.add(snapshot.vllm)
        if isinstance(snapshot.kvpool, KvPoolScrape):
            self.kvpool_window.add(snapshot.kvpool)
        figures = derive_figures(
            snapshot,
            self.vllm_window,
            self.kvpool_window,
            rate_span_s=self.rate_span_s,
            quantile_span_s=self.quantile_span_s,
        )
        self._count_errors(snapshot, nvml)
        self._count_refused(snapshot)
        state = self.state
        state.latest, state.figures = snapshot, figures
        if self._planner is not None and isinstance(snapshot.vllm, VllmScrape):
            state.calibrations = self._planner.check(snapshot.vllm)
        state.ticks_total += 1
        state.last_tick_at_s = snapshot.taken_at_s
        return snapshot

    def _count_errors(self, snapshot: Snapshot, nvml: NvmlReading) -> None:
        errors = self.state.errors_total
        for source in SOURCES:
            value = getattr(snapshot, source)
            if isinstance(value, SourceError):
                errors[(source, value.kind)] += 1
                if source not in self._failing:
                    # One line when a source starts failing, one when it recovers.
                    log.warning("source %s failing: %s: %s", source, value.kind, value.message)
                    self._failing.add(source)
            elif value is not None and source in self._failing:
                log.info("source %s recovered", source)
                self._failing.discard(source)
        # The workers' plugin ports, read after the engine's (a CPU engine's ledger is there).
        kvpool = snapshot.kvpool
        if isinstance(kvpool, KvPoolScrape):
            for error in kvpool.worker_errors:
                errors[(error.source, error.kind)] += 1
                if error.source not in self._failing:
                    log.warning(
                        "source %s failing: %s: %s", error.source, error.kind, error.message
                    )
                    self._failing.add(error.source)
            if not kvpool.worker_errors and WORKER_SOURCE in self._failing:
                log.info("source %s recovered", WORKER_SOURCE)
                self._failing.discard(WORKER_SOURCE)
        # NVML's per-call errors (one device, one reading), as the collector that read them
        # tallied them.
        for reason, count in nvml.call_errors.items():
            errors[("nvml_call", reason)] = count

    def _count_refused(self, snapshot: Snapshot) -> None:
        """Each value refused at the edge, by source and reason; one log line when a field
        starts being refused, one when it stops."""
        errors = self.state.errors_total
        now: dict[tuple[str, str, str], str] = {}
        for source in ("vllm", "kvpool"):
            for item in _refusals(getattr(snapshot, source)):
                errors[(source, item.reason)] += 1
                now.setdefault((source, item.field, item.reason), item.detail)
        for (source, name, reason), detail in now.items():
            if (source, name, reason) not in self._refusing:
                log.warning("source %s: %s refused (%s): %s", source, name, reason, detail)
        for source, name, reason in self._refusing - now.keys():
            log.info("source %s: %s no longer refused (%s)", source, name, reason)
        self._refusing = set(now)


def _refusals(scrape: object) -> Iterator[Refused]:
    """Every refusal a scrape carries: its own and its engines' and devices'."""
    if isinstance(scrape, VllmScrape):
        for engine in scrape.engines:
            yield from engine.refused
    elif isinstance(scrape, KvPoolScrape):
        yield from scrape.refused
        for sample in scrape.engines:
            yield from sample.refused
        for device in scrape.allocators:
            yield from device.refused
