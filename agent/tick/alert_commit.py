"""The tick's commit step: the alert tracker advances, and its transitions, the alert rows and
the notifications go to the state store and the outbox in one transaction, before anything
acts. When it cannot commit (a full disk) the tracker goes back to where it was, nothing acts,
and the next tick decides again: what memory holds as sent is what the disk holds."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Mapping, Sequence

from kvpilot.agent.alert_values import AlertTransition, AlertView, Silence
from kvpilot.agent.alerts import AlertTracker
from kvpilot.agent.config import NotifierConfig
from kvpilot.agent.model import AlertEvent, Condition
from kvpilot.agent.rules.config import RulesConfig
from kvpilot.agent.state import StateStore
from kvpilot.agent.state.write_failures import WriteFailures
from kvpilot.agent.tick.external_labels import outgoing
from kvpilot.agent.tick.pages import RemediationPages
from kvpilot.agent.tick.settings import TickSettings

log = logging.getLogger(__name__)

DEFAULT_REPEAT_S = 4 * 3600.0


class AlertCommit:
    """The alert tracker, the remediation pages it carries, and the commit of each tick."""

    def __init__(
        self,
        settings: TickSettings,
        store: StateStore,
        *,
        wall_clock: Callable[[], float],
        write_failures: WriteFailures,
    ) -> None:
        self._store = store
        self._wall_clock = wall_clock
        self._external_labels = settings.rules.external_labels
        self._notifiers = {n.name: n for n in settings.notifiers}
        self.write_failures = write_failures
        self.tracker = self._restore_tracker(settings)
        self._pages = RemediationPages.restore(self.tracker.alerts())
        self._unsaved_events: list[AlertEvent] = []  # pages of a tick whose commit failed
        # When each notifier last got each firing alert, on the monotonic clock (a step of
        # the wall clock back must not hold a re-push: Alertmanager would resolve the alert):
        # kept while the alert fires, so bounded by the tracker's live alerts times notifiers.
        self._last_repeat_s: dict[tuple[str, str], float] = {}

    def _restore_tracker(self, settings: TickSettings) -> AlertTracker:
        return AlertTracker.from_rows(
            self._store.load_alerts(),
            silences=self._store.load_silences(self._wall_clock()),
            repeat_interval_s=_repeat_s(settings.notifiers),
            generator_url=settings.alerts_url,
        )

    def alerts(self) -> list[AlertView]:
        return self.tracker.alerts()

    def silence(
        self,
        matchers: Mapping[str, str],
        duration_s: float,
        *,
        comment: str,
        requested_by: str | None,
    ) -> Silence:
        """Notifications of matching alerts held for `duration_s`: saved and audited at once."""
        now = self._wall_clock()
        made = self.tracker.silence(matchers, now + duration_s, comment=comment)
        with self._store.transaction():
            self._store.save_silences(self.tracker.silences())
            self._store.record_audit(
                wall_s=now,
                actor="api",
                action="silence",
                target=str(dict(matchers)),
                decision="created",
                reason=comment or "silenced through the API",
                details={
                    "silence_id": made.silence_id,
                    "until_wall_s": made.until_wall_s,
                    "requested_by": requested_by,
                },
            )
        return made

    def silences(self) -> list[Silence]:
        """The silences in force, the soonest to end first."""
        now = self._wall_clock()
        held = [s for s in self.tracker.silences() if s.until_wall_s > now]
        return sorted(held, key=lambda s: (s.until_wall_s, s.silence_id))

    def expire_silence(self, silence_id: str, *, requested_by: str | None) -> bool:
        """End a silence now, saved and audited; False when none in force has that id."""
        if silence_id not in {s.silence_id for s in self.silences()}:
            return False
        self.tracker.expire_silence(silence_id)
        with self._store.transaction():
            self._store.save_silences(self.tracker.silences())
            self._store.record_audit(
                wall_s=self._wall_clock(),
                actor="api",
                action="silence",
                target=silence_id,
                decision="expired",
                reason="expired through the API",
                details={"silence_id": silence_id, "requested_by": requested_by},
            )
        return True

    def use_notifiers(self, configs: Sequence[NotifierConfig]) -> None:
        self._notifiers = {n.name: n for n in configs}
        self.tracker.repeat_interval_s = _repeat_s(configs)

    def use_rules(self, rules: RulesConfig) -> None:
        """A reloaded configuration's labels that leave (the rules' hold times come on
        their conditions)."""
        self._external_labels = rules.external_labels

    def advance(
        self,
        conditions: Sequence[Condition],
        pages: Sequence[AlertEvent],
        now_s: float,
        now_wall_s: float,
    ) -> list[AlertTransition]:
        """The tracker over the rules' conditions and the pages raised since the last tick
        (remediation's, the re-tune watch's), committed; [] when the commit failed."""
        events = [*self._unsaved_events, *pages]
        before = self.tracker.checkpoint()
        transitions = self.tracker.update(
            [*conditions, *self._pages.conditions(events)], now_s, now_wall_s
        )
        if self._commit(transitions, now_s, now_wall_s):
            self._unsaved_events = []
            return transitions
        self.tracker.rollback(before)  # memory follows the disk: the next tick decides again
        self._unsaved_events = events
        return []

    def of_rules(self, transitions: Sequence[AlertTransition]) -> list[AlertTransition]:
        """The transitions of rule alerts: the pages are remediation's own, not to act on."""
        return [t for t in transitions if not self._pages.owns(t.rule)]

    def _commit(self, transitions: list[AlertTransition], now_s: float, now_wall_s: float) -> bool:
        """Transitions, outbox rows and alert states in one transaction. Memory takes its
        share (repeat marks, log lines) only once it committed: False when it did not (a full
        disk, a read-only file), said by `write_failures` and retried by the next tick."""
        sent: dict[tuple[str, str], float] = {}
        try:
            with self._store.transaction():
                for transition in transitions:
                    self._record(transition, now_s, now_wall_s, sent)
                self._store.save_alerts(self.tracker.to_rows())
        except sqlite3.Error as exc:
            self.write_failures.failed(exc, "the alert changes of a tick", now_s)
            return False
        self.write_failures.succeeded(now_s)
        self._last_repeat_s.update(sent)
        self._forget_marks(transitions)
        for transition in transitions:
            _log_transition(transition)
        return True

    def repeat_marks(self) -> int:
        """How many (notifier, alert) repeat marks are held."""
        return len(self._last_repeat_s)

    def _forget_marks(self, transitions: Sequence[AlertTransition]) -> None:
        """An alert that stopped firing starts its next firing afresh: its marks go."""
        ended = {t.fingerprint for t in transitions if t.to_state in ("resolved", "inactive")}
        if ended:
            marks = self._last_repeat_s
            self._last_repeat_s = {k: v for k, v in marks.items() if k[1] not in ended}

    def _record(
        self,
        transition: AlertTransition,
        now_s: float,
        now_wall_s: float,
        sent: dict[tuple[str, str], float],
    ) -> None:
        labels = dict(transition.labels)
        if _audited(transition):
            self._store.record_audit(
                wall_s=now_wall_s,
                actor="rule",
                action="alert",
                target=labels.get("instance", ""),
                decision=transition.to_state,
                reason=transition.reason or labels.get("alertname", transition.rule),
                incident_id=transition.incident_id,
                details={"fingerprint": transition.fingerprint, "labels": labels},
            )
        if transition.event is not None and not transition.silenced:
            self._enqueue_all(transition.event, now_s, now_wall_s, sent, repeat=transition.repeat)

    def _enqueue_all(
        self,
        event: AlertEvent,
        now_s: float,
        now_wall_s: float,
        sent: dict[tuple[str, str], float],
        *,
        repeat: bool,
    ) -> None:
        """Outbox rows for the notifiers that want `event`; `sent` collects the repeat marks
        (monotonic) that hold once the transaction commits. What leaves carries the replica's
        labels; the rows keep the wall time, for people."""
        leaving = outgoing(event, self._external_labels)
        for name, cfg in self._notifiers.items():
            if not self._wants(cfg, event, now_s, repeat=repeat):
                continue
            self._store.outbox.enqueue(name, leaving, now_wall_s)
            sent[(name, event.fingerprint)] = now_s

    def _wants(self, cfg: NotifierConfig, event: AlertEvent, now_s: float, *, repeat: bool) -> bool:
        if event.status == "resolved":
            return cfg.send_resolved
        if not repeat:
            return True
        # The tracker repeats at the shortest interval; each notifier keeps its own.
        last = self._last_repeat_s.get((cfg.name, event.fingerprint))
        return last is None or now_s - last >= cfg.repeat_interval_s


def _repeat_s(notifiers: Sequence[NotifierConfig]) -> float:
    return min((n.repeat_interval_s for n in notifiers), default=DEFAULT_REPEAT_S)


def _audited(transition: AlertTransition) -> bool:
    """A firing or resolved alert (not a repeat) goes into the audit log and the agent's log."""
    return transition.to_state in ("firing", "resolved") and not transition.repeat


def _log_transition(transition: AlertTransition) -> None:
    if not _audited(transition):
        return
    labels = dict(transition.labels)
    ids = {"incident_id": transition.incident_id, "fingerprint": transition.fingerprint}
    log.info(
        "alert %s %s on %s",
        labels.get("alertname"),
        transition.to_state,
        labels.get("instance"),
        extra=ids,
    )
