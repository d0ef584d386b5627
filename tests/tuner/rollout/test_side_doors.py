"""No side door to a promotion: a side's feasibility from all its windows, "feasible where
the stable is not" only when shown, a minimum memory saving, a cap on the goodput lost
against the deployed configuration, a bake judged by the same tests, a hold for review, and
"best so far" only among trials the judge passed."""

from __future__ import annotations

import pytest

from kvpilot.tuner.judge.judgement import Classification, Judgement
from kvpilot.tuner.judge.sequential import DEFAULT_WINDOWS
from kvpilot.tuner.problem.objective import Slo, TrialOutcome, TrialResult, WindowMetrics
from kvpilot.tuner.rollout.canary import Phase, RolloutSettings, Strategy
from kvpilot.tuner.rollout.decide import pooled, promotion_decision
from kvpilot.tuner.session import best_goodput
from kvpilot.tuner.trials import TrialState, new_trial
from tests.fakes.trial_store import InMemoryTrialStore
from tests.tuner.rollout.test_canary import GOOD, STABLE, Rig

pytestmark = pytest.mark.anyio
MIB = 1 << 20
PASS = Judgement(Classification.PASS, 1.0, (), "score 100%")
SLO = Slo()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def window(failed: int = 0, attaining: int | None = None, requests: int = 64) -> TrialResult:
    """One window's result as `objective.evaluate` gives it."""
    ok = requests - failed
    metrics = WindowMetrics(
        "client",
        10.0,
        requests,
        failed,
        ok if attaining is None else attaining,
        (ok if attaining is None else attaining) / requests,
        0.2,
        0.02,
        800.0,
        0.0,
        0.0,
    )
    outcome = TrialOutcome.REQUESTS_FAILED if failed else TrialOutcome.FEASIBLE
    return TrialResult(outcome, 800.0, 512 * MIB, "failed" if failed else None, metrics)


def test_one_failed_request_in_32_baseline_windows_does_not_promote() -> None:
    baseline = pooled([window(failed=1)] + [window()] * 31, SLO, 0.05)
    canary = pooled([window()] * 32, SLO, 0.05)
    assert not baseline.feasible and canary.feasible  # max_failed_ratio 0: one is too many
    promote, why = promotion_decision(canary, baseline, PASS, RolloutSettings())
    # The first infeasible window once stood for the side, and "feasible where the stable
    # is not" promoted on it; one failure in 2,048 requests shows nothing.
    assert not promote, why


def test_a_stable_shown_infeasible_still_loses_to_a_feasible_candidate() -> None:
    baseline = pooled([window(attaining=52)] * 8, Slo(max_failed_ratio=0.0), 0.05)
    canary = pooled([window()] * 8, SLO, 0.05)
    assert baseline.outcome is TrialOutcome.SLO_BROKEN and canary.feasible
    promote, why = promotion_decision(canary, baseline, PASS, RolloutSettings())
    assert promote and "feasible where the stable instance is not (more requests" in why


def test_feasibility_is_a_lower_bound_on_the_pooled_attainment() -> None:
    # 95.3 % of 64 requests attain: the point estimate meets 95 %, its lower bound does not.
    assert not pooled([window(attaining=61)], SLO, 0.05).feasible
    assert pooled([window()] * 4, SLO, 0.05).feasible


def test_a_2_mib_saving_does_not_promote_and_a_real_one_does() -> None:
    stable = TrialResult(TrialOutcome.FEASIBLE, 100.0, 512 * MIB, None)
    small = TrialResult(TrialOutcome.FEASIBLE, 100.0, 510 * MIB, None)
    promote, why = promotion_decision(small, stable, PASS, RolloutSettings())
    assert not promote, why
    large = TrialResult(TrialOutcome.FEASIBLE, 100.0, 384 * MIB, None)
    promote, why = promotion_decision(large, stable, PASS, RolloutSettings())
    assert promote and "25% less memory" in why, why


def test_a_promotion_past_the_loss_cap_against_the_deployed_configuration_is_refused() -> None:
    deployed = TrialResult(TrialOutcome.FEASIBLE, 100.0, 512 * MIB, None)
    stable = TrialResult(TrialOutcome.FEASIBLE, 92.0, 384 * MIB, None)  # promoted before
    candidate = TrialResult(TrialOutcome.FEASIBLE, 88.0, 256 * MIB, None)
    settings = RolloutSettings()
    promote, why = promotion_decision(candidate, stable, PASS, settings)
    assert promote, why  # within 5 % of the stable, a third less memory
    promote, why = promotion_decision(candidate, stable, PASS, settings, deployed=deployed)
    assert not promote and "12% below the deployed configuration's" in why, why


async def test_the_bake_observes_eight_windows_and_reverts_flags_shown_worse() -> None:
    rig = Rig(after_promotion=3.0)
    outcome = await rig.rollout(windows=8, bake_windows=8).run(rig.trial(), GOOD, Strategy.PARALLEL)
    assert outcome.record.phase is Phase.REVERTED, outcome.record.reason
    assert "worse than the old ones" in (outcome.record.reason or "")
    assert rig.observer.windows[-8:] == [GOOD] * 8 and len(rig.observer.windows) == 24
    held = Rig()  # the same flags baked at their own speed hold
    outcome = await held.rollout(windows=8, bake_windows=8).run(
        held.trial(), GOOD, Strategy.PARALLEL
    )
    assert outcome.promoted, outcome.record.reason


async def test_an_inconclusive_canary_can_be_held_for_review_instead_of_rolled_back() -> None:
    # Five windows of 60 requests cannot show the default half point of errors.
    rig = Rig()
    settings = {"windows": 5, "judge": RolloutSettings().judge, "hold_inconclusive": True}
    outcome = await rig.rollout(**settings).run(rig.trial(), STABLE, Strategy.PARALLEL)
    assert outcome.held and outcome.record.phase.final, outcome.record.reason
    assert "held for review" in (outcome.record.reason or "")
    assert "more windows needed" in (outcome.record.reason or "")
    assert rig.runtime.canary == STABLE and rig.runtime.argv == STABLE  # left as they were
    rolled = Rig()
    settings["hold_inconclusive"] = False
    outcome = await rolled.rollout(**settings).run(rolled.trial(), STABLE, Strategy.PARALLEL)
    assert outcome.record.phase is Phase.ROLLED_BACK and rolled.runtime.canary is None


def test_best_so_far_counts_only_trials_the_judge_passed() -> None:
    store = InMemoryTrialStore()
    failed = Judgement(Classification.FAIL, 0.5, (), "against: ttft_s high")
    for number, goodput, judgement in ((1, 900.0, failed), (2, 500.0, PASS), (3, 700.0, None)):
        trial = new_trial(f"t{number}", "study", number, {"kv_cache_memory_bytes": 1}, 0.0)
        store.add(trial)
        result = TrialResult(TrialOutcome.FEASIBLE, goodput, None, None)
        store.save(
            trial.to(TrialState.RUNNING, at_wall_s=1.0).to(
                TrialState.COMPLETE, at_wall_s=2.0, result=result, judgement=judgement
            )
        )
    assert best_goodput(store, "study", SLO) == 500.0


def test_one_default_for_windows() -> None:
    from kvpilot.agent.config.tuning import TuningConfig

    assert RolloutSettings().windows == DEFAULT_WINDOWS == TuningConfig().windows
