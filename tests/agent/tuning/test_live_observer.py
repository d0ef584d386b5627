"""The live-traffic observer over loopback /metrics stand-ins and a recording TrafficSplit
double: the shares it states, the judge's samples from histogram and counter deltas, and an
SLO breach mid-analysis that takes the canary's traffic back at once."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from kvpilot.agent.config.tuning import CanaryConfig
from kvpilot.agent.tuning.pod.live_observer import LiveTrafficObserver
from kvpilot.tuner.judge.evidence import Counts
from kvpilot.tuner.judge.judgement import LIVE_METRICS, JudgeConfig, with_margins
from kvpilot.tuner.problem.objective import Slo, TrialOutcome, evaluate
from kvpilot.tuner.rollout.canary import Phase, RolloutSettings, Strategy, TrialRollout
from kvpilot.tuner.rollout.ports import CanaryAborted
from kvpilot.tuner.trials import TrialState, new_trial
from tests.fakes.rollout_journal import InMemoryRolloutJournal
from tests.fakes.standin_vllm import StandInVllm
from tests.fakes.trial_store import InMemoryTrialStore
from tests.tuner.rollout.test_canary import GOOD, InMemoryTunerRuntime

TTFT_LE = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_LE = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_LE = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0)
SLO = Slo(ttft_p95_s=1.0, inter_token_p95_s=0.2, max_preemptions_per_request=1.0)
# One analysis of a few dozen requests: an error margin it can show (the default half point
# needs about 550 requests a side).
LIVE_RIG = JudgeConfig(metrics=with_margins(LIVE_METRICS, errors_ratio=0.05))
INTERVAL_S = 10.0
CONFIG = CanaryConfig(
    traffic="gateway",
    weight_percent=10,
    warmup_s=30,
    analysis_s=60,
    analysis_interval_s=INTERVAL_S,
    bake_s=30,
    gateway={},
)


@dataclass
class Step:
    """What one pod serves between two scrapes: requests of one shape."""

    requests: int
    ttft_s: float = 0.05
    itl_s: float = 0.02
    e2e_s: float = 0.9
    tokens_each: int = 10
    preemptions: int = 0
    failed: int = 0


@dataclass
class PodScript:
    """A pod's cumulative /metrics: each scrape first adds the next step (the last repeats)."""

    steps: list[Step]
    kv_budget_bytes: int | None = None  # cache_config_info's kv_cache_memory_bytes
    done: int = 0
    hists: dict[str, list[float]] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)

    def render(self) -> str:
        if self.done:  # the first scrape sees the pod as the analysis finds it
            step = self.steps[min(self.done - 1, len(self.steps) - 1)]
            for name, value in (("ttft", step.ttft_s), ("itl", step.itl_s), ("e2e", step.e2e_s)):
                self.hists.setdefault(name, []).extend([value] * step.requests)
            self._add("tokens", step.requests * step.tokens_each)
            self._add("preemptions", step.preemptions)
            self._add("ok", step.requests)
            self._add("5xx", step.failed)
        self.done += 1
        return self._text()

    def _add(self, name: str, value: float) -> None:
        self.counters[name] = self.counters.get(name, 0.0) + value

    def _text(self) -> str:
        engine = 'engine="0",model_name="tiny"'
        lines = [
            f"vllm:kv_cache_usage_perc{{{engine}}} 0.5",
            f"vllm:num_preemptions_total{{{engine}}} {self.counters.get('preemptions', 0)}",
            f"vllm:generation_tokens_total{{{engine}}} {self.counters.get('tokens', 0)}",
            f'http_requests_total{{handler="/v1/completions",method="POST",status="2xx"}} '
            f"{self.counters.get('ok', 0)}",
            f'http_requests_total{{handler="/v1/completions",method="POST",status="5xx"}} '
            f"{self.counters.get('5xx', 0)}",
            'http_requests_total{handler="/metrics",method="GET",status="5xx"} 7',
        ]
        if self.kv_budget_bytes is not None:
            labels = f'{engine},block_size="32",kv_cache_memory_bytes="{self.kv_budget_bytes}"'
            lines.append(f"vllm:cache_config_info{{{labels}}} 1.0")
        for family, name, bounds in (
            ("vllm:time_to_first_token_seconds", "ttft", TTFT_LE),
            ("vllm:inter_token_latency_seconds", "itl", ITL_LE),
            ("vllm:e2e_request_latency_seconds", "e2e", E2E_LE),
        ):
            seen = self.hists.get(name, [])
            for le in (*bounds, float("inf")):
                shown = "+Inf" if le == float("inf") else repr(le)
                count = sum(1 for v in seen if v <= le)
                lines.append(f'{family}_bucket{{{engine},le="{shown}"}} {count}')
            lines.append(f"{family}_sum{{{engine}}} {sum(seen)}")
            lines.append(f"{family}_count{{{engine}}} {len(seen)}")
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Split:
    stable_percent: float
    canary_percent: float
    how: str = "HTTPRoute vllm weights"


