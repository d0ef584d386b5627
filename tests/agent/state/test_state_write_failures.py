"""A write that cannot commit (a full disk, a read-only file): SQLite's own error surfaces,
is counted by reason and said once a minute, and the tracker forgets what it marked sent."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest

from kvpilot.agent.alerts import AlertTracker
from kvpilot.agent.model import Condition, labels_of
from kvpilot.agent.state import StateStore
from kvpilot.agent.state.errors import sqlite_reason
from kvpilot.agent.state.write_failures import WriteFailures

LOGGER = "kvpilot.agent.state.write_failures"


def _full(store: StateStore) -> sqlite3.OperationalError:
    """The error of a write that needs a page a capped file cannot have."""
    store.db.cap_pages(store.db.page_count())
    with pytest.raises(sqlite3.OperationalError) as full, store.transaction():
        store.set_fact("small", 1, now_wall_s=1.0)
        store.set_fact("big", "x" * 20_000, now_wall_s=1.0)
    return full.value


def test_a_full_disk_surfaces_as_itself_and_rolls_the_whole_transaction_back(
    tmp_path: Path,
) -> None:
    with StateStore.open(tmp_path) as store:
        error = _full(store)
        assert str(error) == "database or disk is full"  # not "cannot rollback ..."
        assert sqlite_reason(error) == "disk_full"
        assert store.get_fact("small") is None  # all or nothing
        store.db.cap_pages(None)
        with store.transaction():  # the connection is usable again
            store.set_fact("big", "x" * 20_000, now_wall_s=1.0)
        assert store.get_fact("big") == "x" * 20_000


def test_a_read_only_connection_is_read_only(tmp_path: Path) -> None:
    StateStore.open(tmp_path).close()
    connection = sqlite3.connect(tmp_path / "kvpilot.db")
    connection.execute("PRAGMA query_only = ON")
    with pytest.raises(sqlite3.OperationalError) as refused:
        connection.execute("PRAGMA user_version = 1")
    connection.close()
    assert sqlite_reason(refused.value) == "read_only"
    assert sqlite_reason(sqlite3.OperationalError("no code")) == "other"


def test_failures_are_counted_each_time_and_said_once_a_minute_then_once_at_the_end(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    with StateStore.open(tmp_path) as store:
        error = _full(store)
    failures = WriteFailures(log_every_s=60.0)
    for now_s in (0.0, 1.0, 30.0, 59.0, 61.0, 62.0):
        assert failures.failed(error, "the alert changes of a tick", now_s) == "disk_full"
    assert failures.failing
    failures.succeeded(70.0)
    failures.succeeded(71.0)  # nothing more to say
    assert failures.totals() == (("disk_full", 6),)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]
    assert [level for level, _ in lines] == [logging.ERROR, logging.ERROR, logging.WARNING]
    assert "database or disk is full" in lines[0][1] and "retried" in lines[0][1]
    assert lines[2][1] == "state database: writes succeed again after 6 failed over 70 s"
    assert all(r.exc_info is None for r in caplog.records)


LABELS = labels_of({"alertname": "VllmKvCacheSaturated", "instance": "vllm-0"})


def _active() -> Condition:
    return Condition(
        rule="instant",
        labels=LABELS,
        active=True,
        value=1.0,
        summary="s",
        annotations=labels_of({"summary": "s"}),
    )


def test_a_rolled_back_update_is_decided_and_sent_again() -> None:
    tracker = AlertTracker(repeat_interval_s=3600.0)
    before = tracker.checkpoint()
    fired = tracker.update([_active()], 10.0, 1010.0)
    assert [t.event.status for t in fired if t.event] == ["firing"]
    tracker.rollback(before)  # the transaction holding its outbox row failed
    assert [a.state for a in tracker.alerts()] == []
    again = tracker.update([_active()], 11.0, 1011.0)
    assert [(t.to_state, t.repeat, t.event is not None) for t in again] == [("firing", False, True)]
    assert tracker.update([_active()], 12.0, 1012.0) == []  # sent now: no repeat for an hour
