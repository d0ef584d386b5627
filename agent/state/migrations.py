"""The state database's schema: the one module that knows it, versioned by `PRAGMA user_version`.

Each migration takes the database from version i to i + 1 inside its own transaction, so a
crash mid-way leaves the previous version intact. Append new migrations; never edit old ones.
Migrations use `conn.execute` (or `_execute_script`), never `executescript`, which commits.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Sequence

from kvpilot.agent.notify.shedding import severity_rank_of

Migration = Callable[[sqlite3.Connection], None]


class SchemaTooNewError(RuntimeError):
    """The database was written by a newer kvpilot; this one must not touch it."""


def _v1(conn: sqlite3.Connection) -> None:
    """Alerts, outbox, remediations, audit, silences and small facts."""
    _execute_script(
        conn,
        """
        CREATE TABLE alerts (
            fingerprint TEXT PRIMARY KEY,
            rule TEXT NOT NULL,
            labels_json TEXT NOT NULL,
            annotations_json TEXT NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('inactive', 'pending', 'firing', 'resolved')),
            active_since_wall_s REAL,
            fired_at_wall_s REAL,
            incident_id TEXT,
            last_sent_wall_s REAL,
            last_seen_wall_s REAL NOT NULL,
            resolved_at_wall_s REAL
        ) STRICT;

        CREATE TABLE outbox (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            notifier TEXT NOT NULL,
            dedup_key TEXT NOT NULL,
            event_json TEXT NOT NULL,
            state TEXT NOT NULL DEFAULT 'pending'
                CHECK (state IN ('pending', 'delivered', 'given_up')),
            attempts INTEGER NOT NULL DEFAULT 0,
            next_attempt_wall_s REAL NOT NULL,
            created_wall_s REAL NOT NULL,
            finished_wall_s REAL,
            last_error TEXT
        ) STRICT;
        -- One pending row per (notifier, dedup key); delivered ones may repeat.
        CREATE UNIQUE INDEX outbox_pending_key ON outbox (notifier, dedup_key)
            WHERE state = 'pending';
        CREATE INDEX outbox_due ON outbox (created_wall_s, id) WHERE state = 'pending';

        CREATE TABLE remediations (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            incident_id TEXT,
            fingerprint TEXT,
            instance TEXT NOT NULL,
            action TEXT NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('planned', 'draining', 'restarting',
                'verifying', 'succeeded', 'failed', 'vetoed', 'skipped')),
            reason TEXT NOT NULL,
            started_wall_s REAL NOT NULL,
            finished_wall_s REAL,
            old_pid INTEGER,
            new_pid INTEGER
        ) STRICT;
        CREATE INDEX remediations_incident ON remediations (incident_id);
        CREATE INDEX remediations_instance ON remediations (instance, started_wall_s);

        CREATE TABLE audit (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            wall_s REAL NOT NULL,
            actor TEXT NOT NULL CHECK (actor IN ('rule', 'api', 'user', 'agent')),
            action TEXT NOT NULL,
            target TEXT NOT NULL,
            decision TEXT NOT NULL,
            reason TEXT NOT NULL,
            incident_id TEXT,
            remediation_id INTEGER REFERENCES remediations (id) ON DELETE SET NULL,
            details_json TEXT NOT NULL DEFAULT '{}'
        ) STRICT;
        CREATE INDEX audit_time ON audit (wall_s);

        CREATE TABLE silences (
            silence_id TEXT PRIMARY KEY,
            matchers_json TEXT NOT NULL,
            until_wall_s REAL NOT NULL,
            comment TEXT NOT NULL DEFAULT ''
        ) STRICT;

        CREATE TABLE kv (
            key TEXT PRIMARY KEY,
            value_json TEXT NOT NULL,
            updated_wall_s REAL NOT NULL
        ) STRICT;
        """,
    )


def _v2(conn: sqlite3.Connection) -> None:
    """Tuning trials and the rollout journal (one record per trial)."""
    _execute_script(
        conn,
        """
        CREATE TABLE trials (
            trial_id TEXT PRIMARY KEY,
            fingerprint TEXT NOT NULL,
            number INTEGER NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('planned', 'running', 'complete',
                'infeasible', 'failed', 'aborted')),
            created_wall_s REAL NOT NULL,
            updated_wall_s REAL NOT NULL,
            trial_json TEXT NOT NULL
        ) STRICT;
        CREATE INDEX trials_study ON trials (fingerprint, created_wall_s, number);
        CREATE INDEX trials_unfinished ON trials (created_wall_s)
            WHERE state IN ('planned', 'running');

        CREATE TABLE rollouts (
            trial_id TEXT PRIMARY KEY,
            phase TEXT NOT NULL,
            final INTEGER NOT NULL CHECK (final IN (0, 1)),
            seq INTEGER NOT NULL,
            updated_wall_s REAL NOT NULL,
            record_json TEXT NOT NULL
        ) STRICT;
        CREATE INDEX rollouts_open ON rollouts (seq) WHERE final = 0;
        """,
    )


def _v3(conn: sqlite3.Connection) -> None:
    """The ground each instance was last tuned on (vLLM version, model, workload shape)."""
    _execute_script(
        conn,
        """
        CREATE TABLE tuning_ground (
            instance TEXT PRIMARY KEY,
            vllm_version TEXT,
            model TEXT,
            workload_key TEXT,
            tuned_wall_s REAL NOT NULL
        ) STRICT;
        """,
    )


def _v4(conn: sqlite3.Connection) -> None:
    """The outbox's severity, and an index in the order due rows are read: per notifier,
    critical first, then the order enqueued (the id; the wall clock can step back)."""
    _execute_script(
        conn,
        """
        -- 0 critical, 1 warning (and unknown severities), 2 info.
        ALTER TABLE outbox ADD COLUMN severity_rank INTEGER NOT NULL DEFAULT 1
            CHECK (severity_rank IN (0, 1, 2));
        DROP INDEX outbox_due;
        CREATE INDEX outbox_due ON outbox (notifier, severity_rank, id) WHERE state = 'pending';
        """,
    )
    pending = conn.execute("SELECT id, event_json FROM outbox WHERE state = 'pending'")
    for row_id, event_json in pending.fetchall():
        rank = _severity_rank_stored(event_json)
        if rank is not None:
            conn.execute("UPDATE outbox SET severity_rank = ? WHERE id = ?", (rank, row_id))


def _severity_rank_stored(event_json: str) -> int | None:
    """The rank of a stored event's severity label; None (the column's default, a warning)
    when the row cannot be read, which must not keep the database from opening."""
    try:
        labels = tuple((str(k), str(v)) for k, v in json.loads(event_json)["labels"])
    except (ValueError, KeyError, TypeError):
        return None
    return severity_rank_of(labels)


MIGRATIONS: tuple[Migration, ...] = (_v1, _v2, _v3, _v4)
SCHEMA_VERSION = len(MIGRATIONS)


def schema_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def migrate(conn: sqlite3.Connection, migrations: Sequence[Migration] = MIGRATIONS) -> int:
    """Brings the database to `len(migrations)`, one step per transaction; returns the version.

    `conn` must be in autocommit mode (`isolation_level=None`): each step opens its own
    transaction so that its DDL and the version bump commit together.
    """
    current = schema_version(conn)
    if current > len(migrations):
        raise SchemaTooNewError(
            f"the state database has schema version {current}, but this kvpilot knows only "
            f"up to {len(migrations)}: it was written by a newer kvpilot. Upgrade kvpilot, or "
            "point state_dir at another directory."
        )
    for version in range(current, len(migrations)):
        conn.execute("BEGIN IMMEDIATE")
        try:
            if schema_version(conn) > version:  # another process migrated meanwhile
                conn.execute("ROLLBACK")
                continue
            migrations[version](conn)
            conn.execute(f"PRAGMA user_version = {version + 1}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # a full disk has rolled it back already
                conn.execute("ROLLBACK")
            raise
    return schema_version(conn)


def _execute_script(conn: sqlite3.Connection, script: str) -> None:
    """Runs each statement of `script` inside the open transaction (`executescript` would
    commit first)."""
    buffer = ""
    for line in script.splitlines(keepends=True):
        if line.strip().startswith("--") and not buffer.strip():
            continue
        buffer += line
        if sqlite3.complete_statement(buffer):
            conn.execute(buffer)
            buffer = ""
    if buffer.strip():
        raise ValueError(f"incomplete SQL statement in migration: {buffer.strip()[:80]!r}")
