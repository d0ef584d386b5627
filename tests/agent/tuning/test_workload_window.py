"""The learned workload's window: increases between scrapes, summed over `window_s`; a
restarted server (counters that went down) neither subtracts nor counts twice."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.agent.tuning.workload.window import WorkloadWindow
from tests.agent.tuning.workload_scrapes import engine, scrape, served


def test_one_scrape_is_only_a_base() -> None:
    window = WorkloadWindow(600)
    window.observe(served(500, at_s=0.0))  # what it served before the window began
    assert window.requests() == 0
    assert window.shape() is None


def test_the_shape_is_the_increase_over_the_window() -> None:
    window = WorkloadWindow(600)
    window.observe(served(100, at_s=0.0, prompt=300, output=60))
    window.observe(served(160, at_s=30.0, prompt=300, output=60, hits=9000.0))
    window.observe(served(220, at_s=60.0, prompt=300, output=60, hits=18000.0))
    shape = window.shape()
    assert shape is not None
    assert window.requests() == shape.requests == 120
    assert shape.window_s == pytest.approx(60.0)
    assert shape.rate_rps == pytest.approx(2.0)
    assert shape.prompt_tokens.count == 120
    assert shape.prompt_tokens.sum == pytest.approx(300 * 120)
    assert shape.generation_tokens.count == 120
    # queries grew by 300 tokens a request (36000), hits by 18000 - 0 (cumulative from 0).
    assert shape.prefix_hit_ratio == pytest.approx(18000 / 36000)
    assert shape.block_size == 16


def test_a_counter_reset_is_the_new_value_never_negative_or_doubled() -> None:
    window = WorkloadWindow(600)
    window.observe(served(1000, at_s=0.0))
    window.observe(served(1100, at_s=10.0))  # +100
    window.observe(served(30, at_s=20.0))  # restarted: 30 since the restart
    window.observe(served(80, at_s=30.0))  # +50
    shape = window.shape()
    assert shape is not None
    assert window.requests() == 180
    assert shape.prompt_tokens.count == 180
    assert all(count >= 0 for _, count in shape.prompt_tokens.buckets)
    assert shape.prompt_tokens.sum == pytest.approx(300 * 180)


def test_the_same_scrape_twice_counts_once() -> None:
    window = WorkloadWindow(600)
    first, second = served(0, at_s=0.0), served(40, at_s=5.0)
    for s in (first, second, second, first):  # a repeated and a late scrape
        window.observe(s)
    assert window.requests() == 40


def test_old_increases_leave_the_window() -> None:
    window = WorkloadWindow(100)
    window.observe(served(0, at_s=0.0))
    window.observe(served(500, at_s=50.0))
    window.observe(served(510, at_s=140.0))
    window.observe(served(520, at_s=200.0))
    shape = window.shape()
    assert shape is not None
    assert window.requests() == 20  # the 500 of t=50 are older than 100 s
    assert shape.window_s == pytest.approx(100.0)
    assert shape.rate_rps == pytest.approx(0.2)


def test_engines_add_up_and_a_returning_engine_starts_a_new_base() -> None:
    window = WorkloadWindow(600)
    a0, b0 = (
        engine([100] * 10, [10] * 10, at_s=0),
        engine([900] * 5, [90] * 5, at_s=0, engine_id="1"),
    )
    window.observe(scrape(0.0, a0, b0))
    a1 = engine([100] * 30, [10] * 30, at_s=10)
    b1 = engine([900] * 15, [90] * 15, at_s=10, engine_id="1")
    window.observe(scrape(10.0, a1, b1))
    assert window.requests() == 30  # 20 + 10
    window.observe(scrape(20.0, engine([100] * 40, [10] * 40, at_s=20)))  # engine 1 gone
    window.observe(
        scrape(
            30.0,
            engine([100] * 40, [10] * 40, at_s=30),
            engine([900] * 99, [90] * 99, at_s=30, engine_id="1"),
        )
    )
    assert window.requests() == 40  # engine 1's return is a base, not 99 new requests


def test_without_the_success_counter_the_histogram_counts() -> None:
    window = WorkloadWindow(600)
    window.observe(scrape(0.0, engine([50] * 3, [5] * 3, at_s=0, success=0.0)))
    window.observe(scrape(10.0, engine([50] * 13, [5] * 13, at_s=10, success=0.0)))
    assert window.requests() == 10


def test_a_window_needs_a_positive_length() -> None:
    with pytest.raises(ValueError, match="window_s"):
        WorkloadWindow(0)


PINNED = settings(
    derandomize=True, deadline=None, max_examples=80, suppress_health_check=[HealthCheck.too_slow]
)


@PINNED
@given(st.lists(st.tuples(st.integers(0, 50), st.booleans()), min_size=2, max_size=20))
def test_restarts_anywhere_count_each_request_once(steps: list[tuple[int, bool]]) -> None:
    """Cumulative counts that grow by `added` each scrape, or restart from `added` when the
    flag says so: the window counts exactly what was added after the first scrape."""
    window = WorkloadWindow(10_000)
    total, expected, prev = 0, 0, 0
    for i, (added, restart) in enumerate(steps):
        total = added if restart else total + added
        if i > 0:
            # A restart whose new count is not below the old one cannot be seen as one:
            # only the difference is new (Prometheus's increase() reads it the same way).
            expected += added if not restart else (added if added < prev else added - prev)
        prev = total
        window.observe(served(total, at_s=float(i)))
        shape = window.shape()
        assert window.requests() == expected
        if shape is not None:
            assert all(c >= 0 for _, c in shape.prompt_tokens.buckets)
            assert shape.prompt_tokens.count == expected


def _busy(n: int, at_s: float, used: int | None, running: int | None, engine_id: str = "0"):  # type: ignore[no-untyped-def]
    """An engine that finished `n` requests by `at_s`, with `used` of its 1000 KV blocks in
    use and `running` requests running (None: the gauge is not exported)."""
    sample = engine([300] * n, [60] * n, at_s=at_s, engine_id=engine_id)
    free = None if used is None else 1000 - used
    return dataclasses.replace(
        sample, blocks_total=1000, blocks_free=free, requests_running=running
    )


def test_the_kv_a_running_request_held_is_blocks_in_use_over_requests_running() -> None:
    """Summed over the samples in which a request ran (an idle scrape says nothing of a
    request's KV); engines add up; fewer than three busy samples say nothing."""
    window = WorkloadWindow(600)
    window.observe(scrape(0.0, _busy(0, 0.0, used=0, running=0)))
    window.observe(scrape(10.0, _busy(10, 10.0, used=200, running=10)))
    window.observe(scrape(20.0, _busy(20, 20.0, used=330, running=11)))
    assert window.kv_blocks_per_running() is None  # two busy samples
    window.observe(scrape(30.0, _busy(30, 30.0, used=100, running=4), _busy(5, 30.0, 140, 6, "1")))
    assert window.kv_blocks_per_running() == pytest.approx((200 + 330 + 240) / (10 + 11 + 10))
    shape = window.shape()
    assert shape is not None and shape.kv_blocks_per_running == window.kv_blocks_per_running()


def test_a_scrape_without_the_gauges_is_not_sampled_and_old_samples_leave() -> None:
    window = WorkloadWindow(60)
    for i in range(3):
        window.observe(scrape(10.0 * i, _busy(10 * i, 10.0 * i, used=None, running=5)))
    assert window.kv_blocks_per_running() is None  # vLLM's usage gauge missing
    for i in range(3, 6):
        window.observe(scrape(10.0 * i, _busy(10 * i, 10.0 * i, used=50, running=5)))
    assert window.kv_blocks_per_running() == pytest.approx(10.0)
    for i in range(6, 13):  # samples older than the window's 60 s leave it
        window.observe(scrape(10.0 * i, _busy(10 * i, 10.0 * i, used=80, running=4)))
    assert window.kv_blocks_per_running() == pytest.approx(20.0)
