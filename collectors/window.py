"""The rolling window: timestamped samples per engine, turned into rates and quantiles.

Time comes only from the samples' monotonic ``taken_at_s``; the window never reads a clock.
A span ``span_s`` ending at the newest sample of a series covers the samples taken in
``[newest - span_s, newest]``.

Rates are Prometheus ``rate()``/``increase()`` without extrapolation: the increase is the
sum of the differences between consecutive samples in the span, where a counter that went
down counts from zero (a restart), and the rate divides it by the time between the span's
first and last sample. Prometheus extrapolates to the span's edges, which makes
``increase()`` of an integer counter fractional; here the figure is exactly what the
server counted between two scrapes, which is what rules about preemptions need.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Generic, Protocol, TypeVar

from kvpilot.collectors.histogram import Histogram, add, delta, quantile

EngineKey = tuple[str, str]  # (model_name, engine): one engine across scrapes
DEFAULT_QUANTILES = (0.5, 0.95, 0.99)


class WindowSample(Protocol):
    """What the window needs of a sample: a key and a monotonic stamp."""

    @property
    def key(self) -> EngineKey: ...

    @property
    def taken_at_s(self) -> float: ...


SampleT = TypeVar("SampleT", bound=WindowSample)
SampleT_co = TypeVar("SampleT_co", bound=WindowSample, covariant=True)


class Scrape(Protocol[SampleT_co]):
    """What the window needs of a scrape: a stamp and the samples taken then."""

    @property
    def taken_at_s(self) -> float: ...

    @property
    def engines(self) -> Sequence[SampleT_co]: ...


class RollingWindow(Generic[SampleT]):
    """Samples per key over the last ``retention_s`` seconds; not thread-safe (one tick owns it)."""

    def __init__(
        self,
        retention_s: float,
        *,
        thin_after_s: float | None = None,
        thin: Callable[[SampleT], SampleT] | None = None,
    ) -> None:
        """`thin`, applied to samples older than `thin_after_s`, drops what only recent
        spans read (latency histograms), so a long retention for counters stays small."""
        if retention_s <= 0:
            raise ValueError("retention_s must be positive")
        if (thin is None) != (thin_after_s is None):
            raise ValueError("thin and thin_after_s go together")
        self.retention_s = retention_s
        self._thin_after_s = thin_after_s
        self._thin = thin
        self._series: dict[EngineKey, deque[SampleT]] = {}
        self._thinned: dict[EngineKey, int] = {}  # how many of a series' oldest samples are thin
        self._last_at_s: float | None = None
        # Per series and counter or histogram field: where it last went down (a histogram by
        # its count), so that a span's increase reads two samples, not every sample of the
        # span, on every tick.
        self._resets: dict[tuple[EngineKey, str], _ResetMark] = {}

    def add(self, scrape: Scrape[SampleT]) -> None:
        """Append a scrape's samples, trim old ones, and drop engines the scrape no longer has."""
        now = scrape.taken_at_s
        if self._last_at_s is not None and now <= self._last_at_s:
            raise ValueError(f"scrape at {now} is not newer than the last one at {self._last_at_s}")
        self._last_at_s = now
        horizon = now - self.retention_s
        seen = set()
        for sample in scrape.engines:
            key = sample.key
            seen.add(key)
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = deque()
            series.append(sample)
            thinned = self._thinned.get(key, 0)
            while series[0].taken_at_s < horizon:
                series.popleft()
                thinned = max(0, thinned - 1)
            self._thinned[key] = self._thin_old(series, thinned, now)
        if len(seen) != len(self._series):
            for key in [k for k in self._series if k not in seen]:
                del self._series[key]
                self._thinned.pop(key, None)
            for mark in [m for m in self._resets if m[0] not in seen]:
                del self._resets[mark]

    def _thin_old(self, series: deque[SampleT], thinned: int, now: float) -> int:
        """Thins the samples that just became older than `thin_after_s`; returns the count."""
        if self._thin is None or self._thin_after_s is None:
            return thinned
        edge = now - self._thin_after_s
        while thinned < len(series) and series[thinned].taken_at_s < edge:
            series[thinned] = self._thin(series[thinned])
            thinned += 1
        return thinned

    def keys(self) -> list[EngineKey]:
        """The engines the latest scrape reported."""
        return list(self._series)

    def latest(self, key: EngineKey) -> SampleT | None:
        """The newest sample of an engine."""
        series = self._series.get(key)
        return series[-1] if series else None

    def newest_first(self, key: EngineKey) -> Iterator[SampleT]:
        """The samples of an engine, newest first, without copying the series (for a walk
        that stops early); the window must not change during the walk."""
        return reversed(self._series.get(key, ()))

    def covered_s(self, key: EngineKey, span_s: float) -> float | None:
        """Seconds between the oldest and the newest sample within ``span_s`` of the newest;
        None below two samples."""
        series = self._series.get(key)
        if not series:
            return None
        newest = series[-1].taken_at_s
        oldest = series[bisect_left(series, newest - span_s, key=_stamp)].taken_at_s
        return newest - oldest if oldest < newest else None

    def samples(self, key: EngineKey, span_s: float | None = None) -> list[SampleT]:
        """The samples of an engine, oldest first, within ``span_s`` of the newest if given."""
        series = self._series.get(key)
        if not series:
            return []
        if span_s is None:
            return list(series)
        start = series[-1].taken_at_s - span_s
        out = []
        for sample in reversed(series):
            if sample.taken_at_s < start:
                break
            out.append(sample)
        out.reverse()
        return out

    def increase(self, key: EngineKey, field: str, span_s: float) -> float | None:
        """How much a counter grew over the span, resets counted from 0; None below two values."""
        span = self._counter_span(key, field, span_s)
        return None if span is None else span[1]

    def rate(self, key: EngineKey, field: str, span_s: float) -> float | None:
        """Per-second increase of a counter over the span; None below two values."""
        span = self._counter_span(key, field, span_s)
        return None if span is None else span[1] / span[0]  # stamps strictly increase

    def _counter_span(
        self, key: EngineKey, field: str, span_s: float
    ) -> tuple[float, float] | None:
        newest_s = self.newest_known_at_s(key, field)
        latest = self.latest(key)
        if newest_s is None or latest is None:
            return None
        return self.increase_between(key, field, latest.taken_at_s - span_s, newest_s)

    def increase_between(
        self, key: EngineKey, field: str, start_s: float, end_s: float
    ) -> tuple[float, float] | None:
        """(seconds, increase) of a counter from its first value stamped at or after
        `start_s` to its first value stamped at or after `end_s`, resets counted from 0; None
        unless those are two values. Without a reset between them the increase is the later
        value minus the earlier, so only the two ends are read."""
        series = self._series.get(key)
        if not series:
            return None
        first = _first_known(series, field, start_s)
        last = _first_known(series, field, end_s)
        if first is None or last is None or first.taken_at_s >= last.taken_at_s:
            return None
        seconds = last.taken_at_s - first.taken_at_s
        reset_at_s = self._last_reset_at_s(key, field, series)
        if reset_at_s is None or reset_at_s <= first.taken_at_s:
            return seconds, float(getattr(last, field)) - float(getattr(first, field))
        lo = bisect_left(series, first.taken_at_s, key=_stamp)
        hi = bisect_left(series, last.taken_at_s, key=_stamp)
        return seconds, _increase(_values([series[i] for i in range(lo, hi + 1)], field))

    def newest_known_at_s(self, key: EngineKey, field: str) -> float | None:
        """The stamp of the newest sample whose `field` is known."""
        series = self._series.get(key)
        last = _last_known(series, field) if series else None
        return None if last is None else last.taken_at_s

    def histogram_over(self, key: EngineKey, field: str, span_s: float) -> Histogram | None:
        """The observations a cumulative histogram gained over the span; None below two values."""
        series = self._series.get(key)
        if not series:
            return None
        first = _first_known(series, field, series[-1].taken_at_s - span_s)
        last = _last_known(series, field)
        if first is None or last is None or first.taken_at_s >= last.taken_at_s:
            return None
        reset_at_s = self._last_reset_at_s(key, field, series)
        if reset_at_s is None or reset_at_s <= first.taken_at_s:
            # No reset among the span's values: the newest minus the oldest is the answer.
            return delta(getattr(last, field), getattr(first, field))
        hists: list[Histogram] = [h for _, h in _values(self.samples(key, span_s), field)]
        total = delta(hists[1], hists[0])
        for older, newer in pairwise(hists[1:]):
            step = delta(newer, older)
            summed = add(total, step)
            total = step if summed is None else summed  # a new bucket layout starts over
        return total

    def _last_reset_at_s(self, key: EngineKey, field: str, series: deque[SampleT]) -> float | None:
        """The stamp of the newest value of `field` below the one before it (a restart), or
        None; reads only the samples added since the last call."""
        mark = self._resets.get((key, field))
        checked_s = mark.checked_at_s if mark is not None else -math.inf
        fresh = []
        for sample in reversed(series):
            if sample.taken_at_s <= checked_s:
                break
            fresh.append(sample)
        previous = mark.count if mark is not None else None
        reset_at_s = mark.reset_at_s if mark is not None else None
        for sample in reversed(fresh):
            value = getattr(sample, field)
            if value is None:
                continue
            level = value.count if isinstance(value, Histogram) else value
            if previous is not None and level < previous:
                reset_at_s = sample.taken_at_s
            previous = level
        self._resets[(key, field)] = _ResetMark(series[-1].taken_at_s, previous, reset_at_s)
        return reset_at_s

    def quantiles(
        self, key: EngineKey, field: str, span_s: float, qs: Iterable[float] = DEFAULT_QUANTILES
    ) -> dict[float, float | None]:
        """Quantiles of the observations made during the span (as ``histogram_quantile``)."""
        h = self.histogram_over(key, field, span_s)
        return {q: (quantile(q, h) if h is not None else None) for q in qs}


