"""Remediation's own pages and advice as alerts of the tracker, like any rule's.

The remediator raises an `AlertEvent` when it opens a circuit breaker or advises tuning,
and a resolved one when that ends. Held here as conditions, they pass through the alert
tracker: silences suppress them, the API lists them, and their state is persisted with
every other alert.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpilot.agent.alert_values import AlertView
from kvpilot.agent.model import AlertEvent, Condition, labels_of
from kvpilot.agent.remediation.events import CIRCUIT_OPEN_ALERT, TUNING_RECOMMENDED_ALERT
from kvpilot.agent.remediation.oom.guard import SERVER_OOM_ALERT

PAGE_ALERTS = frozenset({CIRCUIT_OPEN_ALERT, TUNING_RECOMMENDED_ALERT, SERVER_OOM_ALERT})


class RemediationPages:
    """The pages that are open, as conditions for the next tracker update."""

    def __init__(self, open_pages: Iterable[Condition] = ()) -> None:
        self._held = {c.fingerprint: c for c in open_pages}

    @classmethod
    def restore(cls, alerts: Iterable[AlertView]) -> RemediationPages:
        """Pages firing when the agent stopped stay open until the remediator ends them."""
        return cls(
            Condition(
                rule=a.rule,
                labels=a.labels,
                active=True,
                value=None,
                summary=dict(a.annotations).get("summary", a.rule),
                annotations=a.annotations,
            )
            for a in alerts
            if a.rule in PAGE_ALERTS and a.state in ("pending", "firing")
        )

    @staticmethod
    def owns(rule: str) -> bool:
        return rule in PAGE_ALERTS

    def conditions(self, events: Iterable[AlertEvent]) -> list[Condition]:
        """This tick's page conditions after `events`; a resolved page is said once."""
        for event in events:
            self._held[event.fingerprint] = _condition(event)
        out = list(self._held.values())
        for fingerprint, condition in list(self._held.items()):
            if condition.active is False:
                del self._held[fingerprint]
        return out


def _condition(event: AlertEvent) -> Condition:
    labels = dict(event.labels)
    annotations = dict(event.annotations)
    # The remediation's incident, so a receiver can join the page to what caused it.
    annotations.setdefault("source_incident_id", event.incident_id)
    return Condition(
        rule=labels.get("alertname", "KvpilotRemediation"),
        labels=event.labels,
        active=event.status == "firing",
        value=None,
        summary=annotations.get("summary", ""),
        annotations=labels_of(annotations),
    )