class RecordingSplit:
    """A TrafficSplit test double: records each call, with the scrapes seen by then."""

    def __init__(self, canary_pod: StandInVllm) -> None:
        self.now = Split(100.0, 0.0)
        self.calls: list[tuple[str, int]] = []
        self._pod = canary_pod

    async def send_share(self, canary_percent: float) -> Split:
        self.calls.append(("send_share", self._pod.metrics_scrapes))
        self.now = Split(100.0 - canary_percent, canary_percent)
        return self.now

    async def pull_back(self) -> Split:
        self.calls.append(("pull_back", self._pod.metrics_scrapes))
        self.now = Split(100.0, 0.0)
        return self.now

    async def shares(self) -> Split:
        return self.now


class SteppedClock:
    """Time advances only when the observer sleeps: intervals are exactly as long as asked."""

    def __init__(self) -> None:
        self.now_s = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now_s

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now_s += seconds


@pytest.fixture
def pods() -> Iterator[tuple[StandInVllm, StandInVllm]]:
    with StandInVllm() as stable, StandInVllm() as canary:
        yield stable, canary


def observer(split: RecordingSplit, clock: SteppedClock) -> LiveTrafficObserver:
    return LiveTrafficObserver(CONFIG, split, SLO, sleep=clock.sleep, clock=clock, wall_clock=clock)


def url(pod: StandInVllm) -> str:
    return f"http://127.0.0.1:{pod.port}"


def test_warm_sends_the_share_and_waits_without_judging(pods) -> None:
    stable, canary = pods
    split, clock = RecordingSplit(canary), SteppedClock()

    asyncio.run(observer(split, clock).warm([url(stable), url(canary)]))

    assert split.calls == [("send_share", 0)]  # nothing scraped: the warm-up is not judged
    assert split.now == Split(90.0, 10.0)
    assert clock.slept == [CONFIG.warmup_s]


def test_samples_come_from_deltas_and_goodput_is_divided_by_each_share(pods) -> None:
    stable, canary = pods
    # 90 % and 10 % of the same traffic: nine requests to one, per interval.
    stable.metrics = PodScript([Step(9, ttft_s=0.09, e2e_s=1.2, preemptions=3)]).render
    canary.metrics = PodScript([Step(1, ttft_s=0.03, e2e_s=0.7)]).render
    split, clock = RecordingSplit(canary), SteppedClock()
    live = observer(split, clock)

    async def run():
        await live.warm([url(stable), url(canary)])
        return await live.observe([url(stable), url(canary)])

    base, cand = asyncio.run(run())

    intervals = round(CONFIG.analysis_s / INTERVAL_S)
    assert stable.metrics_scrapes == canary.metrics_scrapes == intervals + 1
    assert base.samples["ttft_s"] == pytest.approx((0.09,) * intervals)  # means, exact
    assert cand.samples["ttft_s"] == pytest.approx((0.03,) * intervals)
    assert base.samples["e2e_s"] == pytest.approx((1.2,) * intervals)
    # Events over the whole analysis: preemptions of finished requests, failed of answered.
    assert base.samples["preemptions_per_request"] == Counts(3.0 * intervals, 9.0 * intervals)
    assert cand.samples["preemptions_per_request"] == Counts(0.0, 1.0 * intervals)
    # The /metrics endpoint's own 5xx are not the model's answers.
    assert base.samples["errors_ratio"] == Counts(0.0, 9.0 * intervals)
    assert cand.samples["errors_ratio"] == Counts(0.0, 1.0 * intervals)
    # 90 tokens on 90 %, 10 on 10 %: the same goodput once divided by the share.
    assert base.samples["goodput_tokens_per_s"] == pytest.approx((90 / INTERVAL_S / 0.9,) * 6)
    assert cand.samples["goodput_tokens_per_s"] == pytest.approx((10 / INTERVAL_S / 0.1,) * 6)
    assert base.traffic == cand.traffic
    assert base.traffic == (
        "traffic stable 90 %, canary 10 % (HTTPRoute vllm weights); "
        "finished requests: stable 54 (90%), canary 6 (10%)"
    )
    # The objective reads the same window from the histograms, per share.
    assert base.measurement.report is None and cand.measurement.traffic_share_ratio == 0.1
    result = evaluate(base.measurement, SLO)
    assert result.metrics is not None and result.metrics.source == "histograms"
    assert result.outcome is TrialOutcome.FEASIBLE
    assert result.goodput_tokens_per_s == pytest.approx(10.0)
    assert evaluate(cand.measurement, SLO).goodput_tokens_per_s == pytest.approx(10.0)
    assert ("pull_back", 0) not in split.calls and len(split.calls) == 1


