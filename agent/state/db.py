"""The state database's connection: opened, tuned and migrated once, with short transactions.

Thread safety: a `Database` belongs to the thread that opened it (the agent's event-loop
thread); sqlite3 refuses calls from any other thread (`check_same_thread`). Calls are
synchronous and short (milliseconds), so they run on the loop without an executor. Other
processes (a second kvpilot, `sqlite3` on the command line) may read meanwhile: WAL mode.

Durability: WAL with `synchronous=NORMAL` keeps every committed transaction across a crash of
the process (SIGKILL included); only a power loss or OS crash may drop the last few.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvpilot.agent.state.migrations import migrate
from kvpilot.collectors.safe_files import check_not_planted, open_no_follow

DB_FILENAME = "kvpilot.db"
STATE_DIR_MODE = 0o700  # when kvpilot creates it: the database holds the alerts' history
_SIDE_FILES = ("-wal", "-shm", "-journal")
DEFAULT_BUSY_TIMEOUT_S = 5.0
# The write-ahead log: checkpointed every 256 pages (1 MiB at 4 KiB pages, SQLite's default is
# 1,000) and cut back to this size once it restarts. Without the limit the file keeps the
# largest size it ever reached: every tick commits, so a steady agent's directory was the
# database plus a 4 MiB log.
WAL_AUTOCHECKPOINT_PAGES = 256
WAL_LIMIT_BYTES = 1 << 20
_NO_PAGE_CAP = 4294967294  # SQLite's own largest max_page_count


class Database:
    """One SQLite connection in autocommit mode; `transaction()` groups writes."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self._conn = conn
        self.path = path
        self._depth = 0

    @classmethod
    def open(cls, state_dir: Path, *, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S) -> Database:
        """Opens (creating if needed) `state_dir/kvpilot.db` and migrates it to this schema."""
        state_dir.mkdir(parents=True, exist_ok=True, mode=STATE_DIR_MODE)
        path = state_dir / DB_FILENAME
        _claim_files(path)
        conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None)
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError(f"{path}: cannot use WAL mode (got {mode})")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute(f"PRAGMA wal_autocheckpoint = {WAL_AUTOCHECKPOINT_PAGES}")
            conn.execute(f"PRAGMA journal_size_limit = {WAL_LIMIT_BYTES}")
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
            self._conn.execute("COMMIT")
        except BaseException:
            rollback(self._conn)
            raise
        finally:
            self._depth = 0

    def read(self, sql: str, params: tuple[object, ...] = ()) -> list[sqlite3.Row]:
        """Rows of one query (a read needs no explicit transaction)."""
        cursor = self._conn.execute(sql, params)
        cursor.row_factory = sqlite3.Row
        return cursor.fetchall()

    def check_writable(self) -> None:
        """Raises sqlite3.OperationalError ("attempt to write a readonly database") unless this
        connection may write: SQLite opens a file it cannot write read-only without a word."""
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            version = int(self._conn.execute("PRAGMA user_version").fetchone()[0])
            self._conn.execute(f"PRAGMA user_version = {version}")  # a write that changes nothing
        finally:
            rollback(self._conn)

    def cap_pages(self, pages: int | None) -> int:
        """Caps the file at `pages` pages (SQLite's `max_page_count`, never below the current
        size; None lifts the cap) and returns the cap. Writes past it fail with "database or
        disk is full", exactly as on a full disk: the fault tests fill a disk this way."""
        value = _NO_PAGE_CAP if pages is None else pages
        return int(self._conn.execute(f"PRAGMA max_page_count = {int(value)}").fetchone()[0])

    def page_count(self) -> int:
        return int(self._conn.execute("PRAGMA page_count").fetchone()[0])

    def integrity_check(self) -> str:
        """SQLite's own verdict on the file: 'ok' or the first problem found."""
        return str(self._conn.execute("PRAGMA integrity_check").fetchone()[0])

    def close(self) -> None:
        self._conn.close()


def _claim_files(path: Path) -> None:
    """The database file created (or kept) private, before SQLite opens it by name; SQLite
    follows symbolic links, so one planted at the file or its companions is refused here
    (`UnsafeFile`) rather than written through. The companions take the file's mode."""
    os.close(open_no_follow(path, os.O_RDONLY | os.O_CREAT))
    for side in _SIDE_FILES:
        check_not_planted(Path(f"{path}{side}"))


def rollback(conn: sqlite3.Connection) -> None:
    """Ends the open transaction, if any. After "database or disk is full" (and some I/O
    errors) SQLite has already rolled it back: a second ROLLBACK would raise "no transaction
    is active" and hide the error that says what happened."""
    if conn.in_transaction:
        conn.execute("ROLLBACK")
