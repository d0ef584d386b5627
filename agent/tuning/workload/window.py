"""The served workload over a sliding window, from each tick's scrape of the stable server.

Every scrape is compared with the one before it, engine by engine, and only the increase is
kept (with the time it was seen): the window is the sum of the increases no older than
`window_s`. A counter or histogram that went down is a restarted server, whose new value is
the increase since it started (as Prometheus's `increase()` reads a reset), so a restart
neither subtracts nor counts anything twice. An engine's first scrape only sets its base.

Each scrape's gauges are sampled too: the KV blocks in use (`vllm:kv_cache_usage_perc` of
the engine's blocks; prefix-cached blocks that could be evicted count as free, as in vLLM,
and a block shared by several requests counts once) and the requests running. Their ratio
over the window is the KV a running request holds, as the server measured it: what the
tuner's planner otherwise estimates from lengths. The samples are not kept across a restart
of kvpilot (a window restored from disk refills them within `MIN_GAUGE_SAMPLES` ticks).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from kvpilot.collectors.histogram import Histogram, add, delta
from kvpilot.collectors.vllm_parse import EngineKey, EngineSample, VllmScrape
from kvpilot.tuner.load.learned import WorkloadShape


@dataclass(frozen=True, slots=True)
class Increase:
    """What one engine served between two scrapes (or, restored, within one minute)."""

    at_s: float
    prompt: Histogram | None
    generation: Histogram | None
    finished: float
    hits: float
    queries: float


def _counter_increase(newer: float | None, older: float | None) -> float:
    if newer is None:
        return 0.0
    if older is None or newer < older:  # a reset: all of the new value is new
        return newer if older is not None else 0.0
    return newer - older


def _hist_increase(newer: Histogram | None, older: Histogram | None) -> Histogram | None:
    if newer is None or older is None:
        return None
    return delta(newer, older)


MIN_GAUGE_SAMPLES = 3  # fewer samples of the running requests say nothing of their KV


@dataclass(frozen=True, slots=True)
class GaugeSample:
    """One scrape's KV blocks in use and requests running, summed over its engines."""

    at_s: float
    blocks_used: int
    running: int