def test_an_slo_breach_mid_analysis_pulls_the_traffic_back_at_once(pods) -> None:
    stable, canary = pods
    stable.metrics = PodScript([Step(9)]).render
    # Two good intervals, then TTFTs of 4 s: the third interval breaks the 1 s p95.
    canary.metrics = PodScript([Step(1), Step(1), Step(2, ttft_s=4.0)]).render
    split, clock = RecordingSplit(canary), SteppedClock()
    live = observer(split, clock)

    async def run():
        await live.warm([url(stable), url(canary)])
        await live.observe([url(stable), url(canary)])

    with pytest.raises(CanaryAborted) as aborted:
        asyncio.run(run())

    # The scrape that showed the breach (the 4th: start + 3 intervals) is the canary's last.
    assert split.calls == [("send_share", 0), ("pull_back", 4)]
    assert canary.metrics_scrapes == 4
    assert split.now == Split(100.0, 0.0)
    message = str(aborted.value)
    assert "canary interval 3 of 6 broke the SLO: TTFT p95" in message
    assert "traffic back to stable (stable 100 %, canary 0 %" in message
    assert "during the analysis stable 90 %, canary 10 %" in message


def test_failed_requests_on_the_canary_abort_too(pods) -> None:
    stable, canary = pods
    stable.metrics = PodScript([Step(9)]).render
    canary.metrics = PodScript([Step(1), Step(3, failed=1)]).render
    split, clock = RecordingSplit(canary), SteppedClock()
    live = observer(split, clock)

    async def run():
        await live.warm([url(stable), url(canary)])
        await live.observe([url(stable), url(canary)])

    with pytest.raises(
        CanaryAborted, match="interval 2 of 6 broke the SLO: 1 of 4 requests failed"
    ):
        asyncio.run(run())
    assert split.calls[-1] == ("pull_back", 3)


def test_a_rollout_on_live_traffic_ends_an_aborted_canary_infeasible_and_removes_it(pods) -> None:
    stable, canary = pods
    stable.metrics = PodScript([Step(9)]).render
    canary.metrics = PodScript([Step(1, ttft_s=3.0)]).render
    split, clock = RecordingSplit(canary), SteppedClock()
    journal, store = InMemoryRolloutJournal(), InMemoryTrialStore()

    class Runtime(InMemoryTunerRuntime):
        def stable_url(self) -> str:
            return url(stable)

        async def start_canary(self, argv, *, ready_timeout_s: float) -> str:
            await super().start_canary(argv, ready_timeout_s=ready_timeout_s)
            return url(canary)

        async def stop_canary(self) -> None:
            self.calls.append(("traffic", (split.now.how, str(split.now.canary_percent)), None))
            await super().stop_canary()

    runtime = Runtime(journal)
    settings = RolloutSettings(slo=SLO, judge=LIVE_RIG, windows=1, bake_windows=1)
    rollout = TrialRollout(
        runtime, observer(split, clock), store, journal, settings, wall_clock=clock
    )
    trial = new_trial("t1", "fp", 1, {"kv_cache_memory_bytes": 1}, at_wall_s=1.0)
    store.add(trial)

    outcome = asyncio.run(rollout.run(trial, GOOD, Strategy.PARALLEL))

    assert outcome.record.phase is Phase.ROLLED_BACK
    assert outcome.trial.state is TrialState.INFEASIBLE
    assert outcome.trial.result is not None
    assert outcome.trial.result.outcome is TrialOutcome.SLO_BROKEN
    reason = outcome.trial.reason or ""
    assert reason.startswith("aborted during the analysis: canary interval 1 of 6 broke the SLO")
    assert "traffic back to stable" in reason
    # The canary was removed with its traffic already back on the stable pod.
    assert ("traffic", ("HTTPRoute vllm weights", "0.0"), None) in runtime.calls
    assert runtime.canary is None
    assert [c[0] for c in runtime.calls].count("set_stable") == 0


def test_bake_warms_the_new_pod_then_watches_the_stable_alone_for_bake_s(pods) -> None:
    stable, canary = pods
    stable.metrics = PodScript([Step(10)]).render
    split, clock = RecordingSplit(canary), SteppedClock()

    (window,) = asyncio.run(observer(split, clock).observe([url(stable)]))

    intervals = round(CONFIG.bake_s / INTERVAL_S)
    assert clock.slept == [CONFIG.warmup_s] + [INTERVAL_S] * intervals
    assert stable.metrics_scrapes == intervals + 1
    assert canary.metrics_scrapes == 0
    assert window.traffic == (
        "bake after a 30 s warm-up: stable 100 %, canary 0 % (HTTPRoute vllm weights)"
    )
    assert evaluate(window.measurement, SLO).goodput_tokens_per_s == pytest.approx(10.0)


