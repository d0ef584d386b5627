"""The contract every TrialStore passes; the agent's SQLite store can reuse it.

Subclass `TrialStoreContract` with a `store` fixture returning an empty store.
"""

from __future__ import annotations

import pytest

from kvpilot.tuner.judge import judge
from kvpilot.tuner.objective import Outcome, TrialResult, WindowMetrics
from kvpilot.tuner.trials import (
    TrialState,
    TrialStore,
    abort_unfinished,
    history,
    new_trial,
    next_number,
)

METRICS = WindowMetrics("client", 10.0, 4, 0, 4, 1.0, 0.5, 0.05, 40.0, 0.0, 0.0)


def complete(store: TrialStore, trial_id: str, fingerprint: str, number: int, goodput: float):
    trial = new_trial(trial_id, fingerprint, number, {"max_num_seqs": number * 8}, at_wall_s=number)
    store.add(trial)
    running = trial.to(TrialState.RUNNING, at_wall_s=number + 0.5)
    store.save(running)
    done = running.finish(
        TrialResult(Outcome.FEASIBLE, goodput, 1024, None, METRICS), at_wall_s=number + 0.9
    )
    store.save(done)
    return done


class TrialStoreContract:
    def test_add_get_and_list_by_study(self, store: TrialStore) -> None:
        a = complete(store, "a", "study-1", 1, 10.0)
        b = complete(store, "b", "study-2", 1, 20.0)
        c = complete(store, "c", "study-1", 2, 30.0)
        assert store.get("a") == a
        assert store.get("missing") is None
        assert store.trials("study-1") == [a, c]
        assert store.trials() == [a, b, c]

    def test_duplicate_ids_and_unknown_saves_are_refused(self, store: TrialStore) -> None:
        trial = new_trial("t", "s", 1, {"max_num_seqs": 8}, at_wall_s=0.0)
        store.add(trial)
        with pytest.raises(ValueError, match="exists"):
            store.add(trial)
        with pytest.raises(KeyError):
            store.save(new_trial("u", "s", 2, {}, at_wall_s=0.0))

    def test_results_and_judgements_survive_the_round_trip(self, store: TrialStore) -> None:
        trial = new_trial("t", "s", 1, {"gpu_memory_utilization": 0.8, "max_num_seqs": 8}, 0.0)
        store.add(trial)
        verdict = judge({"ttft_s": [1.0] * 10}, {"ttft_s": [1.0] * 10})
        failed = TrialResult.failed_to_start("ValueError: No available memory for the cache blocks")
        done = trial.to(
            TrialState.INFEASIBLE, at_wall_s=1.0, reason=failed.reason, result=failed,
            judgement=verdict,
        )  # fmt: skip
        store.save(done)
        assert store.get("t") == done

    def test_unfinished_trials_are_aborted_with_the_reason(self, store: TrialStore) -> None:
        complete(store, "done", "s", 1, 10.0)
        planned = new_trial("p", "s", 2, {"max_num_seqs": 8}, at_wall_s=5.0)
        store.add(planned)
        running = new_trial("r", "s", 3, {"max_num_seqs": 16}, at_wall_s=6.0)
        store.add(running)
        store.save(running.to(TrialState.RUNNING, at_wall_s=6.5))
        assert {t.trial_id for t in store.unfinished()} == {"p", "r"}
        aborted = abort_unfinished(store, at_wall_s=9.0, reason="kvpilot restarted mid-trial")
        assert {t.trial_id for t in aborted} == {"p", "r"}
        assert store.unfinished() == []
        got = store.get("r")
        assert got is not None and got.state is TrialState.ABORTED
        assert got.reason == "kvpilot restarted mid-trial" and got.updated_wall_s == 9.0

    def test_history_holds_measured_trials_only_and_numbers_continue(
        self, store: TrialStore
    ) -> None:
        complete(store, "a", "s", 1, 10.0)
        store.add(new_trial("b", "s", 2, {"max_num_seqs": 99}, at_wall_s=3.0))
        abort_unfinished(store, at_wall_s=4.0, reason="stopped")
        past = history(store, "s")
        assert [(values, result.goodput_tokens_per_s) for values, result in past] == [
            ({"max_num_seqs": 8}, 10.0)
        ]
        assert next_number(store, "s") == 3
        assert next_number(store, "other") == 1
