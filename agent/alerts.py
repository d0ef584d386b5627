"""The alert lifecycle with Prometheus semantics: inactive, pending, firing, resolved.

`AlertTracker.update` takes every condition of one tick (all instances, all rules) and
returns the transitions, each with the notification to send, if any:

* active: inactive or resolved -> pending, or straight to firing when the condition's
  `for_s` (its rule's, carried on every condition) is 0; pending -> firing once active for
  `for_s` without a break. A reloaded rule's new `for_s` holds from its next condition:
  a pending alert keeps its start.
* inactive: pending -> inactive (the `for` clock starts over next time); firing -> resolved.
* unknown (`active=None`): the state holds; pending does not advance, firing does not
  resolve (repeats go on).
* absent (no condition for a tracked alert): held like unknown for `gone_grace_s`, then a
  firing alert resolves with the `resolved_reason` annotation saying its target is gone.

A firing episode has one `incident_id`; its firing event repeats every `repeat_interval_s`
with the same `starts_at_wall_s`, and its resolved event ends it. Silences suppress
notifications, never state; a resolved event is sent whenever the incident's firing was.

Durations use the monotonic `now_s`; what is persisted is wall time (`to_rows`), converted
back on the first update after `from_rows`. Not thread-safe: the tick owns it.
"""

from __future__ import annotations

import copy
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kvpilot.agent.alert_limit import (
    DEFAULT_MAX_ALERTS,
    EVICTED_REASON,
    LIMIT_RULE,
    Tracked,
    admit,
    limit_condition,
)
from kvpilot.agent.alert_values import AlertTransition, AlertView, Silence, StoredAlert
from kvpilot.agent.model import AlertEvent, AlertState, Condition, Labels, labels_of

TARGET_GONE = "target gone: no condition reported for {grace:g} s"


def new_incident_id() -> str:
    """A fresh short id for one firing episode."""
    return secrets.token_hex(6)


@dataclass(slots=True)
class _Alert:
    """The tracker's mutable record of one alert; monotonic stamps are None until restored."""

    fingerprint: str
    rule: str
    labels: Labels
    annotations: Labels
    state: AlertState
    last_seen_s: float | None
    last_seen_wall_s: float
    active_since_s: float | None = None
    active_since_wall_s: float | None = None
    fired_at_wall_s: float | None = None
    incident_id: str | None = None
    last_sent_s: float | None = None
    last_sent_wall_s: float | None = None
    resolved_at_s: float | None = None
    resolved_at_wall_s: float | None = None
    active: bool | None = None
    value: float | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """The tracker's state at one moment (see `AlertTracker.checkpoint`)."""

    alerts: Mapping[str, _Alert]
    silences: Mapping[str, Silence]
    needs_restore: bool


