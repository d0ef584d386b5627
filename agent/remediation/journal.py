"""The remediation journal: the protocol the remediator writes through, and how records read.

The protocol's calls are those of the agent's SQLite store (`StateStore`), so the store is a
journal as it is. Every state transition is written before the step it announces starts;
after a crash, the records left unfinished say how far each remediation got, and their
reasons say whether the restart had begun.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    # Types only: the store imports this package's `Decision`, so the import runs one way.
    from kvpilot.agent.state.decision import Decision
    from kvpilot.agent.state.store import Actor, AuditRecord, RemediationRecord, RemediationState

# States from which the server may already have been stopped.
RESTART_STATES = frozenset({"draining", "restarting", "verifying"})

# Reason prefixes that say whether a failed remediation got as far as the restart.
RESTART_FAILED = "restart failed: "
VERIFY_FAILED = "verification failed: "
INTERRUPTED_AFTER_RESTART_BEGAN = "interrupted after the restart began: "
NOT_RESTARTED = "not restarted: "
_BEGAN_PREFIXES = (RESTART_FAILED, VERIFY_FAILED, INTERRUPTED_AFTER_RESTART_BEGAN)


class RemediationJournal(Protocol):
    """Remediation history, audit records and small facts (the breaker, vetoes)."""

    def start_remediation(
        self,
        *,
        instance: str,
        action: str,
        state: RemediationState,
        reason: str,
        started_wall_s: float,
        incident_id: str | None = None,
        fingerprint: str | None = None,
        old_pid: int | None = None,
    ) -> int: ...

    def update_remediation(
        self,
        remediation_id: int,
        *,
        state: RemediationState,
        reason: str | None = None,
        now_wall_s: float,
        new_pid: int | None = None,
    ) -> None: ...

    def remediations(
        self,
        *,
        incident_id: str | None = None,
        instance: str | None = None,
        since_wall_s: float | None = None,
        unfinished_only: bool = False,
        limit: int = 100,
    ) -> Sequence[RemediationRecord]:
        """Matching remediations, newest first."""
        ...

    def record_audit(
        self,
        *,
        wall_s: float,
        actor: Actor,
        action: str,
        target: str,
        decision: Decision | str,
        reason: str,
        incident_id: str | None = None,
        remediation_id: int | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> int: ...

    def audit_records(
        self, *, since_wall_s: float | None = None, limit: int = 100
    ) -> Sequence[AuditRecord]:
        """Audit records, newest first; the remediator's decisions read back as `Decision`."""
        ...

    def get_fact(self, key: str) -> Any | None: ...

    def set_fact(self, key: str, value: Any, now_wall_s: float) -> None: ...


def unfinished(journal: RemediationJournal) -> list[RemediationRecord]:
    """Remediations a previous run left in a non-final state, oldest first."""
    records = journal.remediations(unfinished_only=True, limit=10_000)
    return sorted(records, key=lambda r: (r.started_wall_s, r.id))


def restart_began(record: RemediationRecord) -> bool:
    """Whether this remediation may have stopped the server (so its incident is done)."""
    return (
        record.state in RESTART_STATES
        or record.new_pid is not None
        or record.reason.startswith(_BEGAN_PREFIXES)
    )