def quantiles_since_start(
    sample: object, field: str, qs: Iterable[float] = DEFAULT_QUANTILES
) -> dict[float, float | None]:
    """Quantiles of everything a histogram saw since the server started (one scrape is enough)."""
    h = getattr(sample, field)
    return {q: (quantile(q, h) if h is not None else None) for q in qs}


@dataclass(frozen=True, slots=True)
class _ResetMark:
    """How far one series' counter or histogram field has been checked for restarts, and the
    last one."""

    checked_at_s: float  # samples up to this stamp have been read
    count: float | None  # the newest known value (a histogram's count) among them
    reset_at_s: float | None  # the stamp of the newest count below its predecessor


def _stamp(sample: WindowSample) -> float:
    return sample.taken_at_s


def _first_known(series: deque[SampleT], field: str, start_s: float) -> SampleT | None:
    """The oldest sample from `start_s` on whose `field` is known."""
    for i in range(bisect_left(series, start_s, key=_stamp), len(series)):
        if getattr(series[i], field) is not None:
            return series[i]
    return None


def _last_known(series: deque[SampleT], field: str) -> SampleT | None:
    """The newest sample whose `field` is known."""
    for sample in reversed(series):
        if getattr(sample, field) is not None:
            return sample
    return None


def _increase(points: list[tuple[float, float]]) -> float:
    """Sum of consecutive differences; a value below its predecessor is a reset, counted from 0."""
    total = 0.0
    prev = points[0][1]
    for _, value in points[1:]:
        total += value - prev if value >= prev else value
        prev = value
    return total


def _values(samples: Sequence[WindowSample], field: str) -> list[tuple[float, Any]]:
    """``(taken_at_s, value)`` of the samples where ``field`` is known."""
    out = []
    for s in samples:
        value = getattr(s, field)
        if value is not None:
            out.append((s.taken_at_s, value))
    return out
