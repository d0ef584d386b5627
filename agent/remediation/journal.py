"""Where remediations and decisions are written: the protocol, and an in-memory journal.

The protocol's calls are those of the agent's SQLite store (`StateStore`), so the store is a
journal as it is. Every state transition is written before the step it announces starts;
after a crash, the records left unfinished say how far each remediation got.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from kvpilot.agent.remediation.decision import Decision, read_decision

RemediationState = Literal[
    "planned", "draining", "restarting", "verifying", "succeeded", "failed", "vetoed", "skipped"
]
FINISHED_STATES = frozenset({"succeeded", "failed", "vetoed", "skipped"})
# States from which the server may already have been stopped.
RESTART_STATES = frozenset({"draining", "restarting", "verifying"})
Actor = Literal["rule", "api", "user", "agent"]


class RemediationRecordLike(Protocol):
    """What the remediator reads back of one remediation."""

    @property
    def id(self) -> int: ...
    @property
    def incident_id(self) -> str | None: ...
    @property
    def fingerprint(self) -> str | None: ...
    @property
    def instance(self) -> str: ...
    @property
    def action(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def started_wall_s(self) -> float: ...
    @property
    def finished_wall_s(self) -> float | None: ...
    @property
    def old_pid(self) -> int | None: ...
    @property
    def new_pid(self) -> int | None: ...


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
    ) -> Sequence[RemediationRecordLike]: ...

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

    def get_fact(self, key: str) -> Any | None: ...

    def set_fact(self, key: str, value: Any, now_wall_s: float) -> None: ...


def unfinished(journal: RemediationJournal) -> list[RemediationRecordLike]:
    """Remediations a previous run left in a non-final state, oldest first."""
    records = journal.remediations(unfinished_only=True, limit=10_000)
    return sorted(records, key=lambda r: (r.started_wall_s, r.id))


@dataclass(frozen=True, slots=True)
class JournalRecord:
    """One remediation as the in-memory journal keeps it."""

    id: int
    incident_id: str | None
    fingerprint: str | None
    instance: str
    action: str
    state: RemediationState
    reason: str
    started_wall_s: float
    finished_wall_s: float | None
    old_pid: int | None
    new_pid: int | None


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One audited decision as the in-memory journal keeps it."""

    id: int
    wall_s: float
    actor: Actor
    action: str
    target: str
    decision: Decision | str
    reason: str
    incident_id: str | None
    remediation_id: int | None
    details: Mapping[str, Any] = field(default_factory=dict)


class MemoryJournal:
    """A journal in memory, for tests and for running without a state directory.

    `states` keeps every state each remediation went through, in order, so tests can check
    that a transition was written before the next step.
    """

    def __init__(self) -> None:
        self.records: dict[int, JournalRecord] = {}
        self.states: dict[int, list[RemediationState]] = {}
        self.audit: list[AuditEntry] = []
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
        remediation_id = len(self.records) + 1
        finished = started_wall_s if state in FINISHED_STATES else None
        self.records[remediation_id] = JournalRecord(
            remediation_id,
            incident_id,
            fingerprint,
            instance,
            action,
            state,
            reason,
            started_wall_s,
            finished,
            old_pid,
            None,
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
        record = self.records[remediation_id]
        self.records[remediation_id] = replace(
            record,
            state=state,
            reason=record.reason if reason is None else reason,
            finished_wall_s=now_wall_s if state in FINISHED_STATES else record.finished_wall_s,
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
    ) -> list[JournalRecord]:
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
        entry = AuditEntry(
            len(self.audit) + 1,
            wall_s,
            actor,
            action,
            target,
            read_decision(decision),  # as the SQLite store reads it back
            reason,
            incident_id,
            remediation_id,
            dict(details or {}),
        )
        self.audit.append(entry)
        return entry.id

    def get_fact(self, key: str) -> Any | None:
        text = self.facts.get(key)
        return None if text is None else json.loads(text)

    def set_fact(self, key: str, value: Any, now_wall_s: float) -> None:
        # Stored as JSON, as the SQLite store does, so values round-trip the same way.
        self.facts[key] = json.dumps(value, sort_keys=True)
