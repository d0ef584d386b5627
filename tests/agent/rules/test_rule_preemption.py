from __future__ import annotations

import random
from itertools import pairwise

import pytest

from kvpilot.agent.rules.config import PreemptionSpikeConfig
from kvpilot.agent.rules.preemption import PreemptionSpikeRule, baseline_rate
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.vllm_metrics import EngineSample, VllmScrape
from kvpilot.collectors.window import RollingWindow
from tests.agent.rules.rules_helpers import Driver, annotation, engine, kv_block, label, only


def rule(**cfg: object) -> PreemptionSpikeRule:
    return PreemptionSpikeRule(PreemptionSpikeConfig(**cfg))  # type: ignore[arg-type]


def run(driver: Driver, counts: list[float], *, start: float = 0.0, **fields: object):
    """One tick a second with the given cumulative preemption counts; the last conditions."""
    out = []
    for i, count in enumerate(counts):
        out = driver.tick(start + i, engines=[engine(start + i, preemptions_total=count, **fields)])
    return out


def test_first_reading_is_unknown() -> None:
    c = only(run(Driver(rule()), [0.0]))
    assert c.active is None
    assert "fewer than two" in (c.reason or "")


def test_spike_on_a_fresh_server_fires_on_the_floor_alone() -> None:
    # 10 preemptions within the 30 s window: 10 / 30 = 0.33/s > 0.1/s.
    c = only(run(Driver(rule()), [0.0] * 5 + [float(i) for i in range(1, 11)]))
    assert c.active is True
    assert c.value is not None and abs(c.value - 10 / 30) < 1e-9
    assert label(c, "alertname") == "VllmPreemptionSpike"
    assert annotation(c, "counter") == "vllm"
    assert "no baseline yet" in (annotation(c, "description") or "")
    assert annotation(c, "action") == "ladder"


def test_below_the_floor_is_inactive() -> None:
    c = only(run(Driver(rule()), [0.0] * 10 + [1.0] * 10))
    assert c.active is False
    assert c.value is not None and abs(c.value - 1 / 30) < 1e-9


def test_a_steady_rate_is_its_own_baseline() -> None:
    driver = Driver(rule(window_s=30, baseline_window_s=300))
    # 1 preemption a second for 300 s, then the same: above the floor, not above 3x baseline.
    c = only(run(driver, [float(i) for i in range(300)]))
    assert c.active is False
    assert annotation(c, "baseline_per_s") == "1"
    # Now 4 a second for the whole short window: above 3x the (old) baseline.
    counts = [299.0 + 4 * i for i in range(1, 32)]
    c = only(run(driver, counts, start=300.0))
    assert c.active is True
    assert c.value is not None and c.value > 3.0


def test_counter_reset_is_not_a_negative_rate() -> None:
    c = only(run(Driver(rule()), [50.0, 50.0, 0.0, 1.0, 2.0]))
    # After the reset: 0 counted from zero, then +1, +1.
    assert c.value is not None and abs(c.value - 2 / 30) < 1e-9


def test_plugin_counter_wins_over_the_lagging_vllm_counter() -> None:
    driver = Driver(rule())
    c = None
    for i in range(15):
        t = float(i)
        # vLLM's counter has not caught up; the plugin's counts every preemption at once.
        c = only(
            driver.tick(
                t,
                engines=[engine(t, preemptions_total=0.0)],
                kv_blocks=[kv_block(total=100, free=50, longest=50, preemptions=i)],
            )
        )
    assert c is not None
    assert c.active is True
    assert annotation(c, "counter") == "kvpool"


def test_capacity_leak_signature_is_reported() -> None:
    spike = [0.0] + [float(i) for i in range(1, 12)]
    leak = only(run(Driver(rule()), spike, kv_usage_ratio=0.97, requests_running=1))
    assert leak.facts.capacity_leak is True  # what the remediation ladder reads
    assert annotation(leak, "capacity_leak") == "true"  # what people read
    busy = only(run(Driver(rule()), spike, kv_usage_ratio=0.97, requests_running=40))
    assert busy.facts.capacity_leak is False
    assert annotation(busy, "capacity_leak") == "false"
    unknown = only(run(Driver(rule()), spike))
    assert unknown.facts.capacity_leak is None
    assert annotation(unknown, "capacity_leak") == "unknown"


def test_vllm_down_is_unknown_for_the_engines_seen() -> None:
    driver = Driver(rule())
    before = only(run(driver, [0.0, 0.0]))
    c = only(driver.tick(5.0, engines=SourceError("vllm", "refused", "down")))
    assert c.active is None
    assert c.labels == before.labels


def test_every_engine_gets_its_own_condition() -> None:
    driver = Driver(rule())
    out = []
    for i in range(12):
        t = float(i)
        out = driver.tick(
            t,
            engines=[
                engine(t, "0", preemptions_total=float(i)),
                engine(t, "1", preemptions_total=0.0),
            ],
        )
    by_engine = {label(c, "engine"): c.active for c in out}
    assert by_engine == {"0": True, "1": False}


def _reference_baseline_rate(
    window: RollingWindow, key: tuple[str, str], window_s: float, baseline_window_s: float
) -> float | None:
    """The baseline by its definition, walking every value of the baseline span."""
    points = [
        (s.taken_at_s, float(v))
        for s in window.samples(key, baseline_window_s)
        if (v := s.preemptions_total) is not None
    ]
    if not points:
        return None
    boundary = points[-1][0] - window_s
    before = [p for p in points if p[0] < boundary]
    short_first = next((p for p in points if p[0] >= boundary), None)
    span = before + ([short_first] if short_first is not None else [])
    if not before or len(span) < 2 or span[-1][0] - span[0][0] < window_s:
        return None
    total = sum(b - a if b >= a else b for (_, a), (_, b) in pairwise(span))
    return total / (span[-1][0] - span[0][0])


@pytest.mark.parametrize("seed", range(6))
def test_the_baseline_read_from_the_span_ends_matches_the_full_walk(seed: int) -> None:
    rng = random.Random(seed)
    window: RollingWindow = RollingWindow(retention_s=120)
    total = 0.0
    for t in range(240):
        if rng.random() < 0.04:
            total = float(rng.randrange(3))  # vLLM restarted
        total += rng.randrange(3)
        known = rng.random() > 0.1
        sample = EngineSample(
            model_name="m",
            engine="0",
            taken_at_s=float(t),
            wall_time_s=1e9 + t,
            preemptions_total=total if known else None,
        )
        window.add(
            VllmScrape(
                taken_at_s=float(t), wall_time_s=1e9 + t, engines=(sample,), vllm_version=None
            )
        )
        window_s, baseline_s = rng.choice(((5.0, 30.0), (30.0, 100.0), (10.0, 12.0)))
        got = baseline_rate(window, ("m", "0"), window_s=window_s, baseline_window_s=baseline_s)
        want = _reference_baseline_rate(window, ("m", "0"), window_s, baseline_s)
        assert got == (None if want is None else pytest.approx(want)), (t, window_s, baseline_s)
