"""The SQLite trial store and rollout journal: the shared contract, persistence, migration."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.agent.state.db import Database
from kvpilot.agent.state.migrations import MIGRATIONS, migrate, schema_version
from kvpilot.agent.state.trials import SqliteRolloutJournal, SqliteTrialStore
from kvpilot.tuner.rollout import Phase, RolloutRecord, Strategy
from kvpilot.tuner.trials import TrialState, new_trial
from tests.tuner.trial_store_contract import TrialStoreContract


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    database = Database.open(tmp_path)
    yield database
    database.close()


class TestSqliteTrialStore(TrialStoreContract):
    @pytest.fixture
    def store(self, db: Database) -> SqliteTrialStore:
        return SqliteTrialStore(db)


def test_trials_survive_reopening_the_database(tmp_path: Path) -> None:
    first = Database.open(tmp_path)
    trial = new_trial("t", "s", 1, {"kv_cache_memory_bytes": 2097152}, at_wall_s=1.0)
    SqliteTrialStore(first).add(trial)
    running = trial.to(TrialState.RUNNING, at_wall_s=2.0)
    SqliteTrialStore(first).save(running)
    first.close()
    again = Database.open(tmp_path)
    try:
        assert SqliteTrialStore(again).unfinished() == [running]
    finally:
        again.close()


def test_the_journal_keeps_one_record_per_trial_in_first_saved_order(db: Database) -> None:
    journal = SqliteRolloutJournal(db)
    a = RolloutRecord("a", Strategy.PARALLEL, Phase.PLANNED, ("v", "--x", "1"), ("v",), 1.0)
    b = RolloutRecord("b", Strategy.SEQUENTIAL, Phase.PLANNED, ("v",), ("v", "--y"), 2.0)
    journal.save(a)
    journal.save(b)
    a2 = a.at(Phase.ROLLED_BACK, at_wall_s=3.0, reason="judged fail")
    journal.save(a2)
    assert journal.get("a") == a2 and journal.get("missing") is None
    assert journal.records() == [a2, b]  # a's update keeps its place
    assert journal.open_records() == [b]
    b2 = b.at(Phase.OBSERVING, at_wall_s=4.0, baseline_goodput_tokens_per_s=12.5)
    journal.save(b2)
    assert journal.open_records() == [b2]


def test_migration_two_adds_the_tables_to_a_version_one_database(tmp_path: Path) -> None:
    import sqlite3

    conn = sqlite3.connect(tmp_path / "old.db", isolation_level=None)
    try:
        assert migrate(conn, MIGRATIONS[:1]) == 1
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert "trials" not in tables
        assert migrate(conn) == 2 == schema_version(conn)
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert {"trials", "rollouts", "alerts"} <= tables
    finally:
        conn.close()
