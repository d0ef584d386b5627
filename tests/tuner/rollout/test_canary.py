"""The rollout state machine against an in-memory runtime test double and a scripted observer."""

from __future__ import annotations

import collections
import copy
import itertools
import statistics
from collections.abc import Callable, Sequence

import pytest

from kvpilot.tuner.judge.evidence import Counts
from kvpilot.tuner.judge.judgement import (
    DEFAULT_METRICS,
    Classification,
    JudgeConfig,
    with_margins,
)
from kvpilot.tuner.load.generator import LoadReport, RequestResult
from kvpilot.tuner.problem.objective import Measurement, Slo, TrialOutcome
from kvpilot.tuner.problem.startup_errors import StartupFailureKind
from kvpilot.tuner.rollout.canary import (
    Phase,
    RolloutSettings,
    Strategy,
    TrialRollout,
    recover,
)
from kvpilot.tuner.rollout.ports import CandidateStartFailed, Observation, RestartRefused
from kvpilot.tuner.trials import TrialState, new_trial
from tests.fakes.rollout_journal import InMemoryRolloutJournal
from tests.fakes.trial_store import InMemoryTrialStore

STABLE = (
    "python",
    "-m",
    "vllm.entrypoints.openai.api_server",
    "--kv-cache-memory-bytes",
    "2097152",
)
GOOD = (*STABLE[:3], "--kv-cache-memory-bytes", "33554432")
BAD = (*STABLE[:3], "--kv-cache-memory-bytes", "1048576")
TOO_SMALL = (*STABLE[:3], "--kv-cache-memory-bytes", "1024")
CACHE_TOO_SMALL_LOG = (
    "(EngineCore_DP0 pid=7) ERROR ValueError: To serve at least one request with the model's "
    "max seq len (1024), (0.03 GiB KV cache is needed, which is larger than the available KV "
    "cache memory (0.0 GiB).\nRuntimeError: Engine core initialization failed."
)
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


SLO = Slo(ttft_p95_s=1.0, inter_token_p95_s=0.2, max_preemptions_per_request=10.0)
# The state machine's tests, not the statistics': one window a side and a bake of one, with
# margins a window of a few dozen requests can show (the judge's own tests hold the defaults).
RIG: dict[str, object] = {
    "windows": 1,
    "bake_windows": 1,
    "judge": JudgeConfig(
        metrics=with_margins(DEFAULT_METRICS, errors_ratio=0.05, preemptions_per_request=0.2)
    ),
}


def kv_bytes(argv: Sequence[str]) -> int:
    return int(argv[list(argv).index("--kv-cache-memory-bytes") + 1])


def latency_scale(argv: Sequence[str]) -> float:
    """The double's model of the rig: a smaller KV budget preempts and slows every request."""
    kv = kv_bytes(argv)
    return 1.0 if kv >= 16 * 2**20 else (2.0 if kv >= 2 * 2**20 else 6.0)


class InMemoryTunerRuntime:
    """A test double of the agent's runtime adapter: one stable and one canary slot, in memory.

    Every call records the rollout's persisted phase at that moment, so tests can check that
    each transition was saved before the step it names.
    """

    def __init__(self, journal: InMemoryRolloutJournal, argv: Sequence[str] = STABLE) -> None:
        self.argv = tuple(argv)
        self.canary: tuple[str, ...] | None = None
        self.calls: list[tuple[str, tuple[str, ...] | None, Phase | None]] = []
        self.remediating = False
        self.refuse_new = False  # the safe-restart path's guards say no to new flags
        self.restores: list[bool] = []
        self._journal = journal

    def phase(self) -> Phase | None:
        records = self._journal.records()
        return records[-1].phase if records else None

    def stable_argv(self) -> tuple[str, ...]:
        return self.argv

    def stable_url(self) -> str:
        return "http://stable"

    async def start_canary(self, argv: Sequence[str], *, ready_timeout_s: float) -> str:
        self.calls.append(("start_canary", tuple(argv), self.phase()))
        if kv_bytes(argv) < 4096:
            raise CandidateStartFailed("canary exited during start-up", CACHE_TOO_SMALL_LOG)
        self.canary = tuple(argv)
        return "http://canary"

    async def stop_canary(self) -> None:
        self.calls.append(("stop_canary", None, self.phase()))
        self.canary = None

    async def set_stable(
        self, argv: Sequence[str], *, reason: str, ready_timeout_s: float, restore: bool = False
    ) -> None:
        self.calls.append(("set_stable", tuple(argv), self.phase()))
        self.restores.append(restore)
        if self.refuse_new and not restore:
            raise RestartRefused("cooldown: restarted 10 s ago")
        if kv_bytes(argv) < 4096:
            raise CandidateStartFailed("stable exited during start-up", CACHE_TOO_SMALL_LOG)
        self.argv = tuple(argv)

    def remediation_in_progress(self) -> bool:
        return self.remediating


