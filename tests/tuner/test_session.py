"""Tuning runs of several trials, against the in-memory runtime test double."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from kvpilot.tuner.problem.space import Candidate, Knob, KnobKind, SearchSpace
from kvpilot.tuner.rollout.canary import Phase, RolloutSettings, Strategy
from kvpilot.tuner.session import (
    Progress,
    TuningBlocked,
    TuningSession,
    candidate_argv,
    dry_run,
)
from kvpilot.tuner.suggest import GridSuggester
from kvpilot.tuner.trials import TrialState
from tests.tuner.rollout.test_canary import SLO, STABLE, Rig

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# Ascending: a start failure, then worse, then better budgets than the stable's 2 MiB.
LEVELS = (1024.0, 1048576.0, 33554432.0)
SPACE = SearchSpace(
    knobs=(Knob("kv_cache_memory_bytes", KnobKind.INTEGER, 1024, 33554432, levels=LEVELS),)
)


def session(rig: Rig, on_progress: Callable[[Progress], None] | None = None) -> TuningSession:
    ids = (f"id{i}" for i in itertools.count(len(rig.store.trials()) + 1))
    return TuningSession(
        space=SPACE,
        suggester=GridSuggester(SPACE),
        store=rig.store,
        journal=rig.journal,
        runtime=rig.runtime,
        observer=rig.observer,
        fingerprint="study",
        settings=RolloutSettings(slo=SLO),
        strategy=Strategy.PARALLEL,
        wall_clock=lambda: float(next(rig.clock)),
        on_progress=on_progress,
        new_id=lambda: next(ids),
    )


def test_candidate_argv_replaces_the_knob_flags_in_either_spelling() -> None:
    space = SearchSpace(
        knobs=(
            Knob("max_num_seqs", KnobKind.INTEGER, 1, 64),
            Knob("enable_prefix_caching", KnobKind.FLAG, choices=(False, True)),
        )
    )
    cand = space.candidate({"max_num_seqs": 8, "enable_prefix_caching": True})
    base = ("vllm", "--max-num-seqs=256", "--port", "8000", "--no-enable-prefix-caching")
    assert candidate_argv(base, space, cand) == (
        "vllm",
        "--port",
        "8000",
        "--max-num-seqs",
        "8",
        "--enable-prefix-caching",
    )


async def test_a_run_records_every_trial_and_promotes_only_the_better_one() -> None:
    rig = Rig()
    progress: list[Progress] = []
    summary = await session(rig, progress.append).run(3)
    states = [(t.number, t.state) for t in rig.store.trials("study")]
    assert states == [
        (1, TrialState.INFEASIBLE),  # 1 KiB: vLLM refused to start
        (2, TrialState.COMPLETE),  # 1 MiB: measured, judged fail, rolled back
        (3, TrialState.COMPLETE),  # 32 MiB: promoted
    ]
    phases = [o.record.phase for o in summary.outcomes]
    assert phases == [Phase.INFEASIBLE, Phase.ROLLED_BACK, Phase.PROMOTED]
    assert rig.runtime.argv[-1] == "33554432" and rig.runtime.canary is None
    assert summary.best_goodput_tokens_per_s == rig.store.trials()[2].result.goodput_tokens_per_s  # type: ignore[union-attr]
    assert progress[0].trial_number == 1 and progress[0].phase is Phase.PLANNED
    assert progress[-1].phase is Phase.PROMOTED
    assert progress[-1].best_goodput_tokens_per_s == summary.best_goodput_tokens_per_s


async def test_a_second_run_warm_starts_from_the_history_and_numbers_continue() -> None:
    rig = Rig()
    await session(rig).run(1)
    second = await session(rig).run(2)
    assert second.warm_started_total == 1
    assert [t.number for t in rig.store.trials("study")] == [1, 2, 3]
    # The grid remembers what was tried: the second run never repeats the first's candidate.
    values = [dict(t.values)["kv_cache_memory_bytes"] for t in rig.store.trials("study")]
    assert len(set(values)) == 3


async def test_a_run_stops_when_the_space_is_exhausted() -> None:
    rig = Rig()
    summary = await session(rig).run(5)
    assert len(summary.outcomes) == 3 and "stopped" in summary.stopped_reason


async def test_no_run_while_a_remediation_is_in_progress() -> None:
    rig = Rig()
    rig.runtime.remediating = True
    with pytest.raises(TuningBlocked, match="remediation"):
        await session(rig).run(2)
    assert rig.store.trials() == [] and rig.runtime.calls == []


async def test_a_remediation_that_starts_mid_run_stops_it_between_trials() -> None:
    rig = Rig()

    def remediation_starts(progress: Progress) -> None:
        if progress.phase is Phase.INFEASIBLE:
            rig.runtime.remediating = True

    summary = await session(rig, remediation_starts).run(3)
    assert len(summary.outcomes) == 1 and "remediation" in summary.stopped_reason


async def test_a_refused_promotion_stops_the_run() -> None:
    # The grid walks up: a start failure, a worse budget, then the better one, whose
    # promotion the guards refuse; the run stops there rather than meet the guard again.
    rig = Rig()
    rig.runtime.refuse_new = True
    summary = await session(rig).run(5)  # unrefused, it would stop on the exhausted grid
    assert len(summary.outcomes) == 3
    last = summary.outcomes[-1]
    assert last.refused == "cooldown: restarted 10 s ago"
    assert summary.stopped_reason == (
        "stopped: the safe-restart path refused a restart: cooldown: restarted 10 s ago"
    )
    assert rig.runtime.argv == STABLE


def test_dry_run_plans_without_touching_the_runtime() -> None:
    rig = Rig()
    told, planned = dry_run(SPACE, GridSuggester(SPACE), rig.store, "study", 2, initial_points=1)
    assert told == 0
    assert [p.candidate["kv_cache_memory_bytes"] for p in planned] == [1024, 1048576]
    assert planned[0].why.startswith("initial point") and "model-guided" in planned[1].why
    assert rig.runtime.calls == [] and rig.store.trials() == [] and rig.runtime.argv == STABLE


def test_a_dry_run_gives_the_reasons_a_suggester_gives() -> None:
    class Explained(GridSuggester):
        def explain(self, candidate: Candidate) -> str:
            return f"because {candidate['kv_cache_memory_bytes']}"

    _, planned = dry_run(SPACE, Explained(SPACE), Rig().store, "study", 2, initial_points=1)
    assert [p.why for p in planned] == ["because 1024", "because 1048576"]
