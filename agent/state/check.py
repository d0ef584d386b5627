"""Whether the state database is sound, and moving a damaged one aside (never deleting it).

The check opens the file read-only: it never creates, migrates or repairs anything, so it
may run beside a live agent (WAL lets a reader in).
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from kvpilot.agent.state.errors import sqlite_reason

_SIDE_FILES = ("-wal", "-shm")  # SQLite's companions of a WAL database
MAX_PROBLEMS = 20


@dataclass(frozen=True, slots=True)
class DatabaseCheck:
    """What SQLite says of one database file."""

    path: Path
    exists: bool
    problems: tuple[str, ...] = ()  # SQLite's findings; the file is damaged when any
    unreadable: str | None = None  # it could not be read at all (permissions, ...)

    @property
    def damaged(self) -> bool:
        return bool(self.problems)

    @property
    def sound(self) -> bool:
        """Present, readable and without problems."""
        return self.exists and not self.problems and self.unreadable is None


def check_database(path: Path, *, full: bool = False) -> DatabaseCheck:
    """SQLite's `quick_check` (or the slower `integrity_check` with `full`) of `path`.

    A missing or empty file is a database not created yet, not a damaged one.
    """
    try:
        if path.stat().st_size == 0:
            return DatabaseCheck(path, exists=False)
    except FileNotFoundError:
        return DatabaseCheck(path, exists=False)
    except OSError as exc:
        return DatabaseCheck(path, exists=True, unreadable=exc.strerror or str(exc))
    pragma = "integrity_check" if full else "quick_check"
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        return _failed(path, exc)
    try:
        rows = conn.execute(f"PRAGMA {pragma}({MAX_PROBLEMS})").fetchall()
    except sqlite3.Error as exc:
        return _failed(path, exc)
    finally:
        conn.close()
    problems = tuple(str(row[0]) for row in rows if row[0] != "ok")
    return DatabaseCheck(path, exists=True, problems=problems)


def _failed(path: Path, exc: sqlite3.Error) -> DatabaseCheck:
    if sqlite_reason(exc) == "corrupt":  # "file is not a database", "... malformed"
        return DatabaseCheck(path, exists=True, problems=(str(exc),))
    return DatabaseCheck(path, exists=True, unreadable=str(exc))


def move_aside(path: Path, now_wall_s: float | None = None) -> list[tuple[Path, Path]]:
    """Renames `path` and its WAL companions to `<name>.damaged-<UTC time>`; returns each
    (from, to). Nothing is deleted and nothing existing is overwritten."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now_wall_s))
    suffix = f".damaged-{stamp}"
    n = 1
    while any(_with(path, side, suffix).exists() for side in ("", *_SIDE_FILES)):
        n += 1
        suffix = f".damaged-{stamp}-{n}"
    moved = []
    for side in ("", *_SIDE_FILES):  # the main file first: without it the others are inert
        source = Path(f"{path}{side}")
        if source.exists():
            target = _with(path, side, suffix)
            source.rename(target)
            moved.append((source, target))
    return moved


def _with(path: Path, side: str, suffix: str) -> Path:
    return Path(f"{path}{side}{suffix}")
