"""The learned workload: lengths drawn as the histograms hold them, Poisson (or bursty)
arrivals at the observed rate, prefix reuse near the observed hit ratio; and the coarse key,
which keeps still under drift and moves under a real change."""

from __future__ import annotations

import dataclasses
import itertools
import statistics

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.collectors.histogram import Histogram
from kvpilot.tuner.load.generator import (
    LengthDist,
    ShapedWorkload,
    TraceWorkload,
    Workload,
    plan_requests,
)
from kvpilot.tuner.load.learned import (
    WorkloadShape,
    bucket_lengths,
    coarse_key,
    learned_workload,
    rate_bucket,
)
from kvpilot.tuner.measure.traces import workload_hash
from tests.agent.tuning.workload_scrapes import histogram

PINNED = settings(
    derandomize=True, deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)


def _shape(
    prompts: list[int], outputs: list[int], *, rate: float = 2.0, hit: float | None = None
) -> WorkloadShape:
    return WorkloadShape(
        prompt_tokens=histogram(prompts),
        generation_tokens=histogram(outputs),
        rate_rps=rate,
        prefix_hit_ratio=hit,
        requests=len(prompts),
        window_s=len(prompts) / rate,
        block_size=16,
    )


def test_bucket_lengths_follow_the_histogram() -> None:
    lengths = bucket_lengths(histogram([3] * 10 + [300] * 30))
    assert lengths is not None
    assert lengths.buckets == ((3, 5, 10.0), (201, 500, 30.0))
    assert bucket_lengths(histogram([])) is None
    above = Histogram(((10.0, 0.0), (100.0, 0.0), (float("inf"), 4.0)), 4000.0, 4.0)
    only_above = bucket_lengths(above)  # above every bound: the highest bound stands for them
    assert only_above is not None and only_above.buckets == ((100, 100, 4.0),)


def test_learned_lengths_land_where_the_server_s_did() -> None:
    shape = _shape([30] * 200 + [400] * 600, [8] * 400 + [150] * 400)
    plan = plan_requests(learned_workload(shape, requests=2000, seed=3))
    prompts = [len(p.prompt) for p in plan]
    outputs = [p.max_tokens for p in plan]
    short = sum(1 for n in prompts if 21 <= n <= 50) / len(prompts)
    long = sum(1 for n in prompts if 201 <= n <= 500) / len(prompts)
    assert short == pytest.approx(0.25, abs=0.04) and long == pytest.approx(0.75, abs=0.04)
    assert sum(1 for n in outputs if 6 <= n <= 10) / len(outputs) == pytest.approx(0.5, abs=0.04)
    assert all(21 <= n <= 50 or 201 <= n <= 500 for n in prompts)


def test_arrivals_are_poisson_at_the_observed_rate() -> None:
    plan = plan_requests(learned_workload(_shape([50] * 300, [10] * 300, rate=4.0), requests=4000))
    gaps = [b.delay_s - a.delay_s for a, b in itertools.pairwise(plan)]
    assert len(plan) / plan[-1].delay_s == pytest.approx(4.0, rel=0.06)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.08)


def test_a_burst_factor_keeps_the_mean_rate_and_bunches_arrivals() -> None:
    shape = _shape([50] * 300, [10] * 300, rate=4.0)
    plan = plan_requests(learned_workload(shape, requests=4000, burst_factor=4.0, seed=1))
    assert len(plan) / plan[-1].delay_s == pytest.approx(4.0, rel=0.12)
    same_moment = sum(1 for a, b in itertools.pairwise(plan) if b.delay_s == a.delay_s)
    assert same_moment / len(plan) == pytest.approx(0.75, abs=0.05)  # 1 - 1/burst
    plain = plan_requests(learned_workload(shape, requests=4000, seed=1))
    assert sum(1 for a, b in itertools.pairwise(plain) if b.delay_s == a.delay_s) == 0


def test_prefixes_are_shared_block_aligned_and_near_the_hit_ratio() -> None:
    shape = _shape([256] * 100, [16] * 100, hit=0.5)
    plan = plan_requests(learned_workload(shape, requests=400, seed=2))
    # What vLLM's prefix cache would find: whole 16-token blocks seen before, by chain.
    seen: set[tuple[int, ...]] = set()
    hits = queries = 0
    for p in plan:
        blocks = [p.prompt[: i + 16] for i in range(0, len(p.prompt) - 15, 16)]
        found = 0
        for b in blocks:
            if b not in seen:
                break
            found += 16
        hits, queries = hits + found, queries + len(p.prompt)
        seen.update(blocks)
    assert hits / queries == pytest.approx(0.5, abs=0.05)
    assert len({p.prompt[:16] for p in plan}) <= 8  # one pool of eight prefixes
    none = plan_requests(learned_workload(_shape([256] * 100, [16] * 100), requests=50))
    assert len({p.prompt[:16] for p in none}) == 50  # no reuse without a hit ratio


