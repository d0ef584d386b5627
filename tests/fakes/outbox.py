"""An in-memory `Outbox` (see `kvpilot.agent.notify.delivery`): a dict that forgets everything
when the test ends. It passes the same contract as the SQLite outbox
(tests/agent/notify/test_outbox_contract.py) and also tells how each row left the backlog.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from kvpilot.agent.model import AlertEvent
from kvpilot.agent.notify.delivery import OutboxItem
from kvpilot.agent.notify.shedding import severity_rank


@dataclass(frozen=True, slots=True)
class FinishedItem:
    """A row that left the backlog: delivered, or given up with the last error."""

    item: OutboxItem
    delivered: bool
    finished_wall_s: float | None


class MemoryOutbox:
    """Implements the `Outbox` protocol with a dict; single-threaded use only."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._pending: dict[int, OutboxItem] = {}
        self._pending_keys: dict[tuple[str, str], int] = {}  # (notifier, dedup key) -> id
        self._finished: list[FinishedItem] = []

    def enqueue(self, notifier: str, event: AlertEvent, now_wall_s: float) -> int:
        pending_id = self._pending_keys.get((notifier, event.dedup_key))
        if pending_id is not None:
            return pending_id
        item_id = next(self._ids)
        self._pending_keys[(notifier, event.dedup_key)] = item_id
        self._pending[item_id] = OutboxItem(
            id=item_id,
            notifier=notifier,
            dedup_key=event.dedup_key,
            event=event,
            attempts=0,
            next_attempt_wall_s=now_wall_s,
            created_wall_s=now_wall_s,
            last_error=None,
        )
        return item_id

    def due(
        self, now_wall_s: float, limit: int = 100, *, notifier: str | None = None
    ) -> list[OutboxItem]:
        ready = [
            i
            for i in self._pending.values()
            if i.next_attempt_wall_s <= now_wall_s and notifier in (None, i.notifier)
        ]
        ready.sort(key=lambda i: (severity_rank(i), i.id))  # as SQLite's: critical first
        return ready[:limit]

    def mark_delivered(self, item_ids: Sequence[int], now_wall_s: float) -> None:
        for item_id in item_ids:
            item = self._pending.pop(item_id, None)
            if item is not None:
                del self._pending_keys[(item.notifier, item.dedup_key)]
                self._finished.append(FinishedItem(item, True, now_wall_s))

    def mark_failed(
        self,
        item_ids: Sequence[int],
        error: str,
        next_attempt_wall_s: float,
        *,
        give_up: bool = False,
    ) -> None:
        for item_id in item_ids:
            item = self._pending.get(item_id)
            if item is None:
                continue
            item = dataclasses.replace(
                item,
                attempts=item.attempts + 1,
                next_attempt_wall_s=next_attempt_wall_s,
                last_error=error,
            )
            if give_up:
                del self._pending[item_id]
                del self._pending_keys[(item.notifier, item.dedup_key)]
                self._finished.append(FinishedItem(item, False, None))
            else:
                self._pending[item_id] = item

    def pending_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for item in self._pending.values():
            counts[item.notifier] = counts.get(item.notifier, 0) + 1
        return counts

    def pending_of(self, notifier: str) -> list[OutboxItem]:
        return [i for i in self.pending() if i.notifier == notifier]

    def backlog(self) -> int:
        return len(self._pending)

    def make_pending_due(self, now_wall_s: float) -> int:
        held = [i for i in self._pending.values() if i.next_attempt_wall_s > now_wall_s]
        for item in held:
            self._pending[item.id] = dataclasses.replace(item, next_attempt_wall_s=now_wall_s)
        return len(held)

    def pending(self) -> list[OutboxItem]:
        """Every pending row, due or not, in the order enqueued (as `SqliteOutbox.pending`)."""
        return sorted(self._pending.values(), key=lambda i: i.id)

    def finished(self) -> list[FinishedItem]:
        """Rows that left the backlog, in the order they did."""
        return list(self._finished)
