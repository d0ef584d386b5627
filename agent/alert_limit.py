"""The alert tracker's bound: at most `max_alerts` alerts pending, firing or resolved at once.

Without it, thousands of engines (or a server whose labels change on every scrape) are
thousands of alerts: rows written on every tick, notifications, requests to every receiver.
Prometheus's alerting rules have a `limit` past which a rule's alerts are all discarded;
kvpilot keeps the alerts it already tracks (their resolution must still go out) and admits
new ones while there is room, the most severe first. A new critical alert is never held back
behind less severe ones: it takes the place of the oldest resolved alert, then of a live one
of the lowest severity (pending before firing, the oldest first); a firing one so evicted is
resolved, saying why, and held back while its condition lasts. What it held back is said by
one alert of its own, `KvpilotAlertsLimited`, whose value is how many alerts it held back this
tick; it is never held back itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpilot.agent.model import AlertState, Condition, Labels, labels_of

DEFAULT_MAX_ALERTS = 1_000
LIMIT_RULE = "alert_limit"
LIMIT_ALERT = "KvpilotAlertsLimited"
# Lower is admitted first; a severity kvpilot does not know counts as a warning.
_SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}
_CRITICAL = 0
EVICTED_REASON = (
    "evicted: kvpilot tracks at most {max_alerts} alerts at once and a critical alert "
    "needed the place"
)


def severity_rank(labels: Labels) -> int:
    return _SEVERITY_RANK.get(dict(labels).get("severity", ""), 1)


@dataclass(frozen=True, slots=True)
class Tracked:
    """One alert that holds a place: pending, firing or resolved."""

    fingerprint: str
    state: AlertState
    labels: Labels
    since_s: float  # when it became resolved (resolved ones), else when it became active


@dataclass(frozen=True, slots=True)
class Admission:
    """Which alerts may start this tick (None: every one fits), and which tracked ones give
    up their place to a starting critical alert."""

    allowed: frozenset[str] | None
    evicted: tuple[str, ...] = ()


def admit(
    conditions: Sequence[Condition],
    tracked: Sequence[Tracked],
    starts: Callable[[Condition], bool],
    max_alerts: int,
) -> Admission:
    """The alerts that may start this tick (`starts` tells which conditions would start one),
    the most severe first, in order within a severity. Critical ones that find no room take
    the places of tracked alerts that are resolved or less severe (`_eviction_order`)."""
    starting = sorted((c for c in conditions if starts(c)), key=lambda c: severity_rank(c.labels))
    room = max(max_alerts - len(tracked), 0)
    if len(starting) <= room:
        return Admission(None)
    criticals = sum(1 for c in starting if severity_rank(c.labels) == _CRITICAL)
    evicted = tuple(t.fingerprint for t in _eviction_order(tracked)[: max(criticals - room, 0)])
    room += len(evicted)
    return Admission(frozenset(c.fingerprint for c in starting[:room]), evicted)


def _eviction_order(tracked: Sequence[Tracked]) -> list[Tracked]:
    """The places a critical alert may take: resolved alerts (the oldest first), then live
    ones below critical (the lowest severity first; within it pending, whose start nobody was
    told of, before firing; then the oldest first). A live critical alert keeps its place."""

    def order(t: Tracked) -> tuple[int, int, int, float]:
        if t.state == "resolved":
            return (0, 0, 0, t.since_s)
        return (1, -severity_rank(t.labels), t.state == "firing", t.since_s)

    return sorted(
        (t for t in tracked if t.state == "resolved" or severity_rank(t.labels) != _CRITICAL),
        key=order,
    )


def limit_condition(held_back: int, max_alerts: int) -> Condition:
    """KvpilotAlertsLimited: active while this tick held alerts back."""
    summary = (
        f"{held_back} alerts held back: kvpilot tracks at most {max_alerts} alerts at once"
        if held_back
        else f"no alert held back (at most {max_alerts} at once)"
    )
    return Condition(
        rule=LIMIT_RULE,
        labels=labels_of({"alertname": LIMIT_ALERT, "severity": "warning"}),
        active=held_back > 0,
        value=float(held_back),
        summary=summary,
        annotations=labels_of({"summary": summary}),
    )
