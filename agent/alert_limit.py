"""The alert tracker's bound: at most `max_alerts` alerts pending, firing or resolved at once.

Without it, thousands of engines (or a server whose labels change on every scrape) are
thousands of alerts: rows written on every tick, notifications, requests to every receiver.
Prometheus's alerting rules have a `limit` past which a rule's alerts are all discarded;
kvpilot keeps the alerts it already tracks (their resolution must still go out) and admits
new ones while there is room, the most severe first. What it held back is said by one alert
of its own, `KvpilotAlertsLimited`, whose value is how many alerts it held back this tick; it
is never held back itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpilot.agent.model import Condition, labels_of

DEFAULT_MAX_ALERTS = 1_000
LIMIT_RULE = "alert_limit"
LIMIT_ALERT = "KvpilotAlertsLimited"
# Lower is admitted first; a severity kvpilot does not know counts as a warning.
_SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}


def _rank(condition: Condition) -> int:
    return _SEVERITY_RANK.get(dict(condition.labels).get("severity", ""), 1)


def admitted(
    conditions: Sequence[Condition],
    live: int,
    starts: Callable[[Condition], bool],
    max_alerts: int,
) -> frozenset[str] | None:
    """The fingerprints of the alerts that may start this tick (`starts` tells which
    conditions would start one), the most severe first, in order within a severity; None
    when all of them fit beside the `live` ones."""
    starting = [c for c in conditions if starts(c)]
    room = max(max_alerts - live, 0)
    if len(starting) <= room:
        return None
    return frozenset(c.fingerprint for c in sorted(starting, key=_rank)[:room])


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
