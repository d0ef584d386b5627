"""The circuit breaker's books: failed restarts and recurrences, its page, its saved state.

A restart failed when the runtime raised, when the condition was still active at the end of
the verify window, or when the same alert fired again within `circuit_breaker.hold_s` of the
restart (a recurrence); a restart that held that long succeeded. The breaker opening pages
once; its closing resolves the page. Its state and page are saved to the journal at every
change, so a restart of kvpilot neither forgets an open breaker nor pages twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvpilot.agent.model import AlertEvent
from kvpilot.agent.remediation.audit import AuditTrail
from kvpilot.agent.remediation.events import Notices, circuit_open_event
from kvpilot.agent.remediation.guards import BreakerChange, CircuitBreaker
from kvpilot.agent.remediation.journal import RemediationJournal

BREAKER_FACT = "remediation.breaker.{instance}"


@dataclass(frozen=True, slots=True)
class _Recurrence:
    """A restart whose alert, firing again within the hold, counts as its failure."""

    instance: str
    restarted_at_s: float
    remediation_id: int


class BreakerBook:
    """Counts restarts' results into the breaker, pages on its changes, saves it."""

    def __init__(
        self,
        breaker: CircuitBreaker,
        *,
        hold_s: float,
        journal: RemediationJournal,
        audit: AuditTrail,
        notices: Notices,
        role_of: Callable[[str], str],
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        new_id: Callable[[], str],
    ) -> None:
        self.breaker = breaker
        self._hold_s = hold_s
        self._journal = journal
        self._audit = audit
        self._notices = notices
        self._role_of = role_of
        self._clock = clock
        self._wall_clock = wall_clock
        self._new_id = new_id
        self._recurrences: dict[str, _Recurrence] = {}  # by alert fingerprint

    # -- restarts ----------------------------------------------------------------------

    def attempt(self, instance: str, now_s: float) -> None:
        """A restart goes through (in half-open, the single trial)."""
        self.breaker.note_attempt(instance, now_s)
        self.save(instance, now_s)

    def failure(self, instance: str, now_s: float, reason: str) -> None:
        change = self.breaker.record_failure(instance, now_s, reason)
        self.save(instance, now_s)
        if change is not None:
            self._changed(change)

    def success(self, instance: str, now_s: float) -> None:
        change = self.breaker.record_success(instance, now_s)
        self.save(instance, now_s)
        if change is not None:
            self._changed(change)

    def reset(self, instance: str, *, requested_by: str, reason: str) -> bool:
        """An operator closes the breaker (the page resolves); False if it was closed."""
        now_s = self._clock()
        change = self.breaker.reset(instance, reason)
        self.save(instance, now_s)
        self._audit.record(
            "api",
            "circuit_breaker",
            instance,
            "reset" if change else "reset (was closed)",
            reason,
            details={"requested_by": requested_by},
        )
        if change is not None:
            self._changed(change)
        return change is not None

    # -- recurrences -------------------------------------------------------------------

    def watch_recurrence(
        self, fingerprint: str, instance: str, restarted_at_s: float, remediation_id: int
    ) -> None:
        """A restart cleared its alert: it succeeded once the hold passes without a firing."""
        self._recurrences[fingerprint] = _Recurrence(instance, restarted_at_s, remediation_id)

    def alert_fired(self, fingerprint: str, now_s: float) -> None:
        """An alert started firing: within the hold of its restart, that restart failed."""
        recurrence = self._recurrences.pop(fingerprint, None)
        if recurrence is None:
            return
        elapsed = now_s - recurrence.restarted_at_s
        if elapsed > self._hold_s:
            self.success(recurrence.instance, now_s)
            return
        reason = f"the alert fired again {elapsed:.0f} s after the restart"
        self._audit.record(
            "agent",
            "circuit_breaker",
            recurrence.instance,
            "failure counted",
            reason,
            remediation_id=recurrence.remediation_id,
        )
        self.failure(recurrence.instance, now_s, reason)

    def expire(self, now_s: float) -> None:
        """Restarts whose hold passed without their alert firing again succeeded."""
        for fp, recurrence in list(self._recurrences.items()):
            if now_s - recurrence.restarted_at_s > self._hold_s:
                del self._recurrences[fp]
                self.success(recurrence.instance, now_s)

    # -- the page and the journal ------------------------------------------------------

    def _changed(self, change: BreakerChange) -> None:
        wall_s = self._wall_clock()
        if change.to_state == "open":
            page = circuit_open_event(
                change.instance,
                self._role_of(change.instance),
                change.failures,
                change.reason,
                incident_id=self._new_id(),
                wall_s=wall_s,
            )
            self._notices.open_page(change.instance, page)
            self._audit.record(
                "agent",
                "circuit_breaker",
                change.instance,
                "opened: paged",
                change.reason,
                incident_id=page.incident_id,
                details={"failures": change.failures},
            )
        else:
            closed = self._notices.close_page(change.instance, wall_s)
            self._audit.record(
                "agent",
                "circuit_breaker",
                change.instance,
                "closed",
                change.reason,
                incident_id=None if closed is None else closed.incident_id,
            )
        self.save(change.instance, self._clock())

    def save(self, instance: str, now_s: float) -> None:
        """The breaker's state, and its open page, as a journal fact."""
        wall_s = self._wall_clock()
        fact = self.breaker.to_fact(instance, now_s, wall_s)
        page = self._notices.page(instance)
        if page is not None:
            fact["page"] = {
                "incident_id": page.incident_id,
                "starts_at_wall_s": page.starts_at_wall_s,
                "role": dict(page.labels).get("role", "stable"),
                "failures": self.breaker.failures(instance),
            }
        self._journal.set_fact(BREAKER_FACT.format(instance=instance), fact, wall_s)

    def restore(self, instances: Iterable[str], now_s: float, now_wall_s: float) -> None:
        """At start-up: the breakers an earlier kvpilot saved, and their open pages."""
        for name in instances:
            fact = self._journal.get_fact(BREAKER_FACT.format(instance=name))
            if not isinstance(fact, dict):
                continue
            self.breaker.restore(name, fact, now_s, now_wall_s)
            page = fact.get("page")
            if isinstance(page, dict) and self.breaker.state(name, now_s) != "closed":
                self._notices.restore_page(name, _page_from_fact(name, page))


def _page_from_fact(instance: str, page: dict[str, Any]) -> AlertEvent:
    return circuit_open_event(
        instance,
        str(page.get("role") or "stable"),
        int(page.get("failures") or 0),
        "restored after a restart of kvpilot",
        incident_id=str(page["incident_id"]),
        wall_s=float(page["starts_at_wall_s"]),
    )
