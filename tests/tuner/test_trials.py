"""Trial records, their state machine and the plain-data form (stores: the contract suite)."""

from __future__ import annotations

import json

import pytest

from kvpilot.tuner.judge.judgement import judge
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult
from kvpilot.tuner.trials import (
    TrialState,
    TrialTransitionError,
    new_trial,
    trial_from_dict,
    trial_to_dict,
)
from tests.tuner.test_trial_store_contract import METRICS


def test_the_state_machine_allows_only_forward_moves() -> None:
    planned = new_trial("t", "s", 1, {"max_num_seqs": 8}, at_wall_s=0.0)
    with pytest.raises(TrialTransitionError):
        planned.to(TrialState.COMPLETE, at_wall_s=1.0)  # never measured
    running = planned.to(TrialState.RUNNING, at_wall_s=1.0)
    done = running.to(TrialState.COMPLETE, at_wall_s=2.0)
    for state in TrialState:
        with pytest.raises(TrialTransitionError):
            done.to(state, at_wall_s=3.0, reason="late")


def test_failure_states_need_a_reason() -> None:
    planned = new_trial("t", "s", 1, {}, at_wall_s=0.0)
    with pytest.raises(TrialTransitionError, match="needs a reason"):
        planned.to(TrialState.ABORTED, at_wall_s=1.0)
    assert planned.to(TrialState.ABORTED, at_wall_s=1.0, reason="x").reason == "x"


def test_finish_picks_complete_or_infeasible_from_the_result() -> None:
    running = new_trial("t", "s", 1, {}, at_wall_s=0.0).to(TrialState.RUNNING, at_wall_s=1.0)
    ok = running.finish(TrialResult(TrialOutcome.FEASIBLE, 5.0, None, None), at_wall_s=2.0)
    assert ok.state is TrialState.COMPLETE and ok.reason is None
    slow = TrialResult(TrialOutcome.SLO_BROKEN, 5.0, None, "40% of requests met the SLO")
    bad = running.finish(slow, at_wall_s=2.0)
    assert bad.state is TrialState.INFEASIBLE and bad.reason == slow.reason


def test_plain_data_form_round_trips_through_json() -> None:
    trial = new_trial("t", "s", 4, {"gpu_memory_utilization": 0.85, "max_num_seqs": 32}, 1.0)
    result = TrialResult(TrialOutcome.PREEMPTED, 12.5, 4096, "0.3 preemptions per request", METRICS)
    failed = TrialResult.failed_to_start("ValueError: To serve at least one request with the ...")
    for res in (result, failed):
        done = trial.to(
            TrialState.INFEASIBLE,
            at_wall_s=2.0,
            reason=res.reason,
            result=res,
            judgement=judge({"ttft_s": [1.0, 2.0] * 5}, {"ttft_s": [1.0, 2.0] * 5}),
        )
        text = json.dumps(trial_to_dict(done))
        assert trial_from_dict(json.loads(text)) == done
