"""Schema versions: fresh databases, step-by-step migration, refusal of newer schemas."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from kvpilot.agent.state import DB_FILENAME, SCHEMA_VERSION, Database, SchemaTooNewError
from kvpilot.agent.state.migrations import MIGRATIONS, migrate, schema_version

TABLES = {
    "alerts",
    "outbox",
    "remediations",
    "audit",
    "silences",
    "kv",
    "trials",
    "rollouts",
    "tuning_ground",
}


def connect(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def tables(conn: sqlite3.Connection) -> set[str]:
    rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    return {r[0] for r in rows} - {"sqlite_sequence"}


def test_a_fresh_database_gets_every_table_and_the_current_version(tmp_path: Path) -> None:
    db = Database.open(tmp_path / "state")
    db.close()
    conn = connect(tmp_path / "state" / DB_FILENAME)
    assert schema_version(conn) == SCHEMA_VERSION == len(MIGRATIONS)
    assert tables(conn) == TABLES
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_connection_settings(tmp_path: Path) -> None:
    db = Database.open(tmp_path, busy_timeout_s=2.5)
    try:
        assert db.read("PRAGMA synchronous")[0][0] == 1  # NORMAL
        assert db.read("PRAGMA foreign_keys")[0][0] == 1
        assert db.read("PRAGMA busy_timeout")[0][0] == 2500
    finally:
        db.close()


def test_reopening_does_not_migrate_again(tmp_path: Path) -> None:
    Database.open(tmp_path).close()
    conn = connect(tmp_path / DB_FILENAME)
    conn.execute("INSERT INTO kv VALUES ('k', '1', 0)")
    conn.close()
    db = Database.open(tmp_path)
    assert [tuple(r) for r in db.read("SELECT key, value_json FROM kv")] == [("k", "1")]
    db.close()


def _v2_add_note(conn: sqlite3.Connection) -> None:
    conn.execute("ALTER TABLE kv ADD COLUMN note TEXT NOT NULL DEFAULT 'from v2'")


def test_migrations_run_step_by_step_and_keep_data(tmp_path: Path) -> None:
    conn = connect(tmp_path / "db")
    assert migrate(conn, MIGRATIONS[:1]) == 1
    conn.execute("INSERT INTO kv VALUES ('k', '1', 0)")
    assert migrate(conn, (*MIGRATIONS[:1], _v2_add_note)) == 2
    assert conn.execute("SELECT key, note FROM kv").fetchall() == [("k", "from v2")]


def test_a_failing_step_leaves_the_previous_version_intact(tmp_path: Path) -> None:
    conn = connect(tmp_path / "db")
    migrate(conn, MIGRATIONS[:1])

    def broken(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE half_done (x INTEGER)")
        raise RuntimeError("the step fails half-way")

    with pytest.raises(RuntimeError, match="half-way"):
        migrate(conn, (*MIGRATIONS[:1], broken))
    assert schema_version(conn) == 1
    assert "half_done" not in tables(conn)
    assert not conn.in_transaction


def test_a_database_from_a_newer_kvpilot_is_refused(tmp_path: Path) -> None:
    Database.open(tmp_path).close()
    conn = connect(tmp_path / DB_FILENAME)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(SchemaTooNewError, match="written by a newer kvpilot"):
        Database.open(tmp_path)
    conn = connect(tmp_path / DB_FILENAME)
    assert schema_version(conn) == SCHEMA_VERSION + 1  # left untouched
