"""The trial and rollout tables' migration.

The SQLite trial store and rollout journal pass the contracts that every implementation
passes (and what survives a reopen) in tests/tuner/test_trial_store_contract.py and
tests/tuner/rollout/test_journal_contract.py.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from kvpilot.agent.state.migrations import MIGRATIONS, migrate, schema_version


def test_migration_two_adds_the_tables_to_a_version_one_database(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "old.db", isolation_level=None)
    try:
        assert migrate(conn, MIGRATIONS[:1]) == 1
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert "trials" not in tables
        assert migrate(conn, MIGRATIONS[:2]) == 2 == schema_version(conn)
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert {"trials", "rollouts", "alerts"} <= tables
    finally:
        conn.close()
