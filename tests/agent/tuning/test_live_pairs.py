"""A live analysis judged paired by interval: the two pods are scraped on the same ticks, so
interval k of the stable and of the canary shared the arrivals; a busy interval slows both.

The pods are loopback /metrics stand-ins scripted interval by interval (`PodScript`), the
rollout the real one with the real observer; the unpaired judgement the rollout made before
(one window a side: the request-level test of the pooled interval means) is computed
beside it for comparison."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence

import pytest

from kvpilot.agent.config.tuning import CanaryConfig
from kvpilot.agent.tuning.pod.live_observer import LiveTrafficObserver
from kvpilot.tuner.judge.evidence import Counts
from kvpilot.tuner.judge.judgement import Classification, Judgement
from kvpilot.tuner.judge.vocabulary import MetricVerdict, Verdict
from kvpilot.tuner.judge.windows import MIN_WINDOWS, Window, judge_windows
from kvpilot.tuner.problem.objective import Measurement
from kvpilot.tuner.rollout.canary import RolloutOutcome, RolloutSettings, Strategy, TrialRollout
from kvpilot.tuner.rollout.intervals import interval_look, interval_windows
from kvpilot.tuner.rollout.ports import IntervalSamples, Observation
from kvpilot.tuner.trials import new_trial
from tests.agent.tuning.test_live_observer import (
    LIVE_RIG,
    SLO,
    PodScript,
    RecordingSplit,
    Step,
    SteppedClock,
    url,
)
from tests.fakes.rollout_journal import InMemoryRolloutJournal
from tests.fakes.standin_vllm import StandInVllm
from tests.fakes.trial_store import InMemoryTrialStore
from tests.tuner.rollout.test_canary import GOOD, InMemoryTunerRuntime

INTERVALS = 12
CONFIG = CanaryConfig(
    traffic="gateway",
    weight_percent=10,
    warmup_s=30,
    analysis_s=10.0 * INTERVALS,
    analysis_interval_s=10.0,
    bake_s=30,
    gateway={},
)
# How busy each interval is (the same for both pods: the arrivals they shared), from a quiet
# 1 to 14 times its latencies.
BUSY = (1, 12, 2, 8, 1, 14, 3, 10, 1, 6, 2, 12)
# An equal canary: within 2 % of the stable pod in each interval, above and below in turn.
EVEN = tuple(1.02 if k % 2 else 0.98 for k in range(INTERVALS))


@pytest.fixture
def pods() -> Iterator[tuple[StandInVllm, StandInVllm]]:
    with StandInVllm() as stable, StandInVllm() as canary:
        yield stable, canary


def steps(requests: int, slower: Sequence[float]) -> list[Step]:
    """Interval k: latencies of the busy factor times `slower[k]` (TTFT 0.05 s when quiet)."""
    return [
        Step(
            requests,
            ttft_s=0.05 * busy * ratio,
            itl_s=0.004 * busy * ratio,
            e2e_s=0.2 * busy * ratio,
        )
        for busy, ratio in zip(BUSY, slower, strict=True)
    ]


def live_rollout(
    pair: tuple[StandInVllm, StandInVllm],
    canary_steps: list[Step],
    *,
    canary_scrape: Callable[[], str] | None = None,
) -> tuple[RolloutOutcome, Judgement]:
    """The rollout's outcome over one analysis, and the unpaired judgement of its two sides
    (what the rollout judged before: one window a side, on the pooled interval means)."""
    stable, canary = pair
    stable.metrics = PodScript(steps(9, (1.0,) * INTERVALS), 32 << 20).render
    canary.metrics = canary_scrape or PodScript(canary_steps, 16 << 20).render
    split, clock = RecordingSplit(canary), SteppedClock()
    seen: list[Observation] = []

    class Keeping(LiveTrafficObserver):
        async def observe(self, urls, *, prompts=None):
            got = await super().observe(urls, prompts=prompts)
            seen.extend(got)
            return got

    class Runtime(InMemoryTunerRuntime):
        def stable_url(self) -> str:
            return url(stable)

        async def start_canary(self, argv, *, ready_timeout_s: float) -> str:
            await super().start_canary(argv, ready_timeout_s=ready_timeout_s)
            return url(canary)

    journal, store = InMemoryRolloutJournal(), InMemoryTrialStore()
    observer = Keeping(CONFIG, split, SLO, sleep=clock.sleep, clock=clock, wall_clock=clock)
    # The stand-ins' budgets are MiBs: a saving of 16 MiB is one here.
    settings = RolloutSettings(
        slo=SLO, judge=LIVE_RIG, windows=1, bake=False, min_memory_saving_bytes=1 << 20
    )
    rollout = TrialRollout(Runtime(journal), observer, store, journal, settings, wall_clock=clock)
    trial = new_trial("t1", "fp", 1, {"kv_cache_memory_bytes": 1}, at_wall_s=1.0)
    store.add(trial)
    outcome = asyncio.run(rollout.run(trial, GOOD, Strategy.PARALLEL))
    base, cand = seen
    unpaired = judge_windows([Window(cand.samples, base.samples)], LIVE_RIG, SLO.judge_limits())
    return outcome, unpaired


def verdict(judgement: Judgement | None, name: str) -> MetricVerdict:
    assert judgement is not None
    return next(m for m in judgement.metrics if m.name == name)


def test_shared_busy_intervals_leave_unpaired_unsure_where_pairs_pass_an_equal_canary(
    pods: tuple[StandInVllm, StandInVllm],
) -> None:
    outcome, unpaired = live_rollout(pods, steps(10, EVEN))

    # Unpaired, the busy intervals' spread on both sides hides that each pair agrees.
    assert unpaired.classification is Classification.INCONCLUSIVE, unpaired.reason
    assert verdict(unpaired, "ttft_s").verdict is Verdict.INCONCLUSIVE
    # Paired, what each interval shared cancels: every latency within its margin.
    judged = outcome.trial.judgement
    assert judged is not None and judged.classification is Classification.PASS, judged.reason
    for name in ("ttft_s", "inter_token_s", "e2e_s"):
        paired = verdict(judged, name)
        assert paired.verdict is Verdict.PASS, paired
        assert (paired.canary_count, paired.baseline_count) == (INTERVALS, INTERVALS)
    # Errors and preemptions stay counts over the users' requests (ten a canary interval).
    assert verdict(judged, "errors_ratio").canary_count == 10 * INTERVALS
    assert outcome.promoted, outcome.record.reason  # and half the memory: promoted


def test_a_canary_30_percent_slower_in_every_interval_counts_against_it(
    pods: tuple[StandInVllm, StandInVllm],
) -> None:
    outcome, unpaired = live_rollout(pods, steps(10, (1.3,) * INTERVALS))

    # Unpaired, 30 % is lost in the intervals' spread: not shown worse.
    assert not verdict(unpaired, "ttft_s").counts_against
    judged = outcome.trial.judgement
    assert judged is not None and judged.classification is Classification.FAIL, judged.reason
    for name in ("ttft_s", "inter_token_s", "e2e_s"):
        paired = verdict(judged, name)
        assert paired.counts_against and paired.verdict is Verdict.HIGH, paired
        assert paired.shift == pytest.approx(0.3)
    assert not outcome.promoted and "ttft_s high" in (outcome.record.reason or "")


def test_an_interval_without_its_pair_is_left_out_whole(
    pods: tuple[StandInVllm, StandInVllm],
) -> None:
    served = steps(10, EVEN)
    script = PodScript([*served[:6], Step(0), *served[7:]], 16 << 20)
    scrapes = 0

    def canary_scrape() -> str:
        nonlocal scrapes
        scrapes += 1
        text = script.render()  # the pod serves on; only the scrape at tick 3 fails
        return "garbage{ 1\n" if scrapes == 4 else text

    outcome, _ = live_rollout(pods, [], canary_scrape=canary_scrape)

    judged = outcome.trial.judgement
    assert judged is not None and judged.classification is Classification.PASS, judged.reason
    # Ticks 2-4 are one canary interval: the stable's 2-3 and 3-4 have no pair, and it none.
    errors = verdict(judged, "errors_ratio")
    assert errors.canary_count == 10 * (INTERVALS - 3)  # and interval 6 served no one
    # Interval 6 finished no canary request: left out of the latencies' pairs alone.
    ttft = verdict(judged, "ttft_s")
    assert (ttft.canary_count, ttft.baseline_count) == (INTERVALS - 3, INTERVALS - 3)


def side(ticks: Sequence[tuple[int, int]], ttft_s: float = 0.1) -> Observation:
    spans = tuple(
        IntervalSamples(a, b, {"ttft_s": (ttft_s * (a + 1),), "errors_ratio": Counts(0.0, 5.0)})
        for a, b in ticks
    )
    return Observation("http://pod", Measurement(scrapes=()), intervals=spans)


def test_intervals_pair_by_their_ticks_within_each_analysis() -> None:
    stable = side([(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)])
    canary = side([(0, 1), (1, 3), (3, 4), (4, 5)], ttft_s=0.2)  # its scrape at tick 2 failed

    windows = interval_windows([stable, stable], [canary, canary])

    # Per analysis: 0-1, 3-4 and 4-5 pair; 1-2, 2-3 and 1-3 have no pair.
    assert [w.baseline["ttft_s"] for w in windows] == [(0.1,), (0.4,), (0.5,)] * 2
    assert [w.canary["ttft_s"] for w in windows] == [(0.2,), (0.8,), (1.0,)] * 2


def test_fewer_pairs_than_the_judge_needs_are_inconclusive_and_said() -> None:
    stable = side([(k, k + 1) for k in range(8)])
    canary = side([(0, 2), (2, 3), (3, 4), (4, 6), (6, 7), (7, 8)])  # four pairs
    settings = RolloutSettings(slo=SLO, judge=LIVE_RIG, windows=1)

    look = interval_look([stable], [canary], settings)

    assert look.judgement.classification is Classification.INCONCLUSIVE
    assert look.judgement.reason.startswith(
        f"insufficient evidence: 4 of the stable's 8 intervals have the canary's interval of "
        f"the same ticks, fewer than the {MIN_WINDOWS} a paired judgement needs"
    )
    # Five pairs are judged, metric by metric (here preemptions, required, have no data).
    five = side([(k, k + 1) for k in range(5)])
    judged = interval_look([five], [five], settings)
    assert judged.windows == 5 and "fewer than" not in judged.judgement.reason
    assert verdict(judged.judgement, "ttft_s").baseline_count == 5