class WorkloadWindow:
    """The last `window_s` seconds of served traffic, fed one scrape at a time."""

    def __init__(self, window_s: float) -> None:
        if not window_s > 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._last: dict[EngineKey, EngineSample] = {}
        self._increases: deque[Increase] = deque()
        self._gauges: deque[GaugeSample] = deque()
        self._first_s: float | None = None  # the oldest scrape the window still covers
        self._latest_s: float | None = None
        self._block_size: int | None = None

    def observe(self, scrape: VllmScrape) -> None:
        """Add one scrape (a scrape seen before, or older than the latest, is ignored)."""
        now = scrape.taken_at_s
        if self._latest_s is not None and now <= self._latest_s:
            return
        if self._first_s is None:
            self._first_s = now
        self._latest_s = now
        for engine in scrape.engines:
            before = self._last.get(engine.key)
            self._last[engine.key] = engine
            self._block_size = engine.block_size or self._block_size
            if before is not None:
                self._increases.append(_increase(now, engine, before))
        for gone in set(self._last) - {e.key for e in scrape.engines}:
            del self._last[gone]  # back later: a new base, as after a restart
        gauges = _gauges(now, scrape.engines)
        if gauges is not None:
            self._gauges.append(gauges)
        self._forget(now)

    def _forget(self, now: float) -> None:
        horizon = now - self.window_s
        while self._increases and self._increases[0].at_s <= horizon:
            self._increases.popleft()
        while self._gauges and self._gauges[0].at_s <= horizon:
            self._gauges.popleft()
        if self._first_s is not None and self._first_s < horizon:
            self._first_s = horizon

    @property
    def first_s(self) -> float | None:
        """The oldest moment the window still covers (monotonic), None before any scrape."""
        return self._first_s

    @property
    def block_size(self) -> int | None:
        """The KV block size the stable server reported last."""
        return self._block_size

    def increases(self) -> tuple[Increase, ...]:
        """What the window holds, oldest first (for `workload.keep`)."""
        return tuple(self._increases)

    def restore(
        self, increases: Iterable[Increase], first_s: float, block_size: int | None, now: float
    ) -> None:
        """Take back what an earlier kvpilot's window held (times already on this process's
        monotonic clock), into a window that has seen nothing yet; what is older than the
        window is dropped. The next scrape of each engine sets its base, as after a restart."""
        if self._latest_s is not None:
            raise RuntimeError("restore into a window that has already seen a scrape")
        kept = sorted(
            (i for i in increases if now - self.window_s < i.at_s <= now), key=lambda i: i.at_s
        )
        if not kept:
            return
        self._increases.extend(kept)
        self._first_s = max(min(first_s, kept[0].at_s), now - self.window_s)
        self._latest_s = kept[-1].at_s
        self._block_size = block_size

    def total(self) -> Increase | None:
        """All the window holds as one increase at its latest (its summary), or None."""
        if not self._increases:
            return None
        return Increase(
            at_s=self._increases[-1].at_s,
            prompt=_summed(i.prompt for i in self._increases),
            generation=_summed(i.generation for i in self._increases),
            finished=sum(self._finished(i) for i in self._increases),
            hits=sum(i.hits for i in self._increases),
            queries=sum(i.queries for i in self._increases),
        )

    def requests(self) -> int:
        """Requests finished within the window."""
        return round(sum(self._finished(i) for i in self._increases))

    @staticmethod
    def _finished(i: Increase) -> float:
        """Finished requests: the success counter, else the length histogram's count."""
        if i.finished > 0 or i.prompt is None:
            return i.finished
        return i.prompt.count

    def shape(self) -> WorkloadShape | None:
        """The window's shape; None before two scrapes of a server that finished requests."""
        if self._first_s is None or self._latest_s is None:
            return None
        covered = self._latest_s - self._first_s
        prompt = _summed(i.prompt for i in self._increases)
        generation = _summed(i.generation for i in self._increases)
        served = self.requests()
        if prompt is None or generation is None or served == 0 or covered <= 0:
            return None
        queries = sum(i.queries for i in self._increases)
        hits = sum(i.hits for i in self._increases)
        return WorkloadShape(
            prompt_tokens=prompt,
            generation_tokens=generation,
            rate_rps=served / covered,
            prefix_hit_ratio=min(1.0, hits / queries) if queries > 0 else None,
            requests=served,
            window_s=covered,
            block_size=self._block_size,
            kv_blocks_per_running=self.kv_blocks_per_running(),
        )

    def kv_blocks_per_running(self) -> float | None:
        """The KV blocks a running request held over the window (blocks in use over requests
        running, each summed over the samples); None with fewer than `MIN_GAUGE_SAMPLES`
        samples in which a request ran."""
        busy = [g for g in self._gauges if g.running > 0]
        if len(busy) < MIN_GAUGE_SAMPLES:
            return None
        return sum(g.blocks_used for g in busy) / sum(g.running for g in busy)


def _gauges(now: float, engines: Iterable[EngineSample]) -> GaugeSample | None:
    """The scrape's blocks in use and requests running, summed over its engines; None when
    an engine reports either not (a sum that left one out would mislead)."""
    used, running = 0, 0
    for engine in engines:
        total, free, busy = engine.blocks_total, engine.blocks_free, engine.requests_running
        if total is None or free is None or busy is None:
            return None
        used += max(0, total - free)
        running += busy
    return GaugeSample(now, used, running)


def _increase(now: float, engine: EngineSample, before: EngineSample) -> Increase:
    return Increase(
        at_s=now,
        prompt=_hist_increase(engine.request_prompt_tokens, before.request_prompt_tokens),
        generation=_hist_increase(
            engine.request_generation_tokens, before.request_generation_tokens
        ),
        finished=_counter_increase(engine.requests_success_total, before.requests_success_total),
        hits=_counter_increase(engine.prefix_cache_hits_total, before.prefix_cache_hits_total),
        queries=_counter_increase(
            engine.prefix_cache_queries_total, before.prefix_cache_queries_total
        ),
    )


def _summed(parts: Iterable[Histogram | None]) -> Histogram | None:
    """The bucket-wise sum of the histograms (skipping None and other layouts)."""
    total: Histogram | None = None
    for h in parts:
        if h is None:
            continue
        total = h if total is None else (add(total, h) or total)
    return total
