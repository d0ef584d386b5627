"""The in-memory outbox passes the outbox contract."""

from __future__ import annotations

import pytest

from tests.agent.notify.notify_helpers import make_event
from tests.agent.notify.outbox_contract import OutboxContract
from tests.fakes.outbox import MemoryOutbox


class TestMemoryOutbox(OutboxContract):
    @pytest.fixture
    def outbox(self) -> MemoryOutbox:
        return MemoryOutbox()

    def test_finished_rows_say_how_they_ended(self, outbox: MemoryOutbox) -> None:
        sent = outbox.enqueue("hook", make_event(), 1.0)
        outbox.mark_delivered([sent], 2.0)
        (finished,) = outbox.finished()
        assert finished.delivered and finished.finished_wall_s == 2.0 and finished.item.id == sent
