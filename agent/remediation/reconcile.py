"""Start-up after a stop or a crash: fail what was left unfinished, restore the guards.

A record still in a restart state may have stopped its server, so its incident counts as
restarted (it is not restarted again) and its restart counts against the budget and the
cooldown. The breakers and the vetoes come back from the journal's facts.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.agent.remediation.audit import AuditTrail
from kvpilot.agent.remediation.guards import Cooldown, RestartBudget
from kvpilot.agent.remediation.journal import (
    INTERRUPTED_AFTER_RESTART_BEGAN,
    NOT_RESTARTED,
    RESTART_STATES,
    RemediationJournal,
    restart_began,
    unfinished,
)
from kvpilot.agent.state.decision import Decision


@dataclass(frozen=True, slots=True)
class Reconciled:
    """One record a previous run left unfinished, and what reconcile made of it."""

    remediation_id: int
    instance: str
    incident_id: str | None
    previous_state: str
    restart_may_have_happened: bool
    reason: str


def fail_unfinished(
    journal: RemediationJournal, audit: AuditTrail, now_wall_s: float
) -> list[Reconciled]:
    """Every record left unfinished ends failed, saying whether the restart had begun."""
    out = []
    for record in unfinished(journal):
        began = record.state in RESTART_STATES
        if began:
            reason = (
                f"{INTERRUPTED_AFTER_RESTART_BEGAN}kvpilot stopped while {record.state}; "
                "the server may have been restarted, so this incident is not restarted again"
            )
        else:
            reason = f"{NOT_RESTARTED}kvpilot stopped while {record.state}"
        journal.update_remediation(record.id, state="failed", reason=reason, now_wall_s=now_wall_s)
        audit.record(
            "agent",
            record.action,
            record.instance,
            Decision.INTERRUPTED,
            reason,
            incident_id=record.incident_id,
            remediation_id=record.id,
            details={"previous_state": record.state},
        )
        out.append(
            Reconciled(record.id, record.instance, record.incident_id, record.state, began, reason)
        )
    return out


def restore_restarts(
    journal: RemediationJournal,
    cooldown: Cooldown,
    budget: RestartBudget,
    *,
    now_s: float,
    now_wall_s: float,
) -> set[str]:
    """Restarts still inside the budget's window or the cooldown count again.

    Returns the instances the journal remembers in that time (their breakers are restored).
    """
    horizon_s = max(budget.window_s, cooldown.cooldown_s)
    history = journal.remediations(since_wall_s=now_wall_s - horizon_s, limit=10_000)
    for record in history:
        if restart_began(record):
            stamp_s = now_s - (now_wall_s - record.started_wall_s)  # wall time to monotonic
            budget.seed(record.instance, [stamp_s], now_s)
            cooldown.record(record.instance, stamp_s)
    return {record.instance for record in history}