def window(scale: float, requests: int = 60, tokens: int = 16) -> Observation:
    """A window in which every latency is `scale` times a fixed, slightly varied profile; the
    judge's samples as the replay observer takes them (`agent.tuning.observer.samples`)."""
    results = []
    for i in range(requests):
        start = i * 0.6 * scale  # closed loop: a slower server takes the work longer
        first = start + scale * (0.05 + 0.005 * (i % 7))
        gaps = [scale * (0.01 + 0.001 * ((i + j) % 5)) for j in range(tokens - 1)]
        times = tuple(itertools.accumulate([first, *gaps]))
        results.append(RequestResult(i, 8, tokens, start, times[-1], first, times, tokens, None))
    report = LoadReport(0.0, max(r.end_s for r in results), tuple(results))
    # The generation rate per half second, as scrapes of the token counter would give it.
    per_bin = collections.Counter(int(t / 0.5) for r in results for t in r.token_times_s)
    samples = {
        "ttft_s": tuple(report.ttfts_s()),
        "inter_token_s": tuple(statistics.fmean(r.inter_token_s) for r in results),
        "e2e_s": tuple(report.e2es_s()),
        "errors_ratio": tuple(0.0 for _ in results),
        "preemptions_per_s": Counts(0.0, report.duration_s),
        "goodput_tokens_per_s": tuple(
            per_bin.get(b, 0) / 0.5 for b in range(int(report.duration_s / 0.5))
        ),
    }
    return Observation("x", Measurement(report=report), samples)


class ScriptedObserver:
    """Measures whatever argv the double serves at each URL through `latency_scale`."""

    def __init__(self, runtime: InMemoryTunerRuntime, after_promotion: float = 1.0) -> None:
        self._runtime = runtime
        self.windows: list[tuple[str, ...]] = []
        self.after_promotion = after_promotion  # > 1: the promoted flags degrade in the bake
        self.hook: Callable[[], None] | None = None

    def _argv(self, url: str) -> tuple[str, ...]:
        served = self._runtime.canary if url == "http://canary" else self._runtime.argv
        assert served is not None, f"nothing serves {url}"
        return served

    async def warm(self, urls: Sequence[str]) -> None:
        for url in urls:
            self._argv(url)

    async def observe(
        self, urls: Sequence[str], *, prompts: str | None = None
    ) -> tuple[Observation, ...]:
        if self.hook is not None:
            self.hook()
        out = []
        for url in urls:
            argv = self._argv(url)
            self.windows.append(argv)
            scale = latency_scale(argv)
            baking = self._runtime.phase() is Phase.BAKING
            out.append(window(scale * (self.after_promotion if baking else 1.0)))
        return tuple(out)


class Rig:
    def __init__(self, argv: Sequence[str] = STABLE, **observer: float) -> None:
        self.store = InMemoryTrialStore()
        self.journal = InMemoryRolloutJournal()
        self.runtime = InMemoryTunerRuntime(self.journal, argv)
        self.observer = ScriptedObserver(self.runtime, **observer)
        self.clock = itertools.count(100.0)
        self.phases: list[Phase] = []

    def rollout(self, **settings: object) -> TrialRollout:
        return TrialRollout(
            self.runtime,
            self.observer,
            self.store,
            self.journal,
            RolloutSettings(slo=SLO, **{**RIG, **settings}),  # type: ignore[arg-type]
            wall_clock=lambda: float(next(self.clock)),
            on_phase=lambda _t, phase: self.phases.append(phase),
        )

    def trial(self, number: int = 1):
        trial = new_trial(f"t{number}", "study", number, {"kv_cache_memory_bytes": 1}, 0.0)
        self.store.add(trial)
        return trial


