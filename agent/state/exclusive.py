"""How the agent opens its state: the directory for itself alone, the database checked.

In order: the directory (created when missing, refused when it is a file), the lock (a
second agent stops here, naming the first), SQLite's quick check of an existing database
(a damaged one is refused, never recreated), then the usual open and migration, and a
write that changes nothing (SQLite opens a file it cannot write read-only, silently).
Every failure is a `StateError` whose message says what to do.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from kvpilot.agent.state.check import check_database
from kvpilot.agent.state.db import DB_FILENAME, STATE_DIR_MODE, Database
from kvpilot.agent.state.errors import (
    StateDamaged,
    StateError,
    StateUnusable,
    unusable_database,
)
from kvpilot.agent.state.lock import StateLock
from kvpilot.agent.state.migrations import SchemaTooNewError
from kvpilot.agent.state.store import StateStore
from kvpilot.collectors.safe_files import UnsafeFile, check_not_planted


def open_exclusive(state_dir: Path) -> StateStore:
    """The agent's store, holding the directory's lock until the store is closed."""
    _ensure_directory(state_dir)
    lock = StateLock.acquire(state_dir)
    try:
        return StateStore(_open_checked(state_dir / DB_FILENAME), lock=lock)
    except BaseException:
        lock.release()
        raise


def _ensure_directory(state_dir: Path) -> None:
    if state_dir.exists() and not state_dir.is_dir():
        raise StateUnusable(
            f"state_dir {state_dir}: is a file, not a directory. Point state_dir at a "
            "directory (kvpilot creates it when missing)."
        )
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=STATE_DIR_MODE)
    except OSError as exc:
        raise StateUnusable(
            f"state_dir {state_dir}: cannot create it: {exc.strerror or exc}"
        ) from None


def _open_checked(db_path: Path) -> Database:
    try:  # before the check reads it: a link planted there is refused, never followed
        check_not_planted(db_path)
    except UnsafeFile as exc:
        raise StateUnusable(
            f"state_dir {db_path.parent}: the database {db_path.name} is {exc.strerror}; "
            "remove it (kvpilot creates its own)"
        ) from None
    verdict = check_database(db_path)
    if verdict.damaged:
        raise StateDamaged(db_path, verdict.problems)
    if verdict.unreadable is not None:
        raise StateUnusable(
            f"state_dir {db_path.parent}: cannot read the database {db_path.name}: "
            f"{verdict.unreadable}"
        )
    try:
        db = Database.open(db_path.parent)
    except SchemaTooNewError as exc:
        raise StateError(f"state_dir {db_path.parent}: {exc}") from None
    except sqlite3.Error as exc:
        raise unusable_database(db_path, exc) from None
    except OSError as exc:
        raise StateUnusable(
            f"state_dir {db_path.parent}: cannot open the database: {exc.strerror or exc}"
        ) from None
    try:
        db.check_writable()
    except sqlite3.Error as exc:
        db.close()
        raise unusable_database(db_path, exc) from None
    return db
