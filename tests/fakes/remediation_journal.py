"""An in-memory remediation journal: the SQLite store's behaviour, and what tests look into.

It passes the same contract suite as `StateStore` (tests/agent/remediation/
test_journal_contract.py): the same record types, newest-first order, refusals, decisions
and details read back as the store reads them. `states` keeps every state each remediation
went through, in order, so tests can check that a transition was written before the next
step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, get_args

from kvpilot.agent.state.decision import Decision, read_decision
from kvpilot.agent.state.store import (
    FINISHED_REMEDIATION_STATES,
    Actor,
    AuditRecord,
    RemediationRecord,
    RemediationState,
)


class MemoryJournal:
    """A remediation journal in memory (`RemediationJournal`)."""

    def __init__(self) -> None:
        self.records: dict[int, RemediationRecord] = {}
        self.states: dict[int, list[RemediationState]] = {}
        self.audit: list[AuditRecord] = []  # in the order written
        self.facts: dict[str, str] = {}

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
    ) -> int:
        _check_state(state)
        remediation_id = len(self.records) + 1
        self.records[remediation_id] = RemediationRecord(
            id=remediation_id,
            incident_id=incident_id,
            fingerprint=fingerprint,
            instance=instance,
            action=action,
            state=state,
            reason=reason,
            started_wall_s=started_wall_s,
            finished_wall_s=started_wall_s if state in FINISHED_REMEDIATION_STATES else None,
            old_pid=old_pid,
            new_pid=None,
        )
        self.states[remediation_id] = [state]
        return remediation_id

    def update_remediation(
        self,
        remediation_id: int,
        *,
        state: RemediationState,
        reason: str | None = None,
        now_wall_s: float,
        new_pid: int | None = None,
    ) -> None:
        _check_state(state)
        if remediation_id not in self.records:
            raise KeyError(f"no remediation with id {remediation_id}")
        record = self.records[remediation_id]
        finishing = state in FINISHED_REMEDIATION_STATES
        self.records[remediation_id] = replace(
            record,
            state=state,
            reason=record.reason if reason is None else reason,
            finished_wall_s=now_wall_s if finishing else record.finished_wall_s,
            new_pid=record.new_pid if new_pid is None else new_pid,
        )
        self.states[remediation_id].append(state)

    def remediations(
        self,
        *,
        incident_id: str | None = None,
        instance: str | None = None,
        since_wall_s: float | None = None,
        unfinished_only: bool = False,
        limit: int = 100,
    ) -> list[RemediationRecord]:
        """Matching remediations, newest first (as the SQLite store orders them)."""
        found = [
            r
            for r in self.records.values()
            if (incident_id is None or r.incident_id == incident_id)
            and (instance is None or r.instance == instance)
            and (since_wall_s is None or r.started_wall_s >= since_wall_s)
            and (not unfinished_only or r.finished_wall_s is None)
        ]
        found.sort(key=lambda r: (r.started_wall_s, r.id), reverse=True)
        return found[:limit]

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
    ) -> int:
        if actor not in get_args(Actor):
            raise ValueError(f"actor must be one of {get_args(Actor)}, not {actor!r}")
        record = AuditRecord(
            id=len(self.audit) + 1,
            wall_s=wall_s,
            actor=actor,
            action=action,
            target=target,
            decision=read_decision(decision),  # as the SQLite store reads it back
            reason=reason,
            incident_id=incident_id,
            remediation_id=remediation_id,
            # Through JSON, as the store keeps them: tuples come back as lists.
            details=json.loads(json.dumps(dict(details or {}), sort_keys=True, default=str)),
        )
        self.audit.append(record)
        return record.id

    def audit_records(
        self, *, since_wall_s: float | None = None, limit: int = 100
    ) -> list[AuditRecord]:
        """Audit records, newest first."""
        found = [a for a in self.audit if since_wall_s is None or a.wall_s >= since_wall_s]
        found.sort(key=lambda a: (a.wall_s, a.id), reverse=True)
        return found[:limit]

    def get_fact(self, key: str) -> Any | None:
        text = self.facts.get(key)
        return None if text is None else json.loads(text)

    def set_fact(self, key: str, value: Any, now_wall_s: float) -> None:
        # Stored as JSON, as the SQLite store does, so values round-trip the same way.
        self.facts[key] = json.dumps(value, sort_keys=True)


def _check_state(state: str) -> None:
    if state not in get_args(RemediationState):
        raise ValueError(f"remediation state must be one of {get_args(RemediationState)}")