def test_max_model_len_bounds_every_request() -> None:
    shape = _shape([900] * 50, [900] * 50)
    plan = plan_requests(learned_workload(shape, requests=200, max_model_len=1024))
    assert all(len(p.prompt) + p.max_tokens <= 1024 for p in plan)


def test_a_shape_without_lengths_or_rate_is_refused() -> None:
    with pytest.raises(ValueError, match="lengths"):
        learned_workload(_shape([], []), requests=10)
    with pytest.raises(ValueError, match="rate"):
        learned_workload(dataclasses.replace(_shape([5], [5]), rate_rps=0.0), requests=10)


def test_a_plain_workload_draws_and_hashes_as_before() -> None:
    w = Workload(8, LengthDist.fixed(5), LengthDist.uniform(1, 9), concurrency=2, seed=4)
    assert set(dataclasses.asdict(w)) == {
        "num_requests",
        "prompt_len",
        "output_len",
        "concurrency",
        "rate_rps",
        "seed",
        "vocab_size",
        "request_timeout_s",
    }
    assert set(dataclasses.asdict(w.prompt_len)) == {"low", "high", "choices"}
    # Recorded before ShapedWorkload existed: the same seed still sends the same traffic.
    assert workload_hash(w) == "0572f6796e5080d7"
    assert [p.max_tokens for p in plan_requests(w)] == [8, 9, 1, 3, 1, 5, 6, 7]


def test_a_shaped_workload_warms_closed_loop_and_a_trace_replays_as_recorded() -> None:
    shaped = learned_workload(_shape([50] * 30, [10] * 30), requests=10)
    warm = dataclasses.replace(shaped, num_requests=2, concurrency=2, rate_rps=None)
    assert isinstance(warm, ShapedWorkload) and len(plan_requests(warm)) == 2
    trace = TraceWorkload(
        3,
        LengthDist.fixed(1),
        LengthDist.fixed(1),
        rate_rps=1.0,
        arrivals=((0.0, 7, 3), (0.5, 9, 4), (2.0, 11, 5)),
    )
    planned = plan_requests(trace)
    assert [(p.delay_s, len(p.prompt), p.max_tokens) for p in planned] == [
        (0.0, 7, 3),
        (0.5, 9, 4),
        (2.0, 11, 5),
    ]


def test_coarse_key_reads_quantiles_and_rate() -> None:
    key = coarse_key(_shape([300] * 80 + [800] * 20, [60] * 100, rate=2.5))
    assert key == "prompt 512/1024 gen 128/128 rate 2.44-3.05"  # (200, 500], (500, 1000]
    assert coarse_key(_shape([300] * 100, [60] * 100, rate=0.3)).endswith("rate 0.262-0.328")


def test_rates_a_quarter_apart_are_studies_apart() -> None:
    """At a fixed offered load goodput follows the rate: 1.0 and 9.9 requests a second (one
    order of magnitude) are two studies, and so are rates a quarter apart."""
    assert rate_bucket(1.0) == rate_bucket(1.2) == "1-1.25"
    assert rate_bucket(1.25) == "1.25-1.56"
    assert rate_bucket(0.99) == "0.8-1"
    keys = {coarse_key(_shape([300] * 100, [60] * 100, rate=r)) for r in (1.0, 1.3, 9.9)}
    assert len(keys) == 3


@PINNED
@given(
    drift=st.floats(0.9, 1.1),
    rate_drift=st.floats(0.95, 1.05),
    extra=st.integers(0, 20),
)
def test_ordinary_drift_keeps_the_key(drift: float, rate_drift: float, extra: int) -> None:
    """Lengths a tenth either way (within their buckets), the rate 5 % either way (within
    its bucket, 2.44-3.05), a few odd requests: the same study."""
    base = _shape([300] * 200 + [420] * 40, [65] * 240, rate=2.7)
    prompts = [round(300 * drift)] * 200 + [round(420 * drift)] * 40 + [40] * extra
    outputs = [round(65 * drift)] * (240 + extra)
    moved = _shape(prompts, outputs, rate=2.7 * rate_drift)
    assert coarse_key(moved) == coarse_key(base)


@PINNED
@given(factor=st.sampled_from([0.25, 4.0]), which=st.sampled_from(["prompt", "gen", "rate"]))
def test_a_real_change_moves_the_key(factor: float, which: str) -> None:
    prompts, outputs, rate = [300] * 240, [60] * 240, 3.0
    if which == "prompt":
        prompts = [round(n * factor) for n in prompts]
    elif which == "gen":
        outputs = [round(n * factor) for n in outputs]
    else:
        rate *= factor * 4 if factor > 1 else factor / 4  # a hundred- or sixteenfold change
    assert coarse_key(_shape(prompts, outputs, rate=rate)) != coarse_key(
        _shape([300] * 240, [60] * 240, rate=3.0)
    )
