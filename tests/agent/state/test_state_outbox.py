"""The SQLite outbox inside the state store's transactions.

The `Outbox` contract (and what survives a reopen) runs over every implementation in
tests/agent/notify/test_outbox_contract.py; this file holds what only the SQLite outbox does.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.agent.model import AlertEvent
from kvpilot.agent.state import StateStore
from tests.agent.notify.notify_helpers import make_event


def event(n: int) -> AlertEvent:
    return make_event(instance=f"i{n}", incident_id=f"inc{n}")


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
