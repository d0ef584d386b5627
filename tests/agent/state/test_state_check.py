"""SQLite's verdict on the state database, and moving a damaged one aside without loss."""

from __future__ import annotations

from pathlib import Path

from kvpilot.agent.state import DB_FILENAME, StateStore, check_database, move_aside


def _real_database(state_dir: Path, facts: int = 200) -> Path:
    with StateStore.open(state_dir) as store:
        for i in range(facts):
            store.set_fact(f"fact-{i}", {"value": "x" * 400}, now_wall_s=1.0)
    return state_dir / DB_FILENAME


def test_a_sound_database_passes_and_is_not_changed_by_the_check(tmp_path: Path) -> None:
    db = _real_database(tmp_path)
    before = db.read_bytes()
    verdict = check_database(db)
    assert verdict.sound and not verdict.damaged
    assert check_database(db, full=True).sound
    assert db.read_bytes() == before


def test_missing_and_empty_files_are_not_yet_created_not_damaged(tmp_path: Path) -> None:
    missing = check_database(tmp_path / DB_FILENAME)
    assert not missing.exists and not missing.damaged
    (tmp_path / DB_FILENAME).write_bytes(b"")
    empty = check_database(tmp_path / DB_FILENAME)
    assert not empty.exists and not empty.damaged


def test_garbage_and_a_truncated_database_are_damaged(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"\x00\x01 not sqlite " * 500)
    assert check_database(garbage).problems == ("file is not a database",)

    db = _real_database(tmp_path / "real")
    data = db.read_bytes()
    db.write_bytes(data[: len(data) // 2])
    verdict = check_database(db)
    assert verdict.damaged and verdict.unreadable is None, verdict


def test_move_aside_keeps_every_byte_and_never_overwrites(tmp_path: Path) -> None:
    db = tmp_path / DB_FILENAME
    wal = tmp_path / f"{DB_FILENAME}-wal"
    db.write_bytes(b"first")
    wal.write_bytes(b"first wal")
    first = move_aside(db, now_wall_s=1_700_000_000.0)
    assert [(s.name, t.name) for s, t in first] == [
        (DB_FILENAME, f"{DB_FILENAME}.damaged-20231114T221320Z"),
        (wal.name, f"{DB_FILENAME}-wal.damaged-20231114T221320Z"),
    ]
    db.write_bytes(b"second")  # damaged again within the same second
    second = move_aside(db, now_wall_s=1_700_000_000.0)
    assert second[0][1].name == f"{DB_FILENAME}.damaged-20231114T221320Z-2"
    assert first[0][1].read_bytes() == b"first"
    assert first[1][1].read_bytes() == b"first wal"
    assert second[0][1].read_bytes() == b"second"
    assert not db.exists() and not wal.exists()
