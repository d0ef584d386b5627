"""The replay's windows: fresh prompts every window, the same on every side of one, the
warm-up's its own; and each side's foreign requests counted from recorded scrapes."""

from __future__ import annotations

import itertools
from pathlib import Path

from kvpilot.agent.tuning.observer import LoadObserver, foreign_requests
from kvpilot.collectors.vllm_parse import VllmScrape, parse_vllm_metrics
from kvpilot.tuner.load.generator import LengthDist, ShapedWorkload, Workload, plan_requests
from kvpilot.tuner.rollout.foreign import ForeignRequests, foreign_reason

FIXTURES = Path(__file__).parents[2] / "fixtures" / "vllm"
PLAIN = Workload(12, LengthDist.uniform(8, 32), LengthDist.fixed(4), rate_rps=2.0, seed=7)
SHAPED = ShapedWorkload(
    12, LengthDist.uniform(32, 64), LengthDist.fixed(4), rate_rps=2.0, prefix_ratio=0.5
)


def prompts(observer: LoadObserver, name: str) -> list[tuple[int, ...]]:
    return [p.prompt for p in plan_requests(observer.window_workload(name))]


def test_each_window_draws_prompts_of_its_own() -> None:
    for workload in (PLAIN, SHAPED):
        observer = LoadObserver(workload, model="m", salt=1)
        windows = [prompts(observer, f"drawn {k}") for k in range(4)]
        for earlier, later in itertools.pairwise(windows):
            assert not set(earlier) & set(later)  # a cache of window k has nothing for k+1
        assert not set(prompts(observer, "warm-up")) & set(windows[0])


def test_the_same_window_sends_the_same_prompts_and_runs_differ() -> None:
    """Both sides of one window (or a sequential canary's window and its baseline's) replay
    the same prompts; another run's salt draws others."""
    observer = LoadObserver(PLAIN, model="m", salt=1)
    assert prompts(observer, "trial 0") == prompts(observer, "trial 0")
    other_run = LoadObserver(PLAIN, model="m", salt=2)
    assert not set(prompts(observer, "trial 0")) & set(prompts(other_run, "trial 0"))


def recorded(name: str, at_s: float) -> VllmScrape:
    text = (FIXTURES / name).read_text()
    engines = parse_vllm_metrics(text, taken_at_s=at_s, wall_time_s=at_s)
    return VllmScrape(at_s, at_s, engines, "0.32.0")


def test_foreign_requests_are_the_servers_count_beyond_the_generators() -> None:
    """Recorded vLLM 0.32 scrapes: 25 finished requests, later 81: 56 in between."""
    window = [recorded("v0_32_series_a.prom", 0.0), recorded("v0_32_under_load.prom", 10.0)]
    assert foreign_requests(window, own=56) == ForeignRequests(foreign=0, own=56)
    assert foreign_requests(window, own=50) == ForeignRequests(foreign=6, own=50)
    # A reset counter (a restart in between) or one scrape: not counted, never a guess.
    assert foreign_requests(list(reversed(window)), own=50) is None
    assert foreign_requests(window[:1], own=50) is None


def test_a_window_past_the_foreign_share_is_left_out_and_said_why() -> None:
    calm = ForeignRequests(foreign=1, own=64)  # 1.5 %
    busy = ForeignRequests(foreign=6, own=50)  # 10.7 %
    assert foreign_reason([("http://a", calm), ("http://b", None)], 0.02) is None
    why = foreign_reason([("http://a", calm), ("http://b", busy)], 0.02)
    assert why is not None and "http://b" in why and "6 requests" in why
    assert foreign_reason([("http://b", busy)], 0.2) is None  # the share is settable