class AlertTracker:
    """Alert states keyed by fingerprint; `update` once per tick with all its conditions."""

    def __init__(
        self,
        *,
        repeat_interval_s: float = 4 * 3600.0,
        resolved_retention_s: float = 900.0,
        gone_grace_s: float = 300.0,
        generator_url: str = "",
        new_id: Callable[[], str] = new_incident_id,
        max_alerts: int = DEFAULT_MAX_ALERTS,
    ) -> None:
        if repeat_interval_s <= 0:
            raise ValueError("repeat_interval_s must be positive")
        if max_alerts < 1:
            raise ValueError(f"max_alerts must be at least 1, got {max_alerts}")
        self.repeat_interval_s = repeat_interval_s
        self.resolved_retention_s = resolved_retention_s
        self.gone_grace_s = gone_grace_s
        self.generator_url = generator_url
        self._new_id = new_id
        self.max_alerts = max_alerts  # pending, firing or resolved at once (`alert_limit`)
        self._alerts: dict[str, _Alert] = {}
        self._silences: dict[str, Silence] = {}
        self._needs_restore = False

    # -- persistence -------------------------------------------------------------------

    @classmethod
    def from_rows(
        cls,
        rows: Iterable[StoredAlert],
        *,
        silences: Iterable[Silence] = (),
        **kwargs: object,
    ) -> AlertTracker:
        """A tracker holding persisted states; monotonic stamps are set on the first update."""
        tracker = cls(**kwargs)  # type: ignore[arg-type]  # __init__'s keywords
        for row in rows:
            tracker._alerts[row.fingerprint] = _Alert(
                fingerprint=row.fingerprint,
                rule=row.rule,
                labels=row.labels,
                annotations=row.annotations,
                state=row.state,
                last_seen_s=None,
                last_seen_wall_s=row.last_seen_wall_s,
                active_since_wall_s=row.active_since_wall_s,
                fired_at_wall_s=row.fired_at_wall_s,
                incident_id=row.incident_id,
                last_sent_wall_s=row.last_sent_wall_s,
                resolved_at_wall_s=row.resolved_at_wall_s,
            )
        for silence in silences:
            tracker._silences[silence.silence_id] = silence
        tracker._needs_restore = True
        return tracker

    def to_rows(self) -> list[StoredAlert]:
        """Every pending, firing and resolved alert (inactive ones carry no memory)."""
        return [
            StoredAlert(
                fingerprint=a.fingerprint,
                rule=a.rule,
                labels=a.labels,
                annotations=a.annotations,
                state=a.state,
                active_since_wall_s=a.active_since_wall_s,
                fired_at_wall_s=a.fired_at_wall_s,
                incident_id=a.incident_id,
                last_sent_wall_s=a.last_sent_wall_s,
                last_seen_wall_s=a.last_seen_wall_s,
                resolved_at_wall_s=a.resolved_at_wall_s,
            )
            for a in self._alerts.values()
            if a.state != "inactive"
        ]

    def _restore(self, now_s: float, now_wall_s: float) -> None:
        """Monotonic stamps from the persisted wall ones, with this tick's clock offset."""

        def mono(wall_s: float | None) -> float | None:
            return None if wall_s is None else now_s - (now_wall_s - wall_s)

        for a in self._alerts.values():
            a.active_since_s = mono(a.active_since_wall_s)
            a.last_sent_s = mono(a.last_sent_wall_s)
            a.resolved_at_s = mono(a.resolved_at_wall_s)
            a.last_seen_s = mono(a.last_seen_wall_s)
        self._needs_restore = False

    def checkpoint(self) -> Checkpoint:
        """The whole state, for `rollback` when what one `update` decided was not persisted.
        A copy of each alert record is enough: their fields are immutable values."""
        alerts = {fp: copy.copy(alert) for fp, alert in self._alerts.items()}
        return Checkpoint(alerts, dict(self._silences), self._needs_restore)

    def rollback(self, checkpoint: Checkpoint) -> None:
        """Back to `checkpoint`: whatever was marked sent since is decided and sent again."""
        self._alerts = dict(checkpoint.alerts)
        self._silences = dict(checkpoint.silences)
        self._needs_restore = checkpoint.needs_restore

    # -- silences ----------------------------------------------------------------------

    def silence(
        self, matchers: Mapping[str, str], until_wall_s: float, *, comment: str = ""
    ) -> Silence:
        """Suppress notifications of matching alerts until `until_wall_s`."""
        if not matchers:
            raise ValueError("a silence needs at least one matcher")
        silence = Silence(new_incident_id(), labels_of(matchers), until_wall_s, comment)
        self._silences[silence.silence_id] = silence
        return silence

    def expire_silence(self, silence_id: str) -> bool:
        """End a silence now; False when there is no such silence."""
        return self._silences.pop(silence_id, None) is not None

    def silences(self) -> list[Silence]:
        return list(self._silences.values())

    def _silenced(self, labels: Labels, now_wall_s: float) -> bool:
        for silence_id, silence in list(self._silences.items()):
            if silence.until_wall_s <= now_wall_s:
                del self._silences[silence_id]
            elif silence.matches(labels):
                return True
        return False

    # -- the lifecycle -----------------------------------------------------------------

    def alerts(self) -> list[AlertView]:
        """Every alert the tracker holds, for the status API."""
        return [
            AlertView(
                fingerprint=a.fingerprint,
                rule=a.rule,
                labels=a.labels,
                annotations=a.annotations,
                state=a.state,
                active=a.active,
                value=a.value,
                reason=a.reason,
                active_since_wall_s=a.active_since_wall_s,
                incident_id=a.incident_id,
            )
            for a in self._alerts.values()
        ]

    def update(
        self, conditions: Iterable[Condition], now_s: float, now_wall_s: float
    ) -> list[AlertTransition]:
        """Advance every alert by one tick; `conditions` is everything evaluated this tick.
        New alerts past `max_alerts` are held back (not tracked) and said by one alert; a new
        critical one takes the place of a resolved or less severe one instead."""
        if self._needs_restore:
            self._restore(now_s, now_wall_s)
        given: dict[str, Condition] = {}
        for condition in conditions:
            given.setdefault(condition.fingerprint, condition)  # one per alert: the first wins
        admission = admit(list(given.values()), self._tracked(), self._starts, self.max_alerts)
        allowed = admission.allowed
        held_back = 0
        out: list[AlertTransition] = []
        for fp in admission.evicted:
            out.extend(self._evict(self._alerts[fp], now_s, now_wall_s))
        for condition in given.values():
            if (
                allowed is not None
                and condition.fingerprint not in allowed
                and self._starts(condition)
            ):
                held_back += 1
                self._alerts.pop(condition.fingerprint, None)  # inactive: it carried nothing
                continue
            out.extend(self._observe(condition, now_s, now_wall_s))
        limit = limit_condition(held_back, self.max_alerts)
        if held_back or limit.fingerprint in self._alerts:
            given[limit.fingerprint] = limit
            out.extend(self._observe(limit, now_s, now_wall_s))
        for fp in [fp for fp in self._alerts if fp not in given]:
            out.extend(self._absent(self._alerts[fp], now_s, now_wall_s))
        return out

    def _tracked(self) -> list[Tracked]:
        """The alerts that hold a place under `max_alerts` (the limit's own does not)."""
        return [
            Tracked(
                a.fingerprint,
                a.state,
                a.labels,
                (a.resolved_at_s if a.state == "resolved" else a.active_since_s) or 0.0,
            )
            for a in self._alerts.values()
            if a.state != "inactive" and a.rule != LIMIT_RULE
        ]

    def _evict(self, a: _Alert, now_s: float, now_wall_s: float) -> list[AlertTransition]:
        """A critical alert takes `a`'s place: `a` leaves the tracker (its condition, still
        active, is then held back). A firing one is resolved as it goes, saying why, so the
        receivers that saw it firing see it end."""
        del self._alerts[a.fingerprint]
        reason = EVICTED_REASON.format(max_alerts=self.max_alerts)
        if a.state == "firing":
            a.annotations = labels_of({**dict(a.annotations), "resolved_reason": reason})
            return self._resolve(a, now_s, now_wall_s, reason=reason)
        if a.state == "pending":
            a.state = "inactive"
            return [self._transition(a, "pending", None, now_wall_s, reason=reason)]
        return []  # resolved: its end already went out

    def _starts(self, condition: Condition) -> bool:
        """Whether the condition would start an alert (one not pending, firing or resolved)."""
        alert = self._alerts.get(condition.fingerprint)
        return condition.active is True and (alert is None or alert.state == "inactive")

    def _observe(
        self, condition: Condition, now_s: float, now_wall_s: float
    ) -> list[AlertTransition]:
        fp = condition.fingerprint
        alert = self._alerts.get(fp)
        if alert is None:
            alert = self._alerts[fp] = _Alert(
                fingerprint=fp,
                rule=condition.rule,
                labels=condition.labels,
                annotations=condition.annotations,
                state="inactive",
                last_seen_s=now_s,
                last_seen_wall_s=now_wall_s,
            )
        alert.last_seen_s, alert.last_seen_wall_s = now_s, now_wall_s
        alert.active, alert.value, alert.reason = (
            condition.active,
            condition.value,
            condition.reason,
        )
        alert.annotations = condition.annotations
        return self._step(alert, condition.active, condition.for_s, now_s, now_wall_s)

    def _step(
        self, a: _Alert, active: bool | None, for_s: float, now_s: float, now_wall_s: float
    ) -> list[AlertTransition]:
        if active is True:
            if a.state in ("inactive", "resolved"):
                previous = a.state
                a.state, a.active_since_s, a.active_since_wall_s = "pending", now_s, now_wall_s
                a.resolved_at_s = a.resolved_at_wall_s = None
                a.incident_id = a.fired_at_wall_s = None
                a.last_sent_s = a.last_sent_wall_s = None
                if for_s > 0:
                    return [self._transition(a, previous, None, now_wall_s)]
                return self._fire(a, previous, now_s, now_wall_s)
            if a.state == "pending":
                assert a.active_since_s is not None
                if now_s - a.active_since_s >= for_s:
                    return self._fire(a, "pending", now_s, now_wall_s)
                return []
            return self._repeat(a, now_s, now_wall_s)
        if active is False:
            if a.state == "pending":
                a.state, a.active_since_s, a.active_since_wall_s = "inactive", None, None
                return [self._transition(a, "pending", None, now_wall_s)]
            if a.state == "firing":
                return self._resolve(a, now_s, now_wall_s, reason=None)
            return self._expire_resolved(a, now_s)
        # Unknown: hold. A firing alert keeps its repeats; a resolved one still ages out.
        if a.state == "firing":
            return self._repeat(a, now_s, now_wall_s)
        if a.state == "resolved":
            return self._expire_resolved(a, now_s)
        return []

    def _absent(self, a: _Alert, now_s: float, now_wall_s: float) -> list[AlertTransition]:
        if a.state == "inactive":
            del self._alerts[a.fingerprint]
            return []
        if a.state == "resolved":
            return self._expire_resolved(a, now_s)
        assert a.last_seen_s is not None
        if now_s - a.last_seen_s < self.gone_grace_s:
            return self._repeat(a, now_s, now_wall_s) if a.state == "firing" else []
        reason = TARGET_GONE.format(grace=self.gone_grace_s)
        if a.state == "pending":
            del self._alerts[a.fingerprint]
            a.state = "inactive"
            return [self._transition(a, "pending", None, now_wall_s, reason=reason)]
        a.annotations = labels_of({**dict(a.annotations), "resolved_reason": reason})
        return self._resolve(a, now_s, now_wall_s, reason=reason)

    def _fire(
        self, a: _Alert, previous: AlertState, now_s: float, now_wall_s: float
    ) -> list[AlertTransition]:
        a.state, a.fired_at_wall_s, a.incident_id = "firing", now_wall_s, self._new_id()
        a.last_sent_s = a.last_sent_wall_s = None
        return [self._notify_firing(a, previous, now_s, now_wall_s, repeat=False)]

    def _repeat(self, a: _Alert, now_s: float, now_wall_s: float) -> list[AlertTransition]:
        """A firing event when none went out yet (silenced) or the repeat interval passed."""
        due = a.last_sent_s is None or now_s - a.last_sent_s >= self.repeat_interval_s
        if not due or self._silenced(a.labels, now_wall_s):
            return []
        repeat = a.last_sent_s is not None
        return [self._notify_firing(a, "firing", now_s, now_wall_s, repeat=repeat)]

    def _notify_firing(
        self, a: _Alert, previous: AlertState, now_s: float, now_wall_s: float, *, repeat: bool
    ) -> AlertTransition:
        silenced = self._silenced(a.labels, now_wall_s)
        event = None
        if not silenced:
            event = self._event(a, "firing", ends_at_wall_s=None)
            a.last_sent_s, a.last_sent_wall_s = now_s, now_wall_s
        return self._transition(a, previous, event, now_wall_s, silenced=silenced, repeat=repeat)

    def _resolve(
        self, a: _Alert, now_s: float, now_wall_s: float, *, reason: str | None
    ) -> list[AlertTransition]:
        a.state, a.resolved_at_s, a.resolved_at_wall_s = "resolved", now_s, now_wall_s
        # Receivers that saw the firing need its end, silence or not.
        event = (
            self._event(a, "resolved", ends_at_wall_s=now_wall_s)
            if a.last_sent_wall_s is not None
            else None
        )
        silenced = event is None and self._silenced(a.labels, now_wall_s)
        return [self._transition(a, "firing", event, now_wall_s, silenced=silenced, reason=reason)]

    def _expire_resolved(self, a: _Alert, now_s: float) -> list[AlertTransition]:
        if (
            a.state == "resolved"
            and a.resolved_at_s is not None
            and now_s - a.resolved_at_s >= self.resolved_retention_s
        ):
            del self._alerts[a.fingerprint]
        return []

    def _event(self, a: _Alert, status: str, *, ends_at_wall_s: float | None) -> AlertEvent:
        assert a.incident_id is not None and a.active_since_wall_s is not None
        return AlertEvent(
            fingerprint=a.fingerprint,
            incident_id=a.incident_id,
            status="firing" if status == "firing" else "resolved",
            labels=a.labels,
            annotations=a.annotations,
            starts_at_wall_s=a.active_since_wall_s,
            ends_at_wall_s=ends_at_wall_s,
            generator_url=self.generator_url,
        )

    def _transition(
        self,
        a: _Alert,
        previous: AlertState,
        event: AlertEvent | None,
        now_wall_s: float,
        *,
        silenced: bool = False,
        repeat: bool = False,
        reason: str | None = None,
    ) -> AlertTransition:
        return AlertTransition(
            fingerprint=a.fingerprint,
            rule=a.rule,
            labels=a.labels,
            from_state=previous,
            to_state=a.state,
            at_wall_s=now_wall_s,
            incident_id=a.incident_id,
            event=event,
            silenced=silenced,
            repeat=repeat,
            reason=reason,
        )
