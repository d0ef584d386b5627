"""The rolling window, with time driven through the samples' stamps."""

from __future__ import annotations

import dataclasses
import math
import random
from itertools import pairwise
from pathlib import Path

import pytest

from kvpilot.collectors.histogram import Histogram, add, delta, quantile
from kvpilot.collectors.vllm_metrics import EngineSample, VllmScrape, parse_vllm_metrics
from kvpilot.collectors.vllm_parse import kept_for_counters
from kvpilot.collectors.window import RollingWindow, quantiles_since_start

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
KEY = ("m", "0")
INF = math.inf


def engine(t: float, engine_id: str = "0", **fields: object) -> EngineSample:
    return EngineSample(
        model_name="m", engine=engine_id, taken_at_s=t, wall_time_s=1e9 + t, **fields
    )


def scrape(t: float, *engines: EngineSample) -> VllmScrape:
    return VllmScrape(taken_at_s=t, wall_time_s=1e9 + t, engines=engines, vllm_version="0.32.0")


def feed(window: RollingWindow, points: list[tuple[float, float]], field: str) -> None:
    for t, v in points:
        window.add(scrape(t, engine(t, **{field: v})))


def test_rate_is_increase_over_elapsed_time() -> None:
    w = RollingWindow(retention_s=60)
    feed(w, [(0, 10), (1, 12), (2, 15), (3, 15), (4, 22)], "preemptions_total")
    assert w.increase(KEY, "preemptions_total", 10) == 12
    assert w.rate(KEY, "preemptions_total", 10) == pytest.approx(12 / 4)
    # A 2 s span ending at the newest sample covers t=2..4.
    assert w.increase(KEY, "preemptions_total", 2) == 7
    assert w.rate(KEY, "preemptions_total", 2) == pytest.approx(7 / 2)


def test_counter_reset_counts_from_zero() -> None:
    w = RollingWindow(retention_s=60)
    # 100 -> 130 (+30), restart, 4 (+4), 10 (+6): 40 in all, as Prometheus's increase() sees
    # it before extrapolation.
    feed(w, [(0, 100), (1, 130), (2, 4), (3, 10)], "generation_tokens_total")
    assert w.increase(KEY, "generation_tokens_total", 60) == 40
    assert w.rate(KEY, "generation_tokens_total", 60) == pytest.approx(40 / 3)


def test_fewer_than_two_samples_give_none() -> None:
    w = RollingWindow(retention_s=60)
    assert w.rate(KEY, "preemptions_total", 10) is None
    feed(w, [(0, 1)], "preemptions_total")
    assert w.rate(KEY, "preemptions_total", 10) is None
    assert w.increase(KEY, "preemptions_total", 10) is None
    assert w.quantiles(KEY, "ttft", 10) == {0.5: None, 0.95: None, 0.99: None}
    feed(w, [(5, 3)], "preemptions_total")
    assert w.rate(KEY, "preemptions_total", 1) is None  # only t=5 is inside a 1 s span
    assert w.rate(KEY, "preemptions_total", 5) == pytest.approx(2 / 5)


def test_unknown_values_are_skipped_not_zeroed() -> None:
    w = RollingWindow(retention_s=60)
    w.add(scrape(0, engine(0, preemptions_total=5.0)))
    w.add(scrape(1, engine(1)))  # the family was missing this time
    w.add(scrape(2, engine(2, preemptions_total=9.0)))
    assert w.increase(KEY, "preemptions_total", 60) == 4
    assert w.rate(KEY, "preemptions_total", 60) == pytest.approx(2.0)
    assert w.rate(KEY, "kv_usage_ratio", 60) is None


def test_retention_trims_old_samples() -> None:
    w = RollingWindow(retention_s=10)
    feed(w, [(float(t), float(t)) for t in range(0, 31)], "iterations_total")
    kept = w.samples(KEY)
    assert [s.taken_at_s for s in kept] == [float(t) for t in range(20, 31)]
    # A span longer than the retention sees only what is kept.
    assert w.increase(KEY, "iterations_total", 100) == 10


