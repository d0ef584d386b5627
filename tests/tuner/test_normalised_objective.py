"""The suggester is told each trial's goodput relative to its concurrent baseline's, at warm
start and live alike, so that the day's load does not read as the configuration's quality;
the stored trials, and what reports show of them, keep the absolute figures."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.agent.state.db import Database
from kvpilot.agent.state.trials import SqliteRolloutJournal, SqliteTrialStore
from kvpilot.tuner.problem.objective import (
    TrialOutcome,
    TrialResult,
    best_index,
    relative_result,
)
from kvpilot.tuner.problem.space import Candidate, Knob, KnobKind, SearchSpace
from kvpilot.tuner.rollout.canary import Phase, RolloutRecord, RolloutSettings, Strategy
from kvpilot.tuner.session import TuningSession, told_history
from kvpilot.tuner.suggest import GridSuggester, warm_start
from kvpilot.tuner.trials import TrialState, history, new_trial
from tests.tuner.rollout.test_canary import SLO, Rig

MIB = 2**20
LEVELS = (1024.0, float(MIB), float(32 * MIB))
SPACE = SearchSpace(
    knobs=(Knob("kv_cache_memory_bytes", KnobKind.INTEGER, 1024, 32 * MIB, levels=LEVELS),)
)
SMALL, LARGE = MIB, 32 * MIB


class RecordingSuggester:
    """A grid suggester that keeps what it was told, in order."""

    def __init__(self) -> None:
        self._grid = GridSuggester(SPACE)
        self.told: list[tuple[Candidate, TrialResult]] = []

    def ask(self) -> Candidate:
        return self._grid.ask()

    def tell(self, candidate: Candidate, result: TrialResult) -> None:
        self.told.append((candidate, result))
        self._grid.tell(candidate, result)


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    opened = Database.open(tmp_path)
    try:
        yield opened
    finally:
        opened.close()


def feasible(goodput: float | None, memory: int = SMALL) -> TrialResult:
    return TrialResult(TrialOutcome.FEASIBLE, goodput, memory, None)


def add_trial(
    store: SqliteTrialStore,
    number: int,
    kv: int,
    result: TrialResult,
    baseline: TrialResult | None,
) -> str:
    """A measured trial of the study, stored as the rollout leaves it."""
    trial = new_trial(f"t{number}", "study", number, {"kv_cache_memory_bytes": kv}, 0.0)
    store.add(trial)
    trial = trial.to(TrialState.RUNNING, at_wall_s=0.5)
    state = TrialState.COMPLETE if result.feasible else TrialState.INFEASIBLE
    store.save(
        trial.to(state, at_wall_s=1.0, reason=result.reason, result=result, baseline=baseline)
    )
    return trial.trial_id


def told_goodputs(store: SqliteTrialStore, journal: SqliteRolloutJournal) -> list[float | None]:
    suggester = RecordingSuggester()
    warm_start(suggester, SPACE, told_history(store, "study", journal)[1])
    return [result.goodput_tokens_per_s for _, result in suggester.told]


def test_two_nights_at_twice_the_load_tell_the_same_configuration_the_same(db: Database) -> None:
    store, journal = SqliteTrialStore(db), SqliteRolloutJournal(db)
    # Night 1 and night 2 (twice the offered load): both sides serve about twice the
    # tokens; the same two configurations, a few per cent of noise on each figure.
    night1 = [(SMALL, 100.0, 90.0), (LARGE, 120.0, 92.0)]
    night2 = [(SMALL, 204.0, 181.0), (LARGE, 236.0, 185.0)]
    for number, (kv, canary, stable) in enumerate(night1 + night2, start=1):
        add_trial(store, number, kv, feasible(canary), feasible(stable))

    # As measured (what the suggester was told before): the load shows as a factor of two.
    absolute = [r.goodput_tokens_per_s or 0.0 for _, r in history(store, "study")]
    assert absolute[2] / absolute[0] == pytest.approx(2.0, rel=0.05)
    assert absolute[3] / absolute[1] == pytest.approx(2.0, rel=0.05)

    small1, large1, small2, large2 = told_goodputs(store, journal)
    assert small1 == pytest.approx(100.0 / 90.0) and small2 == pytest.approx(204.0 / 181.0)
    # Equal within the noise put in (at most 2.5 % a figure, 5 % a ratio), not 2x apart.
    assert small2 == pytest.approx(small1, rel=0.05)
    assert large2 == pytest.approx(large1, rel=0.05)
    # The stored trials keep their absolute figures.
    stored = [t.result.goodput_tokens_per_s for t in store.trials("study") if t.result]
    assert stored == [100.0, 120.0, 204.0, 236.0]


def test_equal_relative_goodput_leaves_the_choice_to_less_memory(db: Database) -> None:
    store, journal = SqliteTrialStore(db), SqliteRolloutJournal(db)
    # The smaller budget ran on a quiet night, the larger on a night of twice the load; each
    # served what its baseline did.
    add_trial(store, 1, SMALL, feasible(100.0, SMALL), feasible(100.0, 2 * MIB))
    add_trial(store, 2, LARGE, feasible(200.0, LARGE), feasible(200.0, 2 * MIB))
    absolute = [r for _, r in history(store, "study")]
    assert best_index(absolute, SLO) == 1  # the busy night's load read as the larger's quality
    _, told = told_history(store, "study", journal)
    results = [r for _, r in told]
    assert [r.memory_bytes for r in results] == [SMALL, LARGE]
    assert best_index(results, SLO) == 0  # a tie relative to the baselines: less memory wins


def test_a_study_with_no_baseline_figure_is_told_absolute_goodput(db: Database) -> None:
    store, journal = SqliteTrialStore(db), SqliteRolloutJournal(db)
    add_trial(store, 1, SMALL, feasible(100.0), None)
    add_trial(store, 2, LARGE, feasible(120.0), None)
    relative, _ = told_history(store, "study", journal)
    assert relative is False
    assert told_goodputs(store, journal) == [100.0, 120.0]


def test_where_some_trials_have_a_baseline_a_feasible_one_without_is_left_out(
    db: Database,
) -> None:
    store, journal = SqliteTrialStore(db), SqliteRolloutJournal(db)
    add_trial(store, 1, SMALL, feasible(100.0), None)  # kept before baselines were recorded
    broken = TrialResult(TrialOutcome.SLO_BROKEN, 40.0, LARGE, "TTFT p95 3 s > 1 s")
    add_trial(store, 2, LARGE, broken, None)
    add_trial(store, 3, LARGE, feasible(150.0), feasible(100.0))
    relative, told = told_history(store, "study", journal)
    assert relative is True
    # The feasible trial without a baseline has no value on the relative scale: not told.
    # The infeasible one stays infeasible (what the feasibility model learns), goodput unknown.
    assert [(dict(c)["kv_cache_memory_bytes"], r.outcome) for c, r in told] == [
        (LARGE, TrialOutcome.SLO_BROKEN),
        (LARGE, TrialOutcome.FEASIBLE),
    ]
    assert [r.goodput_tokens_per_s for _, r in told] == [None, 1.5]


def test_a_baseline_kept_only_in_the_rollout_journal_is_used(db: Database) -> None:
    store, journal = SqliteTrialStore(db), SqliteRolloutJournal(db)
    trial_id = add_trial(store, 1, SMALL, feasible(90.0), None)
    journal.save(
        RolloutRecord(
            trial_id,
            Strategy.PARALLEL,
            Phase.ROLLED_BACK,
            ("vllm", "serve", "m"),
            ("vllm", "serve", "m", "--kv-cache-memory-bytes", str(SMALL)),
            2.0,
            baseline_goodput_tokens_per_s=60.0,
        )
    )
    assert told_goodputs(store, journal) == [pytest.approx(1.5)]


def test_relative_result_keeps_the_outcome_and_the_memory() -> None:
    preempted = TrialResult(TrialOutcome.PREEMPTED, 50.0, SMALL, "0.5 preemptions per request")
    told = relative_result(preempted, 100.0)
    assert told is not None and told.outcome is TrialOutcome.PREEMPTED
    assert told.goodput_tokens_per_s == 0.5 and told.memory_bytes == SMALL
    assert told.reason == preempted.reason
    for no_figure in (None, 0.0, float("nan"), float("inf")):
        assert relative_result(feasible(80.0), no_figure) is None
        unknown = relative_result(preempted, no_figure)
        assert unknown is not None and unknown.goodput_tokens_per_s is None
        assert unknown.outcome is TrialOutcome.PREEMPTED


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def live_session(rig: Rig, suggester: RecordingSuggester) -> TuningSession:
    ids = (f"id{i}" for i in itertools.count(len(rig.store.trials()) + 1))
    return TuningSession(
        space=SPACE,
        suggester=suggester,
        store=rig.store,
        journal=rig.journal,
        runtime=rig.runtime,
        observer=rig.observer,
        fingerprint="study",
        settings=RolloutSettings(slo=SLO),
        strategy=Strategy.PARALLEL,
        wall_clock=lambda: float(next(rig.clock)),
        new_id=lambda: next(ids),
    )


@pytest.mark.anyio
async def test_the_live_tell_and_the_warm_start_tell_the_same_numbers() -> None:
    rig = Rig()
    live = RecordingSuggester()
    summary = await live_session(rig, live).run(3)
    trials = rig.store.trials("study")
    assert [t.state for t in trials] == [
        TrialState.INFEASIBLE,  # 1 KiB: vLLM refused to start
        TrialState.COMPLETE,
        TrialState.COMPLETE,
    ]
    # Live, each measured trial is told relative to the stable side of its own windows.
    for (_, told), trial in zip(live.told[1:], trials[1:], strict=True):
        assert trial.result is not None and trial.baseline is not None
        absolute, stable = trial.result.goodput_tokens_per_s, trial.baseline.goodput_tokens_per_s
        assert absolute is not None and stable is not None and stable > 0
        assert told.goodput_tokens_per_s == pytest.approx(absolute / stable)
        assert told.goodput_tokens_per_s != pytest.approx(absolute)

    # The next run's warm start tells the same numbers for the same trials.
    warm = RecordingSuggester()
    assert warm_start(warm, SPACE, told_history(rig.store, "study", rig.journal)[1]) == 3
    assert warm.told == live.told

    # What is stored and reported stays absolute: the best so far in tokens per second.
    promoted = trials[2].result
    assert promoted is not None and summary.best_goodput_tokens_per_s is not None
    assert summary.best_goodput_tokens_per_s == promoted.goodput_tokens_per_s
    assert summary.best_goodput_tokens_per_s != live.told[2][1].goodput_tokens_per_s
