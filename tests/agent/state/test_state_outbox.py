"""The SQLite outbox inside the state store's transactions.

The `Outbox` contract (and what survives a reopen) runs over every implementation in
tests/agent/notify/test_outbox_contract.py; this file holds what only the SQLite outbox does.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from kvpilot.agent.model import AlertEvent
from kvpilot.agent.state import DB_FILENAME, Database, StateStore
from kvpilot.agent.state.migrations import MIGRATIONS, migrate, schema_version
from kvpilot.agent.state.outbox import SqliteOutbox, event_to_json
from tests.agent.notify.notify_helpers import make_event


def event(n: int) -> AlertEvent:
    return make_event(instance=f"i{n}", incident_id=f"inc{n}")


def test_enqueue_commits_with_an_enclosing_transaction_or_not_at_all(tmp_path: Path) -> None:
    with StateStore.open(tmp_path) as store:
        with pytest.raises(RuntimeError), store.transaction():
            store.outbox.enqueue("hook", event(1), 10.0)
            store.record_audit(
                wall_s=10.0,
                actor="rule",
                action="notify",
                target="i1",
                decision="queued",
                reason="firing",
            )
            raise RuntimeError("crash between the two writes")
        assert store.outbox.backlog() == 0
        assert store.audit_records() == []


# --- the severity column and the index that serves the due rows' order (schema v4) ---------


class PlannedDatabase(Database):
    """The real state database, also recording how SQLite plans each read."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        super().__init__(conn, path)
        self.plans: list[str] = []

    def read(self, sql: str, params: tuple[object, ...] = ()) -> list[sqlite3.Row]:
        plan = super().read(f"EXPLAIN QUERY PLAN {sql}", params)
        self.plans.append(" / ".join(str(row["detail"]) for row in plan))
        return super().read(sql, params)


def severe(n: int, severity: str, status: str = "firing") -> AlertEvent:
    return make_event(
        instance=f"i{n}",
        incident_id=f"inc{n}",
        status=status,  # type: ignore[arg-type]
        extra_labels={"severity": severity},
    )


def test_a_notifiers_due_rows_are_read_through_the_index_in_their_order(tmp_path: Path) -> None:
    """The index walks one notifier's pending rows critical first, then by id: a read stops
    after `limit` rows instead of sorting the whole backlog."""
    db = PlannedDatabase.open(tmp_path)
    try:
        outbox = SqliteOutbox(db)
        for n in range(3):
            outbox.enqueue("hook", severe(n, "warning"), 10.0)
        page = outbox.enqueue("hook", severe(9, "critical"), 10.0)
        assert [i.id for i in outbox.due(10.0, limit=1, notifier="hook")] == [page]
        (plan,) = db.plans
        assert "USING INDEX outbox_due (notifier=?)" in plan, plan
        assert "TEMP B-TREE" not in plan, plan
    finally:
        db.close()


def _insert_v3_row(
    conn: sqlite3.Connection, event_json: str, state: str = "pending", notifier: str = "hook"
) -> int:
    (rows,) = conn.execute("SELECT count(*) FROM outbox").fetchone()
    cursor = conn.execute(
        "INSERT INTO outbox (notifier, dedup_key, event_json, state, next_attempt_wall_s, "
        "created_wall_s) VALUES (?, ?, ?, ?, 10.0, 10.0)",
        (notifier, f"key-{rows}", event_json, state),
    )
    return int(cursor.lastrowid or 0)


def test_migration_four_ranks_the_pending_rows_of_a_version_three_outbox(tmp_path: Path) -> None:
    """Rows queued by the previous schema keep their place and get their severity: after the
    upgrade a critical one queued behind warnings is read first; a row whose event cannot be
    read counts as a warning instead of keeping the database from opening."""
    conn = sqlite3.connect(tmp_path / DB_FILENAME, isolation_level=None)
    try:
        assert migrate(conn, MIGRATIONS[:3]) == 3
        warning = _insert_v3_row(conn, event_to_json(severe(1, "warning")))
        info = _insert_v3_row(conn, event_to_json(severe(2, "info")))
        broken = _insert_v3_row(conn, '{"labels": 7}', notifier="gone")
        firing = _insert_v3_row(conn, event_to_json(severe(3, "critical")))
        resolved = _insert_v3_row(conn, event_to_json(severe(3, "critical", "resolved")))
        _insert_v3_row(conn, event_to_json(severe(4, "critical")), state="delivered")
    finally:
        conn.close()
    with StateStore.open(tmp_path) as store:
        due = store.outbox.due(10.0, notifier="hook")
        assert [i.id for i in due] == [firing, resolved, warning, info]
        ((rank,),) = store.db.read("SELECT severity_rank FROM outbox WHERE id = ?", (broken,))
        assert rank == 1
        (index,) = store.db.read("SELECT sql FROM sqlite_master WHERE name = 'outbox_due'")
        assert "(notifier, severity_rank, id)" in index[0]
    conn = sqlite3.connect(tmp_path / DB_FILENAME, isolation_level=None)
    try:
        assert schema_version(conn) == 4
    finally:
        conn.close()
