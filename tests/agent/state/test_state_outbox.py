"""The SQLite outbox passes the shared Outbox contract, and persists across a reopen."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.agent.model import AlertEvent
from kvpilot.agent.notify.delivery import Outbox
from kvpilot.agent.state import StateStore
from tests.agent.notify.notify_helpers import make_event
from tests.agent.notify.outbox_contract import OutboxContract


def event(n: int) -> AlertEvent:
    return make_event(instance=f"i{n}", incident_id=f"inc{n}")


class TestSqliteOutbox(OutboxContract):
    @pytest.fixture
    def outbox(self, tmp_path: Path) -> Iterator[Outbox]:
        with StateStore.open(tmp_path) as store:
            yield store.outbox


def test_pending_rows_survive_a_reopen(tmp_path: Path) -> None:
    with StateStore.open(tmp_path) as store:
        delivered = store.outbox.enqueue("hook", event(1), 10.0)
        failed = store.outbox.enqueue("hook", event(2), 11.0)
        store.outbox.mark_delivered([delivered], 12.0)
        store.outbox.mark_failed([failed], "refused", 20.0)
    with StateStore.open(tmp_path) as store:
        (item,) = store.outbox.due(20.0)
        assert (item.id, item.attempts, item.last_error, item.event) == (
            failed,
            1,
            "refused",
            event(2),
        )
        assert store.outbox.enqueue("hook", event(2), 30.0) == failed
        assert [i.id for i in store.outbox.pending()] == [failed]


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
