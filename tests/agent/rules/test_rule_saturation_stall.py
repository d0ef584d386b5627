from __future__ import annotations

from pathlib import Path

from kvpilot.agent.rules.config import EngineStallConfig, KvSaturationConfig
from kvpilot.agent.rules.saturation import KvSaturationRule
from kvpilot.agent.rules.stall import EngineStallRule
from kvpilot.collectors.errors import SourceError
from kvpilot.collectors.vllm_metrics import parse_vllm_metrics
from tests.agent.rules.rules_helpers import Driver, engine, instance, label, only

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm"


def saturation(**cfg: object) -> KvSaturationRule:
    return KvSaturationRule(KvSaturationConfig(**cfg))  # type: ignore[arg-type]


def stall(**cfg: object) -> EngineStallRule:
    return EngineStallRule(EngineStallConfig(**cfg))  # type: ignore[arg-type]


def test_saturated_when_full_and_requests_wait() -> None:
    c = only(
        Driver(saturation()).tick(
            1.0, engines=[engine(1.0, kv_usage_ratio=0.99, requests_waiting=3, requests_running=8)]
        )
    )
    assert c.active is True
    assert c.value == 0.99
    assert label(c, "alertname") == "VllmKvCacheSaturated"
    assert "0.990" in c.summary and "3 waiting" in c.summary


def test_full_without_waiting_or_waiting_without_full_is_not_saturation() -> None:
    driver = Driver(saturation())
    full_idle = only(
        driver.tick(1.0, engines=[engine(1.0, kv_usage_ratio=1.0, requests_waiting=0)])
    )
    assert full_idle.active is False
    queued = only(driver.tick(2.0, engines=[engine(2.0, kv_usage_ratio=0.5, requests_waiting=9)]))
    assert queued.active is False


def test_saturation_missing_gauge_is_unknown() -> None:
    c = only(Driver(saturation()).tick(1.0, engines=[engine(1.0, requests_waiting=3)]))
    assert c.active is None
    assert "KV cache usage" in (c.reason or "")


def test_saturation_on_recorded_payloads() -> None:
    """The recorded idle payload is not saturated; the loaded one is judged from its figures."""
    driver = Driver(saturation(usage_threshold_ratio=0.5))
    for t, name in ((1.0, "v0_32_idle.prom"), (2.0, "v0_32_under_load.prom")):
        samples = parse_vllm_metrics(
            (FIXTURES / name).read_text(), taken_at_s=t, wall_time_s=t + 1e9
        )
        conditions = driver.tick(t, engines=list(samples))
        assert len(conditions) == len(samples) >= 1
        for c, s in zip(conditions, samples, strict=True):
            assert s.kv_usage_ratio is not None and s.requests_waiting is not None
            expected = s.kv_usage_ratio >= 0.5 and s.requests_waiting >= 1
            assert c.active is expected
        if name == "v0_32_idle.prom":
            assert all(c.active is False for c in conditions)


def test_stall_fires_when_the_counter_stops_with_requests_present() -> None:
    driver = Driver(stall(stall_s=10))
    for t in range(5):  # progressing
        only(
            driver.tick(
                float(t),
                engines=[
                    engine(
                        float(t),
                        iterations_total=float(t * 10),
                        requests_running=2,
                        requests_waiting=1,
                    )
                ],
            )
        )
    out = None
    for t in range(5, 20):  # wedged at 40 from t=4 on
        out = only(
            driver.tick(
                float(t),
                engines=[
                    engine(float(t), iterations_total=40.0, requests_running=2, requests_waiting=1)
                ],
            )
        )
        if t - 4 < 10:
            assert out.active is False, t
    assert out is not None and out.active is True
    assert out.value == 15.0  # from the last reading that moved (t=4) to t=19
    assert label(out, "alertname") == "VllmEngineStalled"
    assert label(out, "severity") == "critical"


def test_idle_engine_with_a_still_counter_is_not_stalled() -> None:
    driver = Driver(stall(stall_s=5))
    out = None
    for t in range(20):
        out = only(
            driver.tick(
                float(t),
                engines=[
                    engine(float(t), iterations_total=7.0, requests_running=0, requests_waiting=0)
                ],
            )
        )
    assert out is not None and out.active is False


def test_stall_clock_starts_when_requests_arrive() -> None:
    driver = Driver(stall(stall_s=10))
    for t in range(30):  # idle for 30 s: the counter does not move, rightly
        driver.tick(
            float(t),
            engines=[
                engine(float(t), iterations_total=7.0, requests_running=0, requests_waiting=0)
            ],
        )
    c = only(
        driver.tick(
            30.0,
            engines=[engine(30.0, iterations_total=7.0, requests_running=0, requests_waiting=1)],
        )
    )
    assert c.active is False
    assert c.value == 0.0


def test_no_progress_seen_yet_is_unknown_until_stall_s() -> None:
    driver = Driver(stall(stall_s=10))
    for t in range(10):
        c = only(
            driver.tick(
                float(t),
                engines=[
                    engine(float(t), iterations_total=7.0, requests_running=1, requests_waiting=0)
                ],
            )
        )
        assert c.active is None, t
    c = only(
        driver.tick(
            10.0,
            engines=[engine(10.0, iterations_total=7.0, requests_running=1, requests_waiting=0)],
        )
    )
    assert c.active is True


def test_stall_without_the_counter_or_source_is_unknown() -> None:
    driver = Driver(stall(), instance("canary-a", role="canary"))
    c = only(driver.tick(1.0, engines=[engine(1.0, requests_running=1, requests_waiting=0)]))
    assert c.active is None
    assert "iteration counter" in (c.reason or "")
    assert label(c, "role") == "canary"
    down = only(driver.tick(2.0, engines=SourceError("vllm", "stats_disabled", "no vllm:")))
    assert down.active is None
    assert down.labels == c.labels
    assert "stats_disabled" in (down.reason or "")