def test_engines_that_disappear_are_dropped() -> None:
    w = RollingWindow(retention_s=60)
    w.add(scrape(0, engine(0, "0", iterations_total=1.0), engine(0, "1", iterations_total=1.0)))
    w.add(scrape(1, engine(1, "0", iterations_total=2.0), engine(1, "1", iterations_total=3.0)))
    assert sorted(w.keys()) == [("m", "0"), ("m", "1")]
    assert w.increase(("m", "1"), "iterations_total", 60) == 2
    w.add(scrape(2, engine(2, "0", iterations_total=3.0)))
    assert w.keys() == [("m", "0")]
    assert w.latest(("m", "1")) is None
    assert w.increase(("m", "1"), "iterations_total", 60) is None
    assert w.latest(("m", "0")).taken_at_s == 2


def test_time_must_move_forward() -> None:
    w = RollingWindow(retention_s=60)
    w.add(scrape(5, engine(5)))
    with pytest.raises(ValueError, match="not newer"):
        w.add(scrape(5, engine(5)))
    with pytest.raises(ValueError):
        RollingWindow(retention_s=0)


def h(*buckets: tuple[float, float], total: float) -> Histogram:
    return Histogram(buckets=tuple(buckets), sum=total, count=buckets[-1][1])


def test_quantiles_over_a_span_checked_by_hand() -> None:
    w = RollingWindow(retention_s=600)
    old = h((0.1, 100), (0.5, 100), (1.0, 100), (INF, 100), total=5.0)  # before the span
    t0 = h((0.1, 110), (0.5, 120), (1.0, 125), (INF, 125), total=12.0)
    t1 = h((0.1, 112), (0.5, 140), (1.0, 150), (INF, 150), total=25.0)
    t2 = h((0.1, 120), (0.5, 160), (1.0, 175), (INF, 175), total=40.0)
    for t, hist in [(0, old), (100, t0), (110, t1), (120, t2)]:
        w.add(scrape(t, engine(t, ttft=hist)))
    over = w.histogram_over(KEY, "ttft", 20)
    # Observations between t=100 and t=120: 10 under 0.1, 30 in (0.1, 0.5], 10 in (0.5, 1].
    assert over == h((0.1, 10), (0.5, 40), (1.0, 50), (INF, 50), total=28.0)
    qs = w.quantiles(KEY, "ttft", 20, qs=(0.5, 0.9))
    # p50: rank 25 of 50 lies in (0.1, 0.5] at 15 of 30: 0.1 + 0.4 * 15/30 = 0.3.
    assert qs[0.5] == pytest.approx(0.3)
    # p90: rank 45 lies in (0.5, 1.0] at 5 of 10: 0.5 + 0.5 * 5/10 = 0.75.
    assert qs[0.9] == pytest.approx(0.75)


def test_histogram_over_survives_a_restart() -> None:
    w = RollingWindow(retention_s=600)
    a = h((1.0, 10), (INF, 12), total=9.0)
    b = h((1.0, 14), (INF, 18), total=15.0)  # +4 under 1 s, +2 above
    restarted = h((1.0, 1), (INF, 1), total=0.5)  # +1 under 1 s after the restart
    c = h((1.0, 3), (INF, 4), total=3.0)  # +2 under, +1 above
    for t, hist in [(0, a), (1, b), (2, restarted), (3, c)]:
        w.add(scrape(t, engine(t, ttft=hist)))
    over = w.histogram_over(KEY, "ttft", 60)
    assert over == h((1.0, 7), (INF, 10), total=9.0)


def test_since_start_quantiles_need_one_sample() -> None:
    hist = h((0.1, 10), (0.5, 30), (1.0, 40), (INF, 40), total=17.0)
    sample = engine(0, ttft=hist)
    assert quantiles_since_start(sample, "ttft") == {
        q: quantile(q, hist) for q in (0.5, 0.95, 0.99)
    }
    assert quantiles_since_start(sample, "ttft")[0.5] == pytest.approx(0.3)
    assert quantiles_since_start(sample, "e2e_latency") == {0.5: None, 0.95: None, 0.99: None}


def test_real_consecutive_scrapes() -> None:
    texts = [(FIXTURES / n).read_text() for n in ("v0_32_series_a.prom", "v0_32_series_b.prom")]
    a, b = (
        parse_vllm_metrics(t, taken_at_s=s, wall_time_s=s)
        for t, s in zip(texts, (0, 2.0), strict=True)
    )
    w = RollingWindow(retention_s=60)
    w.add(VllmScrape(0.0, 0.0, a, None))
    w.add(VllmScrape(2.0, 2.0, b, None))
    key = a[0].key
    gen_a, gen_b = a[0].generation_tokens_total, b[0].generation_tokens_total
    assert gen_b > gen_a
    assert w.rate(key, "generation_tokens_total", 10) == pytest.approx((gen_b - gen_a) / 2)
    itl = w.histogram_over(key, "inter_token_latency", 10)
    assert itl is not None
    assert itl.count == b[0].inter_token_latency.count - a[0].inter_token_latency.count
    p50 = w.quantiles(key, "inter_token_latency", 10)[0.5]
    assert p50 is not None and 0 < p50 < itl.buckets[-2][0]