async def test_parallel_promotes_a_better_candidate_through_every_persisted_phase() -> None:
    rig = Rig()
    outcome = await rig.rollout().run(rig.trial(), GOOD, Strategy.PARALLEL)
    assert outcome.promoted, outcome.record.reason
    assert rig.runtime.argv == GOOD and rig.runtime.canary is None
    assert rig.phases == [
        Phase.PLANNED,
        Phase.STARTING,
        Phase.WARMING,
        Phase.OBSERVING,
        Phase.JUDGING,
        Phase.PROMOTING,
        Phase.BAKING,
        Phase.PROMOTED,
    ]
    # Each runtime step happened after its phase was saved.
    assert rig.runtime.calls == [
        ("start_canary", GOOD, Phase.STARTING),
        ("stop_canary", None, Phase.PROMOTING),
        ("set_stable", GOOD, Phase.PROMOTING),
    ]
    stored = rig.store.get("t1")
    assert stored is not None and stored.state is TrialState.COMPLETE
    assert stored.judgement is not None and stored.judgement.classification is Classification.PASS
    assert outcome.baseline is not None and stored.result is not None
    assert stored.result.goodput_tokens_per_s > 1.5 * outcome.baseline.goodput_tokens_per_s
    assert rig.journal.get("t1") == outcome.record
    assert rig.observer.windows == [STABLE, GOOD, GOOD]  # baseline, canary, bake


async def test_parallel_rolls_back_a_candidate_the_judge_fails() -> None:
    rig = Rig()
    outcome = await rig.rollout().run(rig.trial(), BAD, Strategy.PARALLEL)
    assert outcome.record.phase is Phase.ROLLED_BACK
    assert outcome.trial.judgement is not None
    assert outcome.trial.judgement.classification is Classification.FAIL
    assert "judged fail" in (outcome.record.reason or "")
    assert rig.runtime.argv == STABLE and rig.runtime.canary is None
    assert [c[0] for c in rig.runtime.calls] == ["start_canary", "stop_canary"]
    assert rig.runtime.calls[-1][2] is Phase.ROLLING_BACK


async def test_a_start_failure_is_infeasible_with_vllms_reason_and_the_stable_untouched() -> None:
    rig = Rig()
    outcome = await rig.rollout().run(rig.trial(), TOO_SMALL, Strategy.PARALLEL)
    trial = rig.store.get("t1")
    assert trial is not None and trial.state is TrialState.INFEASIBLE
    assert trial.result is not None and trial.result.outcome is TrialOutcome.FAILED_TO_START
    assert trial.result.startup_failure is not None
    assert trial.result.startup_failure.kind is StartupFailureKind.CACHE_TOO_SMALL
    assert "To serve at least one request" in (trial.reason or "")
    assert outcome.record.phase is Phase.INFEASIBLE
    assert rig.runtime.argv == STABLE and rig.observer.windows == []
    assert "set_stable" not in [c[0] for c in rig.runtime.calls]


async def test_the_bake_reverts_promoted_flags_that_degrade() -> None:
    rig = Rig(after_promotion=8.0)
    outcome = await rig.rollout().run(rig.trial(), GOOD, Strategy.PARALLEL)
    assert outcome.record.phase is Phase.REVERTED
    assert "bake" in (outcome.record.reason or "")
    assert [c[:2] for c in rig.runtime.calls if c[0] == "set_stable"] == [
        ("set_stable", GOOD),
        ("set_stable", STABLE),
    ]
    assert rig.runtime.argv == STABLE
    assert rig.phases[-3:] == [Phase.BAKING, Phase.REVERTING, Phase.REVERTED]


async def test_sequential_promotes_in_place_and_rolls_back_in_place() -> None:
    rig = Rig()
    good = await rig.rollout().run(rig.trial(1), GOOD, Strategy.SEQUENTIAL)
    assert good.promoted and rig.runtime.argv == GOOD
    # A-B-A: to the candidate, back for the windows after it, and the promotion's restart.
    assert [c for c in rig.runtime.calls if c[0] == "set_stable"] == [
        ("set_stable", GOOD, Phase.STARTING),
        ("set_stable", STABLE, Phase.RETURNING),
        ("set_stable", GOOD, Phase.PROMOTING),
    ]
    assert rig.observer.windows == [STABLE, GOOD, STABLE, GOOD]  # A, B, A, the bake
    calls = len(rig.runtime.calls)
    bad = await rig.rollout().run(rig.trial(2), BAD, Strategy.SEQUENTIAL)
    assert bad.record.phase is Phase.ROLLED_BACK
    assert rig.runtime.argv == GOOD  # the flags it had before this trial
    # Clearly worse: rolled back at once, no windows after it.
    assert rig.runtime.calls[calls:] == [
        ("set_stable", BAD, Phase.STARTING),
        ("set_stable", GOOD, Phase.ROLLING_BACK),
    ]


