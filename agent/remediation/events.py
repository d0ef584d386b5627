"""The remediation layer's own notifications: the circuit-breaker page and tuning advice.

They are `AlertEvent`s like any rule's, so the notifiers deliver them unchanged; each has a
stable fingerprint from its labels and a resolved event that ends it. `Notices` holds them
until the agent takes them, and remembers the open ones so that they can be resolved.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Sequence
from dataclasses import replace

from kvpilot.agent.model import AlertEvent, Labels, fingerprint, labels_of
from kvpilot.collectors.secrets import mask_argv

CIRCUIT_OPEN_ALERT = "KvpilotRemediationCircuitOpen"
TUNING_RECOMMENDED_ALERT = "KvpilotTuningRecommended"


def circuit_open_event(
    instance: str, role: str, failures: int, reason: str, *, incident_id: str, wall_s: float
) -> AlertEvent:
    """The page: restarts stopped helping on `instance`; a human has to look."""
    labels = labels_of(
        {
            "alertname": CIRCUIT_OPEN_ALERT,
            "instance": instance,
            "role": role,
            "severity": "critical",
        }
    )
    summary = f"kvpilot stopped restarting {instance}: {failures} restarts did not help"
    return AlertEvent(
        fingerprint=fingerprint(labels),
        incident_id=incident_id,
        status="firing",
        labels=labels,
        annotations=labels_of(
            {
                "summary": summary,
                "description": f"{summary}. Last failure: {reason}. Restarts stay blocked "
                "until an operator resets the circuit breaker through the API.",
            }
        ),
        starts_at_wall_s=wall_s,
        ends_at_wall_s=None,
        generator_url="",
    )


def tuning_recommended_event(
    instance: str,
    rule: str,
    reason: str,
    source: Labels,
    *,
    incident_id: str,
    wall_s: float,
    flags: Sequence[str] | None = None,
) -> AlertEvent:
    """Advice: the alert calls for different flags, not a restart with the same ones; with
    `flags`, the tuner's validated configuration to restart with (secrets masked)."""
    labels = labels_of(
        {
            "alertname": TUNING_RECOMMENDED_ALERT,
            "instance": instance,
            "rule": rule,
            "severity": "info",
        }
    )
    summary = f"{rule} on {instance}: run the tuner"
    notes = {"source_alert": dict(source).get("alertname", rule)}
    if flags is not None:
        summary = f"{rule} on {instance}: restart it with the tuner's validated flags"
        notes["recommended_flags"] = shlex.join(mask_argv(flags))
    return AlertEvent(
        fingerprint=fingerprint(labels),
        incident_id=incident_id,
        status="firing",
        labels=labels,
        annotations=labels_of(
            {
                "summary": summary,
                "description": f"{summary}. {reason}",
                **notes,
            }
        ),
        starts_at_wall_s=wall_s,
        ends_at_wall_s=None,
        generator_url="",
    )


def resolved(event: AlertEvent, wall_s: float) -> AlertEvent:
    """The event that ends `event`'s episode."""
    return replace(event, status="resolved", ends_at_wall_s=wall_s)


class Notices:
    """Pages and advice waiting for the agent to enqueue, and those still open."""

    def __init__(self) -> None:
        self._waiting: list[AlertEvent] = []
        self._pages: dict[str, AlertEvent] = {}  # open circuit pages, by instance
        self._advice: dict[str, AlertEvent] = {}  # open advice, by its source alert's fingerprint

    def take(self) -> list[AlertEvent]:
        """What was produced since the last call."""
        events, self._waiting = self._waiting, []
        return events

    def advise(self, event: AlertEvent, source_fingerprint: str | None) -> None:
        """Sends tuning advice; it resolves with its source alert, when that has one."""
        self._waiting.append(event)
        if source_fingerprint is not None:
            self._advice[source_fingerprint] = event

    def sources_resolved(self, fingerprints: Iterable[str], wall_s: float) -> None:
        """These alerts resolved: so does the advice they caused."""
        for fp in fingerprints:
            advice = self._advice.pop(fp, None)
            if advice is not None:
                self._waiting.append(resolved(advice, wall_s))

    def open_page(self, instance: str, page: AlertEvent) -> None:
        self._pages[instance] = page
        self._waiting.append(page)

    def close_page(self, instance: str, wall_s: float) -> AlertEvent | None:
        """Resolves the instance's page; the page, or None when there was none."""
        page = self._pages.pop(instance, None)
        if page is not None:
            self._waiting.append(resolved(page, wall_s))
        return page

    def restore_page(self, instance: str, page: AlertEvent) -> None:
        """A page an earlier kvpilot sent: open again, not sent again."""
        self._pages[instance] = page

    def page(self, instance: str) -> AlertEvent | None:
        return self._pages.get(instance)

    def paged_instances(self) -> frozenset[str]:
        return frozenset(self._pages)
