"""The audit trail: one row for every decision the remediator takes, and its log line."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvpilot.agent.remediation.journal import RemediationJournal
from kvpilot.agent.remediation.trigger import Trigger
from kvpilot.agent.state.decision import Decision

if TYPE_CHECKING:
    from kvpilot.agent.state.store import Actor

log = logging.getLogger(__name__)


class AuditTrail:
    """Writes audit rows through the journal, stamped with the wall clock."""

    def __init__(self, journal: RemediationJournal, wall_clock: Callable[[], float]) -> None:
        self._journal = journal
        self._wall_clock = wall_clock

    def about(
        self,
        trigger: Trigger,
        remediation_id: int | None,
        action: str,
        decision: Decision | str,
        reason: str,
        details: dict[str, Any] | None = None,
    ) -> None:
        """A row about one trigger's remediation: its rule, alert and requester in details."""
        extra: dict[str, Any] = {"rule": trigger.rule, **(details or {})}
        if trigger.fingerprint is not None:
            extra["fingerprint"] = trigger.fingerprint
        if trigger.requested_by is not None:
            extra["requested_by"] = trigger.requested_by
        if trigger.force:
            extra["force"] = True
        self.record(
            trigger.actor,
            action,
            trigger.instance,
            decision,
            reason,
            incident_id=trigger.incident_id,
            remediation_id=remediation_id,
            details=extra,
        )

    def record(
        self,
        actor: Actor,
        action: str,
        target: str,
        decision: Decision | str,
        reason: str,
        *,
        incident_id: str | None = None,
        remediation_id: int | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        """Any row: the breaker's, a veto's, reconcile's."""
        self._journal.record_audit(
            wall_s=self._wall_clock(),
            actor=actor,
            action=action,
            target=target,
            decision=decision,
            reason=reason,
            incident_id=incident_id,
            remediation_id=remediation_id,
            details=details,
        )
        log.info(
            "remediation %s %s on %s: %s",
            action,
            decision,
            target,
            reason,
            extra={"incident_id": incident_id, "action_id": remediation_id},
        )
