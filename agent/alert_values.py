"""What the alert tracker hands out and persists: transitions, stored rows, silences, views."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.agent.model import AlertEvent, AlertState, Labels


@dataclass(frozen=True, slots=True)
class AlertTransition:
    """One change of one alert at one tick, or a repeat while firing (`repeat`).

    `event` is the notification to send; None when the change is not notification-worthy
    (pending, back to inactive) or a silence holds it (`silenced`).
    """

    fingerprint: str
    rule: str
    labels: Labels
    from_state: AlertState
    to_state: AlertState
    at_wall_s: float
    incident_id: str | None
    event: AlertEvent | None
    silenced: bool = False
    repeat: bool = False
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class StoredAlert:
    """One alert's persisted state; every stamp is wall time (seconds since the epoch)."""

    fingerprint: str
    rule: str
    labels: Labels
    annotations: Labels
    state: AlertState
    active_since_wall_s: float | None
    fired_at_wall_s: float | None
    incident_id: str | None
    last_sent_wall_s: float | None
    last_seen_wall_s: float
    resolved_at_wall_s: float | None


@dataclass(frozen=True, slots=True)
class Silence:
    """Suppresses notifications of alerts whose labels include every matcher, until a time."""

    silence_id: str
    matchers: Labels
    until_wall_s: float
    comment: str = ""

    def matches(self, labels: Labels) -> bool:
        have = dict(labels)
        return all(have.get(name) == value for name, value in self.matchers)


@dataclass(frozen=True, slots=True)
class AlertView:
    """What the status API shows of one alert."""

    fingerprint: str
    rule: str
    labels: Labels
    annotations: Labels
    state: AlertState
    active: bool | None
    value: float | None
    reason: str | None
    active_since_wall_s: float | None
    incident_id: str | None
