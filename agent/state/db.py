"""The state database's connection: opened, tuned and migrated once, with short transactions.

Thread safety: a `Database` belongs to the thread that opened it (the agent's event-loop
thread); sqlite3 refuses calls from any other thread (`check_same_thread`). Calls are
synchronous and short (milliseconds), so they run on the loop without an executor. Other
processes (a second kvpilot, `sqlite3` on the command line) may read meanwhile: WAL mode.

Durability: WAL with `synchronous=NORMAL` keeps every committed transaction across a crash of
the process (SIGKILL included); only a power loss or OS crash may drop the last few.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvpilot.agent.state.migrations import migrate

DB_FILENAME = "kvpilot.db"
DEFAULT_BUSY_TIMEOUT_S = 5.0


class Database:
    """One SQLite connection in autocommit mode; `transaction()` groups writes."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self._conn = conn
        self.path = path
        self._depth = 0

    @classmethod
    def open(cls, state_dir: Path, *, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S) -> Database:
        """Opens (creating if needed) `state_dir/kvpilot.db` and migrates it to this schema."""
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / DB_FILENAME
        conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None)
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError(f"{path}: cannot use WAL mode (got {mode})")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA foreign_keys = ON")
            migrate(conn)
        except BaseException:
            conn.close()
            raise
        return cls(conn, path)

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction (BEGIN IMMEDIATE); nested uses join the outer one."""
        if self._depth:
            self._depth += 1
            try:
                yield self._conn
            finally:
                self._depth -= 1
            return
        self._conn.execute("BEGIN IMMEDIATE")
        self._depth = 1
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        else:
            self._conn.execute("COMMIT")
        finally:
            self._depth = 0

    def read(self, sql: str, params: tuple[object, ...] = ()) -> list[sqlite3.Row]:
        """Rows of one query (a read needs no explicit transaction)."""
        cursor = self._conn.execute(sql, params)
        cursor.row_factory = sqlite3.Row
        return cursor.fetchall()

    def integrity_check(self) -> str:
        """SQLite's own verdict on the file: 'ok' or the first problem found."""
        return str(self._conn.execute("PRAGMA integrity_check").fetchone()[0])

    def close(self) -> None:
        self._conn.close()
