"""The `TrialStore` contract, run over every implementation: the agent's SQLite store and the
in-memory double (tests/fakes/trial_store.py).

`store` gives an empty store of each implementation. `reopen` exists only for the
implementations whose trials outlive the process (`PERSISTENT`): each call closes the previous
opening and opens the same database again, as a restarted kvpilot does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpilot.agent.state.db import Database
from kvpilot.agent.state.trials import SqliteTrialStore
from kvpilot.tuner.judge.judgement import judge
from kvpilot.tuner.problem.objective import TrialOutcome, TrialResult, WindowMetrics
from kvpilot.tuner.trials import (
    Trial,
    TrialState,
    TrialStore,
    abort_unfinished,
    history,
    new_trial,
    next_number,
)
from tests.fakes.trial_store import InMemoryTrialStore

IMPLEMENTATIONS = ("sqlite", "memory")
PERSISTENT = ("sqlite",)  # trials survive closing and reopening the database

METRICS = WindowMetrics("client", 10.0, 4, 0, 4, 1.0, 0.5, 0.05, 40.0, 0.0, 0.0)
Reopen = Callable[[], TrialStore]


@pytest.fixture(params=IMPLEMENTATIONS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TrialStore]:
    if request.param == "memory":
        yield InMemoryTrialStore()
        return
    db = Database.open(tmp_path)
    try:
        yield SqliteTrialStore(db)
    finally:
        db.close()


@pytest.fixture(params=PERSISTENT)
def reopen(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Reopen]:
    assert request.param == "sqlite"
    opened: list[Database] = []

    def open_again() -> TrialStore:
        if opened:
            opened.pop().close()  # the previous process is gone before the next one opens
        opened.append(Database.open(tmp_path))
        return SqliteTrialStore(opened[-1])

    yield open_again
    for db in opened:
        db.close()


def complete(store: TrialStore, trial_id: str, fingerprint: str, number: int, goodput: float):
    trial = new_trial(trial_id, fingerprint, number, {"max_num_seqs": number * 8}, at_wall_s=number)
    store.add(trial)
    running = trial.to(TrialState.RUNNING, at_wall_s=number + 0.5)
    store.save(running)
    done = running.finish(
        TrialResult(TrialOutcome.FEASIBLE, goodput, 1024, None, METRICS), at_wall_s=number + 0.9
    )
    store.save(done)
    return done


def running(store: TrialStore, trial_id: str, number: int, at_wall_s: float) -> Trial:
    trial = new_trial(trial_id, "s", number, {"max_num_seqs": 8}, at_wall_s=at_wall_s)
    store.add(trial)
    moved = trial.to(TrialState.RUNNING, at_wall_s=at_wall_s + 0.5)
    store.save(moved)
    return moved


# --- add, save, get ------------------------------------------------------------------


def test_add_get_and_list_by_study(store: TrialStore) -> None:
    a = complete(store, "a", "study-1", 1, 10.0)
    b = complete(store, "b", "study-2", 1, 20.0)
    c = complete(store, "c", "study-1", 2, 30.0)
    assert store.get("a") == a
    assert store.get("missing") is None
    assert store.trials("study-1") == [a, c]
    assert store.trials() == [a, b, c]
    assert store.trials("no-such-study") == []


def test_duplicate_ids_and_unknown_saves_are_refused(store: TrialStore) -> None:
    trial = new_trial("t", "s", 1, {"max_num_seqs": 8}, at_wall_s=0.0)
    store.add(trial)
    with pytest.raises(ValueError, match="exists"):
        store.add(trial)
    with pytest.raises(KeyError):
        store.save(new_trial("u", "s", 2, {}, at_wall_s=0.0))


def test_a_refused_write_changes_nothing(store: TrialStore) -> None:
    kept = running(store, "t", 1, at_wall_s=1.0)
    with pytest.raises(ValueError, match="exists"):
        store.add(new_trial("t", "other", 9, {"max_num_seqs": 64}, at_wall_s=5.0))
    with pytest.raises(KeyError):
        store.save(new_trial("u", "s", 2, {}, at_wall_s=0.0))
    assert store.get("t") == kept
    assert store.get("u") is None
    assert store.trials() == [kept]


def test_results_and_judgements_survive_the_round_trip(store: TrialStore) -> None:
    trial = new_trial("t", "s", 1, {"gpu_memory_utilization": 0.8, "max_num_seqs": 8}, 0.0)
    store.add(trial)
    verdict = judge({"ttft_s": [1.0] * 10}, {"ttft_s": [1.0] * 10})
    failed = TrialResult.failed_to_start("ValueError: No available memory for the cache blocks")
    done = trial.to(
        TrialState.INFEASIBLE,
        at_wall_s=1.0,
        reason=failed.reason,
        result=failed,
        judgement=verdict,
    )
    store.save(done)
    assert store.get("t") == done


def test_knob_values_keep_their_types_and_order(store: TrialStore) -> None:
    values = {"max_num_seqs": 16, "gpu_memory_utilization": 0.85, "enable_prefix_caching": False}
    trial = new_trial("t", "s", 1, values, at_wall_s=0.0)
    store.add(trial)
    got = store.get("t")
    assert got is not None and got.values == trial.values
    assert [type(v) for _, v in got.values] == [int, float, bool]


# --- state transitions ---------------------------------------------------------------

PATHS = {
    "complete": (TrialState.RUNNING, TrialState.COMPLETE),
    "infeasible after running": (TrialState.RUNNING, TrialState.INFEASIBLE),
    "infeasible at once": (TrialState.INFEASIBLE,),
    "failed while running": (TrialState.RUNNING, TrialState.FAILED),
    "failed at once": (TrialState.FAILED,),
    "aborted": (TrialState.RUNNING, TrialState.ABORTED),
}


@pytest.mark.parametrize("path", PATHS.values(), ids=PATHS.keys())
def test_each_transition_is_stored_as_it_happens(
    store: TrialStore, path: tuple[TrialState, ...]
) -> None:
    trial = new_trial("t", "s", 1, {"max_num_seqs": 8}, at_wall_s=1.0)
    store.add(trial)
    assert store.get("t") == trial and store.unfinished() == [trial]
    for step, state in enumerate(path, 2):
        reason = None if state in (TrialState.RUNNING, TrialState.COMPLETE) else f"{state} why"
        trial = trial.to(state, at_wall_s=float(step), reason=reason)
        store.save(trial)
        assert store.get("t") == trial
        assert store.trials() == [trial]
        assert store.unfinished() == ([] if state.terminal else [trial])
    assert trial.state.terminal


def test_a_failed_trial_is_a_record_with_its_reason(store: TrialStore) -> None:
    complete(store, "a", "s", 1, 10.0)
    broken = running(store, "b", 2, at_wall_s=3.0)
    reason = "failed in phase observing: RuntimeError: the load generator lost its connection"
    failed = broken.to(TrialState.FAILED, at_wall_s=4.0, reason=reason)
    store.save(failed)
    got = store.get("b")
    assert got == failed
    assert got is not None and (got.state, got.reason, got.updated_wall_s) == (
        TrialState.FAILED,
        reason,
        4.0,
    )
    assert [t.trial_id for t in store.trials("s")] == ["a", "b"]
    assert store.unfinished() == []
    # Not a measurement: the suggester is not told about it, yet its number stays taken.
    assert [v for v, _ in history(store, "s")] == [{"max_num_seqs": 8}]
    assert next_number(store, "s") == 3


def test_an_infeasible_trial_keeps_its_reason_and_result(store: TrialStore) -> None:
    trial = running(store, "t", 1, at_wall_s=1.0)
    slow = TrialResult(TrialOutcome.SLO_BROKEN, 5.0, 2048, "40% of requests met the SLO", METRICS)
    store.save(trial.finish(slow, at_wall_s=2.0))
    got = store.get("t")
    assert got is not None and got.state is TrialState.INFEASIBLE
    assert got.reason == slow.reason and got.result == slow
    assert history(store, "s") == [({"max_num_seqs": 8}, slow)]


# --- ordering ------------------------------------------------------------------------


def test_trials_are_listed_by_creation_then_number(store: TrialStore) -> None:
    late = new_trial("late", "s", 1, {}, at_wall_s=5.0)
    early_2 = new_trial("early-2", "s", 3, {}, at_wall_s=1.0)
    early_1 = new_trial("early-1", "s", 2, {}, at_wall_s=1.0)
    for trial in (late, early_2, early_1):
        store.add(trial)
    assert [t.trial_id for t in store.trials()] == ["early-1", "early-2", "late"]
    assert [t.trial_id for t in store.unfinished()] == ["early-1", "early-2", "late"]


def test_a_transition_does_not_move_a_trial_in_the_list(store: TrialStore) -> None:
    first = running(store, "first", 1, at_wall_s=1.0)
    running(store, "second", 2, at_wall_s=2.0)
    store.save(first.to(TrialState.ABORTED, at_wall_s=99.0, reason="stopped"))
    assert [t.trial_id for t in store.trials()] == ["first", "second"]
    assert [t.trial_id for t in store.unfinished()] == ["second"]


# --- trials left unfinished ----------------------------------------------------------


def test_unfinished_trials_are_aborted_with_the_reason(store: TrialStore) -> None:
    complete(store, "done", "s", 1, 10.0)
    planned = new_trial("p", "s", 2, {"max_num_seqs": 8}, at_wall_s=5.0)
    store.add(planned)
    moving = new_trial("r", "s", 3, {"max_num_seqs": 16}, at_wall_s=6.0)
    store.add(moving)
    store.save(moving.to(TrialState.RUNNING, at_wall_s=6.5))
    assert {t.trial_id for t in store.unfinished()} == {"p", "r"}
    aborted = abort_unfinished(store, at_wall_s=9.0, reason="kvpilot restarted mid-trial")
    assert {t.trial_id for t in aborted} == {"p", "r"}
    assert store.unfinished() == []
    got = store.get("r")
    assert got is not None and got.state is TrialState.ABORTED
    assert got.reason == "kvpilot restarted mid-trial" and got.updated_wall_s == 9.0


def test_aborting_touches_only_unfinished_trials_and_is_idempotent(store: TrialStore) -> None:
    done = complete(store, "done", "s", 1, 10.0)
    running(store, "r", 2, at_wall_s=3.0)
    (aborted,) = abort_unfinished(store, at_wall_s=9.0, reason="kvpilot stopped mid-trial")
    assert store.get("done") == done
    assert abort_unfinished(store, at_wall_s=10.0, reason="again") == []
    assert store.get("r") == aborted  # the second pass left the reason and time alone


def test_history_holds_measured_trials_only_and_numbers_continue(store: TrialStore) -> None:
    complete(store, "a", "s", 1, 10.0)
    store.add(new_trial("b", "s", 2, {"max_num_seqs": 99}, at_wall_s=3.0))
    abort_unfinished(store, at_wall_s=4.0, reason="stopped")
    past = history(store, "s")
    assert [(values, result.goodput_tokens_per_s) for values, result in past] == [
        ({"max_num_seqs": 8}, 10.0)
    ]
    assert next_number(store, "s") == 3
    assert next_number(store, "other") == 1


# --- what survives a reopen (persistent implementations only) ------------------------


def test_trials_survive_reopening_the_database(reopen: Reopen) -> None:
    store = reopen()
    trial = new_trial("t", "s", 1, {"kv_cache_memory_bytes": 2097152}, at_wall_s=1.0)
    store.add(trial)
    moving = trial.to(TrialState.RUNNING, at_wall_s=2.0)
    store.save(moving)
    done = complete(store, "d", "s", 2, 25.0)
    store = reopen()
    assert store.unfinished() == [moving]
    assert store.trials() == [moving, done]
    assert store.get("d") == done and history(store, "s") == [({"max_num_seqs": 16}, done.result)]


def test_trials_left_running_are_aborted_at_the_next_start(reopen: Reopen) -> None:
    store = reopen()
    complete(store, "done", "s", 1, 10.0)
    running(store, "r", 2, at_wall_s=3.0)
    store.add(new_trial("p", "s", 3, {}, at_wall_s=4.0))
    store = reopen()  # kvpilot died mid-trial; the next start cleans up
    aborted = abort_unfinished(store, at_wall_s=50.0, reason="kvpilot stopped mid-trial")
    assert [t.trial_id for t in aborted] == ["r", "p"]
    store = reopen()
    assert store.unfinished() == []
    assert [(t.trial_id, t.state, t.reason) for t in store.trials()] == [
        ("done", TrialState.COMPLETE, None),
        ("r", TrialState.ABORTED, "kvpilot stopped mid-trial"),
        ("p", TrialState.ABORTED, "kvpilot stopped mid-trial"),
    ]
    assert next_number(store, "s") == 4


def test_a_refused_duplicate_stays_refused_after_a_reopen(reopen: Reopen) -> None:
    store = reopen()
    kept = running(store, "t", 1, at_wall_s=1.0)
    store = reopen()
    with pytest.raises(ValueError, match="exists"):
        store.add(new_trial("t", "s", 2, {}, at_wall_s=2.0))
    assert store.get("t") == kept
