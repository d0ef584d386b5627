"""Batches: lanes of many alerts packed into one request for a receiver that takes lists.

Alertmanager's `POST /api/v2/alerts` takes a list, so thousands of alerts need not cost
thousands of requests: Prometheus's notifier sends up to 64 alerts per request. Order holds
within each alert's lane (its items stay in order inside a batch); a webhook or Slack
receiver takes one event per request, so each of its lanes is its own send.
"""

from __future__ import annotations

from kvpilot.agent.notify.base import BatchingNotifier, Notifier
from kvpilot.agent.notify.outbox_item import OutboxItem

LaneKey = tuple[str, str]  # (notifier, alert fingerprint)
Lane = tuple[LaneKey, list[OutboxItem]]


def batch_size_of(notifier: Notifier) -> int:
    """Events per request for a notifier that takes batches; 1 for one that does not."""
    return max(1, notifier.batch_size) if isinstance(notifier, BatchingNotifier) else 1


def groups(lanes: list[Lane], size: int) -> list[list[Lane]]:
    """Lanes packed, in order, into sends of up to `size` items (a longer lane goes alone);
    a notifier without batches sends each lane on its own."""
    if size <= 1:
        return [[lane] for lane in lanes]
    groups: list[list[Lane]] = []
    current: list[Lane] = []
    count = 0
    for key, items in lanes:
        if current and count + len(items) > size:
            groups.append(current)
            current, count = [], 0
        current.append((key, items))
        count += len(items)
    if current:
        groups.append(current)
    return groups