def test_a_pod_whose_metrics_cannot_be_read_is_counted_not_zeroed(pods) -> None:
    stable, canary = pods
    stable.metrics = PodScript([Step(9)]).render
    canary.metrics = lambda: "garbage{ 1\n"
    split, clock = RecordingSplit(canary), SteppedClock()
    live = observer(split, clock)

    async def run():
        await live.warm([url(stable), url(canary)])
        return await live.observe([url(stable), url(canary)])

    base, cand = asyncio.run(run())

    assert cand.samples["ttft_s"] == () and len(base.samples["ttft_s"]) == 6
    assert len(live.scrape_errors) == 7
    assert "does not parse" in live.scrape_errors[0]
    assert "canary 0 (0%)" in (cand.traffic or "")


def _judged_rollout(stable, canary, canary_per_interval: int):
    stable.metrics = PodScript([Step(9, ttft_s=0.3, preemptions=18)], 2 << 20).render
    canary.metrics = PodScript([Step(canary_per_interval, ttft_s=0.05)], 32 << 20).render
    split, clock = RecordingSplit(canary), SteppedClock()
    journal, store = InMemoryRolloutJournal(), InMemoryTrialStore()

    class Runtime(InMemoryTunerRuntime):
        def stable_url(self) -> str:
            return url(stable)

        async def start_canary(self, argv, *, ready_timeout_s: float) -> str:
            await super().start_canary(argv, ready_timeout_s=ready_timeout_s)
            return url(canary)

    settings = RolloutSettings(slo=SLO, judge=LIVE_RIG, windows=1, bake=False)
    rollout = TrialRollout(
        Runtime(journal), observer(split, clock), store, journal, settings, wall_clock=clock
    )
    trial = new_trial("t1", "fp", 1, {"kv_cache_memory_bytes": 1}, at_wall_s=1.0)
    store.add(trial)
    return asyncio.run(rollout.run(trial, GOOD, Strategy.PARALLEL))


def test_a_judged_rollout_states_the_shares_with_its_verdict(pods) -> None:
    outcome = _judged_rollout(*pods, canary_per_interval=1)

    shares = (
        "traffic stable 90 %, canary 10 % (HTTPRoute vllm weights); "
        "finished requests: stable 54 (90%), canary 6 (10%)"
    )
    # The stable side preempts twice per request, yet six requests on the canary cannot show
    # that it fails no more often: no evidence, no promotion; the shares are said with it.
    assert outcome.record.phase is Phase.ROLLED_BACK, outcome.record.reason
    reason = outcome.record.reason or ""
    assert reason.startswith("judged inconclusive: about "), reason
    assert "more windows needed" in reason and "insufficient evidence" in reason
    assert "errors_ratio" in reason and reason.endswith(shares)
    assert outcome.trial.state is TrialState.COMPLETE and outcome.trial.reason == shares


def test_a_canary_with_enough_requests_is_promoted_on_live_traffic(pods) -> None:
    # Ten requests an interval, sixty in all without a failure: enough to show that errors
    # stay within five points of the stable side's; its preemptions and latencies are better.
    outcome = _judged_rollout(*pods, canary_per_interval=10)

    assert outcome.record.phase is Phase.PROMOTED, outcome.record.reason
    reason = outcome.record.reason or ""
    assert "better than the stable instance: feasible where the stable instance is not" in reason
    assert outcome.trial.judgement is not None
    # The memory each side's server reports as its KV budget, measured into both results.
    assert outcome.trial.result is not None and outcome.baseline is not None
    assert (outcome.trial.result.memory_bytes, outcome.baseline.memory_bytes) == (32 << 20, 2 << 20)
    errors = next(m for m in outcome.trial.judgement.metrics if m.name == "errors_ratio")
    assert (errors.canary_count, errors.upper_bound is not None) == (60, True)
    assert errors.upper_bound < 0.05


def test_a_split_that_sends_the_canary_nothing_is_an_error_not_a_verdict(pods) -> None:
    from kvpilot.agent.tuning.pod.live_observer import LiveTrafficError

    stable, canary = pods

    class Stuck(RecordingSplit):
        async def send_share(self, canary_percent: float) -> Split:
            return self.now  # the canary's pods never became endpoints

    with pytest.raises(LiveTrafficError, match="sends the canary nothing"):
        asyncio.run(observer(Stuck(canary), SteppedClock()).warm([url(stable), url(canary)]))