def test_window_does_not_alter_samples() -> None:
    w = RollingWindow(retention_s=60)
    s0 = engine(0, preemptions_total=1.0)
    w.add(scrape(0, s0))
    assert w.latest(KEY) is s0
    with pytest.raises(dataclasses.FrozenInstanceError):
        s0.preemptions_total = 2.0  # type: ignore[misc]


def test_samples_older_than_the_thin_edge_lose_what_only_recent_spans_read() -> None:
    window: RollingWindow[EngineSample] = RollingWindow(
        retention_s=600.0, thin_after_s=120.0, thin=kept_for_counters
    )
    hist = Histogram(buckets=((0.1, 1.0), (math.inf, 2.0)), sum=0.3, count=2.0)
    for t in range(0, 400, 10):
        sample = EngineSample("m", "0", float(t), float(t), preemptions_total=float(t), ttft=hist)
        window.add(VllmScrape(float(t), float(t), (sample,), None))
    series = window.samples(("m", "0"))
    old = [s for s in series if s.taken_at_s < 390 - 120]
    recent = [s for s in series if s.taken_at_s >= 390 - 120]
    assert old and all(s.ttft is None for s in old)
    assert recent and all(s.ttft is hist for s in recent)
    # Counters survive thinning: the long span still has its rate.
    assert window.rate(("m", "0"), "preemptions_total", 390.0) == 1.0


def _reference_histogram_over(
    window: RollingWindow, key: tuple[str, str], field: str, span_s: float
) -> Histogram | None:
    """The span's histogram from every value in it: consecutive differences, resets restart."""
    hists = [getattr(s, field) for s in window.samples(key, span_s)]
    hists = [h for h in hists if h is not None]
    if len(hists) < 2:
        return None
    total = delta(hists[1], hists[0])
    for older, newer in pairwise(hists[1:]):
        step = delta(newer, older)
        summed = add(total, step)
        total = step if summed is None else summed
    return total


def _hist(count: float) -> Histogram:
    return Histogram(buckets=((0.1, count / 2), (1.0, count), (INF, count)), sum=count, count=count)


@pytest.mark.parametrize("seed", range(8))
def test_span_histogram_matches_every_difference_read_one_by_one(seed: int) -> None:
    """The remembered last restart never changes an answer: restarts, gaps, thinned old
    samples and an engine that leaves and comes back, checked against a full walk each tick."""
    rng = random.Random(seed)
    w: RollingWindow[EngineSample] = RollingWindow(
        retention_s=40, thin_after_s=25, thin=kept_for_counters
    )
    count = 0.0
    for t in range(160):
        if rng.random() < 0.06:
            count = float(rng.randrange(3))  # a restart
        count += rng.randrange(4)
        known = rng.random() > 0.15  # a scrape without the family
        engines = [engine(t, ttft=_hist(count) if known else None)]
        if not 60 <= t < 70:  # engine 1 leaves for ten scrapes, then returns
            engines.append(engine(t, "1", ttft=_hist(count + 5)))
        w.add(scrape(t, *engines))
        for key in (KEY, ("m", "1")):
            span_s = rng.choice((1, 3, 10, 30, 60))
            got = w.histogram_over(key, "ttft", span_s)
            assert got == _reference_histogram_over(w, key, "ttft", span_s), (t, key, span_s)


@dataclasses.dataclass(frozen=True)
class _CountingSample:
    """A sample whose histogram counts how often it is read."""

    taken_at_s: float
    h: Histogram
    reads: list[int]
    key: tuple[str, str] = KEY

    @property
    def hist(self) -> Histogram:
        self.reads[0] += 1
        return self.h


@dataclasses.dataclass(frozen=True)
class _CountingScrape:
    taken_at_s: float
    engines: tuple[_CountingSample, ...]


