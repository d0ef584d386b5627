"""The outbox as the delivery worker sees it: its rows and the protocol of their queue."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpilot.agent.model import AlertEvent


@dataclass(frozen=True, slots=True)
class OutboxItem:
    """One undelivered notification for one notifier."""

    id: int
    notifier: str
    dedup_key: str
    event: AlertEvent
    attempts: int
    next_attempt_wall_s: float
    created_wall_s: float
    last_error: str | None


class Outbox(Protocol):
    """Persistent queue of notifications, one row per (notifier, dedup key) while pending."""

    def enqueue(self, notifier: str, event: AlertEvent, now_wall_s: float) -> int:
        """Adds a row due now; while a row with the same (notifier, dedup key) is pending
        (neither delivered nor given up) returns that row's id instead. Once delivered, the
        same key may be enqueued again: that is a repeat notification."""
        ...

    def due(
        self, now_wall_s: float, limit: int = 100, *, notifier: str | None = None
    ) -> list[OutboxItem]:
        """Pending rows with next_attempt <= now, critical first (`shedding.severity_rank_of`),
        then in the order they were enqueued; only `notifier`'s when given. An alert's events
        share its labels, severity included, so they stay in the order enqueued."""
        ...

    def mark_delivered(self, item_ids: Sequence[int], now_wall_s: float) -> None:
        """The rows arrived; they leave the backlog."""
        ...

    def mark_failed(
        self,
        item_ids: Sequence[int],
        error: str,
        next_attempt_wall_s: float,
        *,
        give_up: bool = False,
    ) -> None:
        """Adds one to attempts, records the error; give_up ends the row (kept, recorded)."""
        ...

    def backlog(self) -> int:
        """Pending rows, due or not."""
        ...

    def make_pending_due(self, now_wall_s: float) -> int:
        """Every pending row held for later becomes due at `now_wall_s`; returns how many."""
        ...

    def pending_counts(self) -> dict[str, int]:
        """Pending rows by notifier (notifiers with none are absent)."""
        ...

    def pending_of(self, notifier: str) -> list[OutboxItem]:
        """Every pending row of one notifier, due or not, in the order they were enqueued."""
        ...
