"""The sequential canary's A-B-A design: the stable's windows before and after the
candidate's, a drift that cancels, a clearly bad candidate that stops early, the restarts
in order, and recovery of a kvpilot killed between them."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import pytest

from kvpilot.collectors.vllm_metrics import EngineSample, VllmScrape
from kvpilot.tuner.judge.evidence import Counts
from kvpilot.tuner.judge.judgement import DEFAULT_METRICS, Classification
from kvpilot.tuner.judge.sequential import LookDecision, judge_look
from kvpilot.tuner.judge.windows import Window
from kvpilot.tuner.load.generator import LoadReport
from kvpilot.tuner.problem.objective import Measurement, evaluate
from kvpilot.tuner.rollout.bracket import bracketing, log_quantile_mean
from kvpilot.tuner.rollout.canary import Phase, Strategy, recover
from kvpilot.tuner.rollout.ports import Observation
from kvpilot.tuner.trials import TrialState
from tests.fakes.rollout_journal import InMemoryRolloutJournal
from tests.fakes.trial_store import InMemoryTrialStore
from tests.tuner.rollout.test_canary import (
    BAD,
    SLO,
    STABLE,
    InMemoryTunerRuntime,
    Killed,
    Rig,
    ScriptedObserver,
    kv_bytes,
    latency_scale,
    window,
)

pytestmark = pytest.mark.anyio

# As fast as STABLE (2 MiB) in the double's model, with a quarter of the KV budget of BIG.
BIG = (*STABLE[:3], "--kv-cache-memory-bytes", str(8 << 20))
EQUAL_SMALLER = STABLE
WINDOWS = 8  # one look at 8 windows a side, on the judge's windowed path
# The rig's saving (6 MiB) counts; the CPU rigs set their own, as the product's is 64 MiB.
ABA = {"windows": WINDOWS, "min_memory_saving_bytes": 1 << 20}
DRIFT = 1.025  # every window 2.5 % slower than the one before: x1.22 over one phase


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class DriftingObserver(ScriptedObserver):
    """The double's latencies, each window `drift` times slower than the window before it
    (the machine warming up, the hour's traffic): linear in time on the log scale."""

    def __init__(self, runtime: InMemoryTunerRuntime, drift: float) -> None:
        super().__init__(runtime)
        self.drift = drift

    async def observe(
        self, urls: Sequence[str], *, prompts: str | None = None
    ) -> tuple[Observation, ...]:
        if self.hook is not None:
            self.hook()
        (url,) = urls
        argv = self._argv(url)
        factor = self.drift ** len(self.windows)
        self.windows.append(argv)
        return (drifted(argv, factor),)


def drifted(argv: Sequence[str], factor: float = 1.0) -> Observation:
    """The double's window for `argv`, every latency `factor` times longer and the goodput
    `factor` times lower (the double's goodput bins would quantise it), priced at its KV
    budget."""
    plain = window(latency_scale(argv))
    slow = window(latency_scale(argv) * factor)
    goodput = plain.samples["goodput_tokens_per_s"]
    assert isinstance(goodput, tuple)
    samples = {**slow.samples, "goodput_tokens_per_s": tuple(g / factor for g in goodput)}
    measurement = dataclasses.replace(slow.measurement, memory_bytes=kv_bytes(argv))
    return Observation("x", measurement, samples)


def drifting_rig(drift: float = DRIFT, argv: Sequence[str] = BIG) -> Rig:
    rig = Rig(argv)
    rig.observer = DriftingObserver(rig.runtime, drift)
    return rig


async def test_a_drift_fails_an_equal_candidate_one_side_after_the_other_and_aba_passes_it() -> (
    None
):
    rig = drifting_rig()
    outcome = await rig.rollout(**ABA).run(rig.trial(), EQUAL_SMALLER, Strategy.SEQUENTIAL)
    assert rig.observer.windows == [BIG] * WINDOWS + [STABLE] * WINDOWS + [BIG] * WINDOWS + [STABLE]
    # The same windows judged one side after the other (the A windows before it alone):
    # the drift reads as the candidate's harm.
    record = rig.journal.get("t1")
    assert record is not None
    before, after = _windows_of(rig, WINDOWS)
    plain = judge_look(
        [Window(c.samples, b.samples) for c, b in zip(after, before, strict=True)],
        rig.rollout(**ABA)._settings.look_plan,
        rig.rollout(**ABA)._settings.judge,
        SLO.judge_limits(),
        paired=False,
    )
    assert plain.decision is LookDecision.FAIL
    assert plain.judgement.classification in (Classification.FAIL, Classification.MARGINAL)
    # A-B-A: judged between the windows before and after it, the drift cancels; the
    # candidate, as fast with a quarter of the memory, passes and is promoted.
    judged = outcome.trial.judgement
    assert judged is not None and judged.classification is Classification.PASS, judged.reason
    assert outcome.promoted, outcome.record.reason
    assert "75% less memory" in (outcome.record.reason or "")


def _windows_of(rig: Rig, n: int) -> tuple[list[Observation], list[Observation]]:
    """The A and B windows the drifting observer gave, rebuilt as it built them."""
    assert isinstance(rig.observer, DriftingObserver)
    drift = rig.observer.drift
    before = [drifted(BIG, drift**k) for k in range(n)]
    candidate = [drifted(STABLE, drift ** (n + k)) for k in range(n)]
    return before, candidate


async def test_without_a_drift_an_equal_candidate_with_more_memory_is_not_promoted() -> None:
    rig = drifting_rig(1.0, STABLE)
    outcome = await rig.rollout(**ABA).run(rig.trial(), BIG, Strategy.SEQUENTIAL)
    assert outcome.record.phase is Phase.ROLLED_BACK
    assert "does not beat the stable instance" in (outcome.record.reason or "")
    # Two restarts, none more: the stable flags already serve after the windows after it.
    assert [c[:2] for c in rig.runtime.calls if c[0] == "set_stable"] == [
        ("set_stable", BIG),
        ("set_stable", STABLE),
    ]
    assert rig.runtime.argv == STABLE
    assert rig.phases[-4:] == [
        Phase.OBSERVING_BASELINE_AFTER,
        Phase.JUDGING,
        Phase.ROLLING_BACK,
        Phase.ROLLED_BACK,
    ]


async def test_a_bad_candidate_stops_early_with_one_restart_back_and_no_second_a() -> None:
    rig = Rig()
    # Looks at 8 and 16: six times slower, it stops at the first look.
    outcome = await rig.rollout(windows=16).run(rig.trial(), BAD, Strategy.SEQUENTIAL)
    assert outcome.record.phase is Phase.ROLLED_BACK
    assert "judged fail" in (outcome.record.reason or "")
    assert rig.observer.windows == [STABLE] * 16 + [BAD] * 8
    assert [c for c in rig.runtime.calls if c[0] == "set_stable"] == [
        ("set_stable", BAD, Phase.STARTING),
        ("set_stable", STABLE, Phase.ROLLING_BACK),
    ]
    assert rig.runtime.restores == [False, True]
    assert Phase.RETURNING not in rig.phases
    assert Phase.OBSERVING_BASELINE_AFTER not in rig.phases


async def test_a_drift_alone_does_not_stop_the_candidate_early() -> None:
    """The early stop needs more than one phase's drift (x1.22 here) beyond the margins."""
    rig = drifting_rig()
    await rig.rollout(**ABA).run(rig.trial(), EQUAL_SMALLER, Strategy.SEQUENTIAL)
    assert Phase.OBSERVING_BASELINE_AFTER in rig.phases


async def test_a_promotion_goes_through_every_phase_and_restart_in_order() -> None:
    rig = drifting_rig(1.0)
    outcome = await rig.rollout(**ABA).run(rig.trial(), EQUAL_SMALLER, Strategy.SEQUENTIAL)
    assert outcome.promoted, outcome.record.reason
    assert rig.phases == [
        Phase.PLANNED,
        Phase.OBSERVING_BASELINE,
        Phase.STARTING,
        Phase.WARMING,
        Phase.OBSERVING,
        Phase.RETURNING,
        Phase.OBSERVING_BASELINE_AFTER,
        Phase.JUDGING,
        Phase.PROMOTING,
        Phase.BAKING,
        Phase.PROMOTED,
    ]
    # Each restart after its phase was saved; the restart back is a restore.
    assert rig.runtime.calls == [
        ("set_stable", STABLE, Phase.STARTING),
        ("set_stable", BIG, Phase.RETURNING),
        ("stop_canary", None, Phase.PROMOTING),
        ("set_stable", STABLE, Phase.PROMOTING),
    ]
    assert rig.runtime.restores == [False, True, False]
    assert rig.observer.windows == [BIG] * WINDOWS + [STABLE] * WINDOWS + [BIG] * WINDOWS + [STABLE]


async def test_a_refused_promotion_restart_leaves_the_stable_flags_serving() -> None:
    rig = drifting_rig(1.0)

    def refuse_once_back() -> None:
        rig.runtime.refuse_new = rig.journal.records()[-1].phase is Phase.OBSERVING_BASELINE_AFTER

    rig.observer.hook = refuse_once_back
    outcome = await rig.rollout(**ABA).run(rig.trial(), EQUAL_SMALLER, Strategy.SEQUENTIAL)
    assert outcome.record.phase is Phase.ROLLED_BACK
    assert outcome.refused == "cooldown: restarted 10 s ago"
    assert rig.runtime.argv == BIG
    stored = rig.store.get("t1")
    assert stored is not None and stored.state is TrialState.COMPLETE  # it was measured


async def test_recovery_after_a_kill_mid_second_a_keeps_the_stable_flags() -> None:
    rig = Rig(BIG)
    saved: dict[str, object] = {}

    def kill_in_the_second_a() -> None:
        if rig.journal.records()[-1].phase is Phase.OBSERVING_BASELINE_AFTER:
            saved["state"] = copy.deepcopy((rig.store, rig.journal))
            saved["argv"] = rig.runtime.argv
            raise Killed

    rig.observer.hook = kill_in_the_second_a
    with pytest.raises(Killed):
        await rig.rollout(**ABA).run(rig.trial(), EQUAL_SMALLER, Strategy.SEQUENTIAL)
    store, journal = saved["state"]  # type: ignore[misc]
    assert isinstance(store, InMemoryTrialStore) and isinstance(journal, InMemoryRolloutJournal)
    runtime = InMemoryTunerRuntime(journal, saved["argv"])  # type: ignore[arg-type]
    done = await recover(journal, store, runtime, at_wall_s=999.0)
    assert [(d.phase, d.stable_restored) for d in done] == [(Phase.OBSERVING_BASELINE_AFTER, False)]
    assert runtime.argv == BIG and "set_stable" not in [c[0] for c in runtime.calls]
    trial = store.get("t1")
    assert trial is not None and trial.state is TrialState.ABORTED


async def test_recovery_after_a_kill_during_the_restart_back_restores_the_stable_flags() -> None:
    rig = Rig(BIG)
    rig.runtime = KilledOnTheWayBack(rig.journal, BIG)
    rig.observer = ScriptedObserver(rig.runtime)
    rig.runtime.store = rig.store
    with pytest.raises(Killed):
        await rig.rollout(**ABA).run(rig.trial(), EQUAL_SMALLER, Strategy.SEQUENTIAL)
    store, journal = rig.runtime.saved
    runtime = InMemoryTunerRuntime(journal, EQUAL_SMALLER)  # the candidate's flags still serve
    done = await recover(journal, store, runtime, at_wall_s=999.0)
    assert [(d.phase, d.stable_restored) for d in done] == [(Phase.RETURNING, True)]
    assert runtime.argv == BIG and runtime.restores == [True]


class KilledOnTheWayBack(InMemoryTunerRuntime):
    """Killed as it restarts the stable flags for the windows after the candidate; `saved`:
    what was persisted then (all a new kvpilot sees)."""

    store: InMemoryTrialStore
    saved: tuple[InMemoryTrialStore, InMemoryRolloutJournal]

    async def set_stable(
        self, argv: Sequence[str], *, reason: str, ready_timeout_s: float, restore: bool = False
    ) -> None:
        if self.phase() is Phase.RETURNING:
            self.saved = copy.deepcopy((self.store, self._journal))
            raise Killed
        await super().set_stable(
            argv, reason=reason, ready_timeout_s=ready_timeout_s, restore=restore
        )


def test_the_quantiles_of_a_bracketing_window_are_the_geometric_means_of_both() -> None:
    low, high = [1.0, 2.0, 3.0, 4.0, 5.0], [4.0, 8.0, 12.0, 16.0, 20.0]
    assert log_quantile_mean(low, high) == pytest.approx([2.0, 4.0, 6.0, 8.0, 10.0])
    # Of different sizes: on the finer grid; a negative or NaN sample is no data.
    assert log_quantile_mean([1.0, 3.0], [1.0, 4.0, 9.0]) == pytest.approx([1.0, 8**0.5, 27**0.5])
    assert all(v != v for v in log_quantile_mean([float("nan")], [1.0]))  # NaN
    assert all(v != v for v in log_quantile_mean([-1.0], [1.0]))


def _scrapes(at_s: float, preemptions: Sequence[float]) -> tuple[VllmScrape, ...]:
    return tuple(
        VllmScrape(
            at_s + i,
            at_s + i,
            (EngineSample("m", "0", at_s + i, at_s + i, preemptions_total=p),),
            None,
        )
        for i, p in enumerate(preemptions)
    )


def test_a_bracketing_window_counts_both_windows_requests_seconds_and_preemptions() -> None:
    a, b = window(1.0), window(2.0)
    # The server restarted between them: the second window's counter began again.
    before = Observation(
        "x", _with_scrapes(a.measurement, _scrapes(10.0, [5.0, 7.0, 9.0])), a.samples
    )
    after = Observation("x", _with_scrapes(b.measurement, _scrapes(3.0, [1.0, 2.0])), b.samples)
    both = bracketing(before, after, DEFAULT_METRICS)
    got = evaluate(both.measurement, SLO)
    one, two = evaluate(before.measurement, SLO), evaluate(after.measurement, SLO)
    assert got.metrics is not None and one.metrics is not None and two.metrics is not None
    assert got.metrics.requests_total == one.metrics.requests_total + two.metrics.requests_total
    assert got.metrics.preemptions_total == 4.0 + 1.0
    seconds = one.metrics.duration_s + two.metrics.duration_s
    assert got.metrics.duration_s == pytest.approx(seconds)
    # Errors (0/1 a request) are both windows' requests; preemptions' counts summed.
    assert len(both.samples["errors_ratio"]) == 120
    pa, pb = a.samples["preemptions_per_s"], b.samples["preemptions_per_s"]
    assert isinstance(pa, Counts) and isinstance(pb, Counts)
    assert both.samples["preemptions_per_s"] == Counts(0.0, pa.exposure + pb.exposure)
    # A latency's every quantile midway (on the log scale) between the two windows'.
    ttft = sorted(both.samples["ttft_s"])  # type: ignore[arg-type]
    assert ttft[0] == pytest.approx(min(a.samples["ttft_s"]) * 2**0.5)  # type: ignore[type-var]


def _with_scrapes(m: Measurement, scrapes: tuple[VllmScrape, ...]) -> Measurement:
    assert isinstance(m.report, LoadReport)
    return Measurement(report=m.report, scrapes=scrapes, memory_bytes=m.memory_bytes)