async def test_rollbacks_are_marked_as_restores_and_new_flags_are_not() -> None:
    rig = Rig(after_promotion=8.0)
    await rig.rollout().run(rig.trial(), GOOD, Strategy.PARALLEL)  # promoted, then reverted
    assert rig.runtime.restores == [False, True]


async def test_a_refused_promotion_keeps_the_stable_flags_and_says_why() -> None:
    rig = Rig()
    rig.runtime.refuse_new = True
    outcome = await rig.rollout().run(rig.trial(), GOOD, Strategy.PARALLEL)
    assert outcome.record.phase is Phase.ROLLED_BACK
    assert outcome.record.reason == "not promoted: cooldown: restarted 10 s ago"
    assert outcome.refused == "cooldown: restarted 10 s ago"
    assert rig.runtime.argv == STABLE and rig.runtime.canary is None
    stored = rig.store.get("t1")
    assert stored is not None and stored.state is TrialState.COMPLETE  # it was measured


async def test_a_refused_sequential_switch_aborts_the_trial_untouched() -> None:
    rig = Rig()
    rig.runtime.refuse_new = True
    outcome = await rig.rollout().run(rig.trial(), GOOD, Strategy.SEQUENTIAL)
    assert outcome.record.phase is Phase.ABORTED and outcome.refused is not None
    stored = rig.store.get("t1")
    assert stored is not None and stored.state is TrialState.ABORTED
    assert "not switched to the candidate: cooldown" in (stored.reason or "")
    assert rig.runtime.argv == STABLE
    assert rig.observer.windows == [STABLE]  # the baseline only


async def test_sequential_start_failure_restores_the_stable_flags() -> None:
    rig = Rig()
    outcome = await rig.rollout().run(rig.trial(), TOO_SMALL, Strategy.SEQUENTIAL)
    assert outcome.record.phase is Phase.INFEASIBLE
    assert rig.runtime.argv == STABLE
    assert outcome.trial.state is TrialState.INFEASIBLE


async def test_an_error_that_is_not_the_candidates_fails_the_trial_and_cleans_up() -> None:
    rig = Rig()

    def broken() -> None:
        raise ConnectionError("load generator lost its connection")

    rig.observer.hook = broken
    with pytest.raises(ConnectionError):
        await rig.rollout().run(rig.trial(), GOOD, Strategy.PARALLEL)
    trial = rig.store.get("t1")
    assert trial is not None and trial.state is TrialState.FAILED
    assert "ConnectionError" in (trial.reason or "")
    assert rig.runtime.canary is None and rig.runtime.argv == STABLE
    assert rig.journal.get("t1").phase is Phase.FAILED  # type: ignore[union-attr]


class Killed(BaseException):
    """Stands for SIGKILL: only what was persisted before it survives (see `snapshot`)."""


@pytest.mark.parametrize(
    ("strategy", "restored"), [(Strategy.PARALLEL, False), (Strategy.SEQUENTIAL, True)]
)
async def test_recovery_after_a_kill_mid_canary(strategy: Strategy, restored: bool) -> None:
    rig = Rig()
    saved: dict[str, object] = {}

    def kill_once_the_canary_serves() -> None:
        if rig.journal.records()[-1].phase is Phase.OBSERVING:
            saved["store"], saved["journal"] = copy.deepcopy((rig.store, rig.journal))
            saved["runtime"] = (rig.runtime.argv, rig.runtime.canary)
            raise Killed

    rig.observer.hook = kill_once_the_canary_serves
    with pytest.raises(Killed):
        await rig.rollout().run(rig.trial(), GOOD, strategy)
    # A new kvpilot sees only the persisted state and the processes the dead one left.
    store, journal = saved["store"], saved["journal"]
    assert isinstance(store, InMemoryTrialStore) and isinstance(journal, InMemoryRolloutJournal)
    runtime = InMemoryTunerRuntime(journal)
    runtime.argv, runtime.canary = saved["runtime"]  # type: ignore[misc]
    assert (runtime.canary is not None) == (strategy is Strategy.PARALLEL)
    done = await recover(journal, store, runtime, at_wall_s=999.0)
    assert [(d.trial_id, d.phase, d.stable_restored) for d in done] == [
        ("t1", Phase.OBSERVING, restored)
    ]
    assert runtime.canary is None and runtime.argv == STABLE
    trial = store.get("t1")
    assert trial is not None and trial.state is TrialState.ABORTED
    assert journal.get("t1").phase is Phase.ABORTED  # type: ignore[union-attr]
    assert await recover(journal, store, runtime, at_wall_s=1000.0) == []  # idempotent