def test_a_span_histogram_reads_the_new_samples_not_the_whole_span() -> None:
    """At 1 Hz a tick asks for the same spans again: the samples read are the ones added
    since, and the span's two ends, not every sample of a full window."""
    reads = [0]
    w: RollingWindow[_CountingSample] = RollingWindow(retention_s=600)
    for t in range(600):
        w.add(_CountingScrape(t, (_CountingSample(t, _hist(float(t)), reads),)))
    assert w.histogram_over(KEY, "hist", 300) == delta(_hist(599.0), _hist(299.0))
    w.add(_CountingScrape(600, (_CountingSample(600, _hist(600.0), reads),)))
    reads[0] = 0
    assert w.histogram_over(KEY, "hist", 300) == delta(_hist(600.0), _hist(300.0))
    assert reads[0] <= 6


def _reference_increase(
    w: RollingWindow[EngineSample], key: tuple[str, str], field: str, span_s: float
) -> tuple[float, float] | None:
    """(seconds, increase) by the definition: every consecutive difference of the span's
    values, a value below its predecessor counted from 0."""
    points = [
        (s.taken_at_s, float(v))
        for s in w.samples(key, span_s)
        if (v := getattr(s, field)) is not None
    ]
    if len(points) < 2:
        return None
    total = sum(b - a if b >= a else b for (_, a), (_, b) in pairwise(points))
    return points[-1][0] - points[0][0], total


@pytest.mark.parametrize("seed", range(8))
def test_counter_increase_and_rate_match_the_full_walk(seed: int) -> None:
    """Reading a counter's span from its two ends never changes an answer: restarts inside
    and before the span, gaps, and an engine that leaves and comes back."""
    rng = random.Random(seed)
    w: RollingWindow[EngineSample] = RollingWindow(retention_s=40)
    total = 0.0
    for t in range(160):
        if rng.random() < 0.06:
            total = float(rng.randrange(3))  # a restart
        total += rng.randrange(4)
        known = rng.random() > 0.15
        engines = [engine(t, preemptions_total=total if known else None)]
        if not 60 <= t < 70:
            engines.append(engine(t, "1", preemptions_total=total + 5))
        w.add(scrape(t, *engines))
        for key in (KEY, ("m", "1")):
            span_s = rng.choice((1, 3, 10, 30, 60))
            want = _reference_increase(w, key, "preemptions_total", span_s)
            got_increase = w.increase(key, "preemptions_total", span_s)
            got_rate = w.rate(key, "preemptions_total", span_s)
            if want is None:
                assert (got_increase, got_rate) == (None, None), (t, key, span_s)
            else:
                assert got_increase == pytest.approx(want[1]), (t, key, span_s)
                assert got_rate == pytest.approx(want[1] / want[0]), (t, key, span_s)


@dataclasses.dataclass(frozen=True)
class _CountingCounterSample:
    """A sample whose counter counts how often it is read."""

    taken_at_s: float
    value: float
    reads: list[int]
    key: tuple[str, str] = KEY

    @property
    def total(self) -> float:
        self.reads[0] += 1
        return self.value


def test_a_counter_rate_reads_the_new_samples_not_the_whole_span() -> None:
    reads = [0]
    w: RollingWindow[_CountingCounterSample] = RollingWindow(retention_s=600)
    for t in range(600):
        w.add(_CountingScrape(t, (_CountingCounterSample(t, 2.0 * t, reads),)))  # type: ignore[arg-type]
    assert w.rate(KEY, "total", 300) == pytest.approx(2.0)
    w.add(_CountingScrape(600, (_CountingCounterSample(600, 1200.0, reads),)))  # type: ignore[arg-type]
    reads[0] = 0
    assert w.increase(KEY, "total", 300) == pytest.approx(600.0)
    assert reads[0] <= 6


@pytest.mark.parametrize("span_s", [0.5, 1, 2.5, 3, 10])
def test_the_seconds_a_span_covers_are_those_of_its_samples(span_s: float) -> None:
    w: RollingWindow[EngineSample] = RollingWindow(retention_s=60)
    assert w.covered_s(KEY, span_s) is None
    feed(w, [(0, 1.0)], "preemptions_total")
    assert w.covered_s(KEY, span_s) is None  # one sample covers nothing
    feed(w, [(1, 1.0), (2, 1.0), (4, 1.0)], "preemptions_total")
    in_span = w.samples(KEY, span_s)
    want = in_span[-1].taken_at_s - in_span[0].taken_at_s if len(in_span) >= 2 else None
    assert w.covered_s(KEY, span_s) == want
