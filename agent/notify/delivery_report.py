"""What a delivery pass reports: items by notifier and outcome, errors, the backlog."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DeliveryOutcome = Literal["delivered", "retry", "deferred", "given_up", "dropped"]


@dataclass(frozen=True, slots=True)
class DeliveryCount:
    """How many items of one notifier ended one pass with one outcome."""

    notifier: str
    outcome: DeliveryOutcome
    items_total: int


@dataclass(frozen=True, slots=True)
class DeliveryReport:
    """Outcomes since the last report (lanes that finished after their pass are in a later
    one): counts per notifier and outcome, errors seen, the backlog afterwards."""

    counts: tuple[DeliveryCount, ...]
    errors: tuple[tuple[str, str], ...]  # (notifier, message)
    backlog_items: int | None
    backlog_reason: str | None = None

    def count(self, notifier: str, outcome: DeliveryOutcome) -> int:
        return sum(
            c.items_total for c in self.counts if (c.notifier, c.outcome) == (notifier, outcome)
        )
