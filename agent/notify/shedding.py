"""The outbox's bound: which notifications go when one notifier's backlog outgrows it.

Prometheus's notifier holds at most `--alertmanager.notification-queue-capacity` alerts
(10,000) and drops the oldest when full, counted in `prometheus_notifications_dropped_total`:
an alert's newest state says more than an older one, and a firing alert is sent again at its
repeat interval anyway. kvpilot bounds each notifier's backlog the same way, with one
addition: the lowest severity goes first, so that a flood of warnings from thousands of
engines cannot push a critical page out. A dropped row ends as given up, its reason saying
why, and is counted as `dropped` in `kvpilot_notifications_total`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.agent.model import Labels
from kvpilot.agent.notify.outbox_item import OutboxItem

DEFAULT_MAX_PENDING_PER_NOTIFIER = 10_000  # Prometheus's default queue capacity
# Lower goes last. A severity kvpilot does not know counts as a warning: a receiver's own
# naming is not a reason to drop its alerts first.
_SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}
_UNKNOWN_RANK = _SEVERITY_RANK["warning"]


def severity_rank_of(labels: Labels) -> int:
    """0 for critical, 1 for warning (and unknown severities), 2 for info: the order in which
    an outbox gives a notifier's due rows, and the reverse of the order they are dropped in."""
    severity = dict(labels).get("severity", "")
    return _SEVERITY_RANK.get(severity, _UNKNOWN_RANK)


def severity_rank(item: OutboxItem) -> int:
    return severity_rank_of(item.event.labels)


def to_drop(items: Sequence[OutboxItem], keep: int) -> list[OutboxItem]:
    """The rows to drop so that at most `keep` of `items` stay: the lowest severity first,
    the oldest first within a severity. Oldest is the order enqueued (the id), never the
    wall-clock creation time, which a step back of the clock would turn into the newest."""
    excess = len(items) - max(keep, 0)
    if excess <= 0:
        return []
    order = sorted(items, key=lambda i: (-severity_rank(i), i.id))
    return order[:excess]


def drop_reason(notifier: str, max_pending: int) -> str:
    return (
        f"dropped: {notifier}'s outbox holds at most {max_pending} notifications "
        "(lowest severity, then oldest, go first)"
    )
