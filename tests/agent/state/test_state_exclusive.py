"""How the agent opens its state: alone, checked, and never over a damaged database."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpilot.agent.state import (
    DB_FILENAME,
    StateDamaged,
    StateLock,
    StateLocked,
    StateStore,
    StateUnusable,
    open_exclusive,
)


def test_a_first_start_creates_the_database_and_holds_the_directory(tmp_path: Path) -> None:
    state_dir = tmp_path / "new" / "state"
    with open_exclusive(state_dir) as store:
        assert (state_dir / DB_FILENAME).exists()
        store.set_fact("k", 1, now_wall_s=1.0)
        assert StateLock.holder(state_dir) == os.getpid()
        with pytest.raises(StateLocked, match=f"PID {os.getpid()}"):
            open_exclusive(state_dir)
    assert StateLock.holder(state_dir) is None  # closing the store gave the lock back
    with open_exclusive(state_dir) as again:
        assert again.get_fact("k") == 1


def test_a_damaged_database_is_refused_untouched_and_the_lock_given_back(tmp_path: Path) -> None:
    tmp_path.joinpath(DB_FILENAME).write_bytes(b"garbage " * 1000)
    with pytest.raises(StateDamaged, match="kvpilot state repair --config") as refused:
        open_exclusive(tmp_path)
    assert refused.value.problems == ("file is not a database",)
    assert tmp_path.joinpath(DB_FILENAME).read_bytes() == b"garbage " * 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == [DB_FILENAME, "kvpilot.lock"]
    assert StateLock.holder(tmp_path) is None


def test_a_state_dir_that_is_a_file_is_unusable(tmp_path: Path) -> None:
    path = tmp_path / "state"
    path.write_text("x")
    with pytest.raises(StateUnusable, match="is a file, not a directory"):
        open_exclusive(path)
    with pytest.raises(StateUnusable, match="cannot create it"):
        open_exclusive(path / "below")


def test_a_database_from_a_newer_kvpilot_is_one_message(tmp_path: Path) -> None:
    with StateStore.open(tmp_path) as store:
        store.db.read("PRAGMA user_version = 999")
    with pytest.raises(Exception, match="newer kvpilot") as refused:
        open_exclusive(tmp_path)
    assert type(refused.value).__name__ == "StateError"
