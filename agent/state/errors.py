"""Why the state directory cannot be used, each with what to do about it.

A `StateError`'s message is the whole story for an operator: what is wrong, where, and the
recovery step. `kvpilot run` prints it and exits non-zero, never with a traceback.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

# SQLite's primary result codes (the low byte of an extended code).
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_SQLITE_READONLY = 8
_SQLITE_IOERR = 10
_SQLITE_CORRUPT = 11
_SQLITE_FULL = 13
_SQLITE_CANTOPEN = 14
_SQLITE_NOTADB = 26

_REASONS = {
    _SQLITE_FULL: "disk_full",
    _SQLITE_READONLY: "read_only",
    _SQLITE_IOERR: "io_error",
    _SQLITE_CORRUPT: "corrupt",
    _SQLITE_NOTADB: "corrupt",
    _SQLITE_BUSY: "busy",
    _SQLITE_LOCKED: "busy",
    _SQLITE_CANTOPEN: "cannot_open",
}
WRITE_ERROR_REASONS = (*sorted(set(_REASONS.values())), "other")


def sqlite_reason(exc: sqlite3.Error) -> str:
    """A short label for what SQLite said: disk_full, read_only, corrupt, ... or other."""
    code = getattr(exc, "sqlite_errorcode", None)
    return _REASONS.get(code & 0xFF, "other") if isinstance(code, int) else "other"


class StateError(Exception):
    """The state directory or its database cannot be used; the message says what to do."""


class StateLocked(StateError):
    """Another agent holds the state directory."""

    def __init__(self, state_dir: Path, holder_pid: int | None, holder_host: str | None) -> None:
        self.holder_pid = holder_pid
        who = f"PID {holder_pid}" if holder_pid is not None else "its PID not yet written"
        if holder_host:
            who += f" on {holder_host}"
        super().__init__(
            f"state_dir {state_dir}: another kvpilot ({who}) is running on it. One agent per "
            "state directory: two would send every notification twice. Stop that agent, or "
            "give this one its own state_dir."
        )


class StateDamaged(StateError):
    """The database fails SQLite's own check; it is left exactly as it is."""

    def __init__(self, db_path: Path, problems: tuple[str, ...]) -> None:
        self.problems = problems
        shown = "; ".join(problems[:3]) + ("; ..." if len(problems) > 3 else "")
        super().__init__(
            f"state_dir {db_path.parent}: the database {db_path.name} is damaged ({shown}). "
            "It was left untouched. See what SQLite finds with `kvpilot state check --config "
            "FILE`; `kvpilot state repair --config FILE` moves it aside (kept, with a "
            "timestamp) so that the next start creates a fresh one: alert states, the outbox "
            "and the history start empty."
        )


class StateUnusable(StateError):
    """The directory or the database cannot be written (a file, read-only, no space, ...)."""


def unusable_database(db_path: Path, exc: sqlite3.Error) -> StateError:
    """The error to raise when opening `db_path` failed with `exc`."""
    reason = sqlite_reason(exc)
    where = f"state_dir {db_path.parent}: the database {db_path.name}"
    if reason == "corrupt":
        return StateDamaged(db_path, (str(exc),))
    if reason == "read_only":
        return StateUnusable(
            f"{where} is read-only ({exc}); kvpilot must write it. Make the file and its "
            "directory writable by the agent's user, or point state_dir elsewhere."
        )
    if reason == "disk_full":
        return StateUnusable(f"{where} cannot be written: the disk is full ({exc}). Free space.")
    return StateUnusable(f"{where} cannot be opened: {exc}")
