"""The remediation layer's own notifications: the circuit-breaker page and tuning advice.

They are `AlertEvent`s like any rule's, so the notifiers deliver them unchanged; each has a
stable fingerprint from its labels and a resolved event that ends it.
"""

from __future__ import annotations

from dataclasses import replace

from kvpilot.agent.model import AlertEvent, Labels, fingerprint, labels_of

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
    instance: str, rule: str, reason: str, source: Labels, *, incident_id: str, wall_s: float
) -> AlertEvent:
    """Advice: the alert calls for different flags, not a restart with the same ones."""
    labels = labels_of(
        {
            "alertname": TUNING_RECOMMENDED_ALERT,
            "instance": instance,
            "rule": rule,
            "severity": "info",
        }
    )
    summary = f"{rule} on {instance}: run the tuner"
    return AlertEvent(
        fingerprint=fingerprint(labels),
        incident_id=incident_id,
        status="firing",
        labels=labels,
        annotations=labels_of(
            {
                "summary": summary,
                "description": f"{summary}. {reason}",
                "source_alert": dict(source).get("alertname", rule),
            }
        ),
        starts_at_wall_s=wall_s,
        ends_at_wall_s=None,
        generator_url="",
    )


def resolved(event: AlertEvent, wall_s: float) -> AlertEvent:
    """The event that ends `event`'s episode."""
    return replace(event, status="resolved", ends_at_wall_s=wall_s)
