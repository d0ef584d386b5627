"""The agent's persistent state: alerts, remediations, audit, silences, small facts, retention.

Every method is one short transaction; wrap several in `transaction()` when they must commit
together (an alert transition with its outbox rows and audit record). Times are wall-clock
seconds passed in by the caller: the store never reads the clock. Thread safety: as
`Database` (the event-loop thread only).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, get_args

from kvpilot.agent.alert_values import Silence, StoredAlert
from kvpilot.agent.config import RetentionConfig
from kvpilot.agent.model import Labels
from kvpilot.agent.state.db import DEFAULT_BUSY_TIMEOUT_S, Database
from kvpilot.agent.state.decision import Decision, read_decision
from kvpilot.agent.state.lock import StateLock
from kvpilot.agent.state.outbox import SqliteOutbox
from kvpilot.collectors.secrets import mask, mask_text

RemediationState = Literal[
    "planned", "draining", "restarting", "verifying", "succeeded", "failed", "vetoed", "skipped"
]
FINISHED_REMEDIATION_STATES = frozenset({"succeeded", "failed", "vetoed", "skipped"})
Actor = Literal["rule", "api", "user", "agent"]
_DAY_S = 86400.0


@dataclass(frozen=True, slots=True)
class RemediationRecord:
    """One remediation attempt and where it got to, as every remediation journal reads it."""

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

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_REMEDIATION_STATES


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """One decision and why it was taken, as every remediation journal reads it."""

    id: int
    wall_s: float
    actor: Actor
    action: str
    target: str
    decision: Decision | str  # the remediator's are a Decision; other writers' free text
    reason: str
    incident_id: str | None
    remediation_id: int | None
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RetentionReport:
    """How many rows one retention pass deleted, per table."""

    outbox_rows: int
    audit_rows: int
    remediation_rows: int
    silence_rows: int


class StateStore:
    """Typed access to the state database (`StateStore.open(state_dir)`)."""

    def __init__(self, db: Database, *, lock: StateLock | None = None) -> None:
        self._db = db
        self._lock = lock  # the agent's hold on the directory, released by `close()`
        self.outbox = SqliteOutbox(db)

    @classmethod
    def open(cls, state_dir: Path, *, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S) -> StateStore:
        return cls(Database.open(state_dir, busy_timeout_s=busy_timeout_s))

    @property
    def db(self) -> Database:
        """The connection, for stores that live in the same file (the tuner's trials)."""
        return self._db

    @property
    def path(self) -> Path:
        return self._db.path

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Groups the calls inside into one atomic commit."""
        with self._db.transaction():
            yield

    def integrity_check(self) -> str:
        return self._db.integrity_check()

    def close(self) -> None:
        try:
            self._db.close()
        finally:
            if self._lock is not None:
                self._lock.release()

    def __enter__(self) -> StateStore:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # Alerts and silences: the tracker's whole state, replaced at once.

    def load_alerts(self) -> list[StoredAlert]:
        rows = self._db.read("SELECT * FROM alerts ORDER BY fingerprint")
        return [
            StoredAlert(
                fingerprint=r["fingerprint"],
                rule=r["rule"],
                labels=_labels(r["labels_json"]),
                annotations=_labels(r["annotations_json"]),
                state=r["state"],
                active_since_wall_s=r["active_since_wall_s"],
                fired_at_wall_s=r["fired_at_wall_s"],
                incident_id=r["incident_id"],
                last_sent_wall_s=r["last_sent_wall_s"],
                last_seen_wall_s=r["last_seen_wall_s"],
                resolved_at_wall_s=r["resolved_at_wall_s"],
            )
            for r in rows
        ]

    def save_alerts(self, alerts: Iterable[StoredAlert]) -> None:
        """Replaces the stored alert states with `alerts` (the tracker's `to_rows()`)."""
        with self._db.transaction() as conn:
            conn.execute("DELETE FROM alerts")
            conn.executemany(
                "INSERT INTO alerts (fingerprint, rule, labels_json, annotations_json, state, "
                "active_since_wall_s, fired_at_wall_s, incident_id, last_sent_wall_s, "
                "last_seen_wall_s, resolved_at_wall_s) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        a.fingerprint,
                        a.rule,
                        _labels_json(a.labels),
                        _labels_json(tuple((k, mask_text(v)) for k, v in a.annotations)),
                        a.state,
                        a.active_since_wall_s,
                        a.fired_at_wall_s,
                        a.incident_id,
                        a.last_sent_wall_s,
                        a.last_seen_wall_s,
                        a.resolved_at_wall_s,
                    )
                    for a in alerts
                ],
            )

    def load_silences(self, now_wall_s: float) -> list[Silence]:
        """Silences that have not ended by `now_wall_s`."""
        rows = self._db.read(
            "SELECT * FROM silences WHERE until_wall_s > ? ORDER BY until_wall_s, silence_id",
            (now_wall_s,),
        )
        return [
            Silence(
                silence_id=r["silence_id"],
                matchers=_labels(r["matchers_json"]),
                until_wall_s=r["until_wall_s"],
                comment=r["comment"],
            )
            for r in rows
        ]

    def save_silences(self, silences: Iterable[Silence]) -> None:
        """Replaces the stored silences with `silences` (the tracker's `silences()`)."""
        with self._db.transaction() as conn:
            conn.execute("DELETE FROM silences")
            conn.executemany(
                "INSERT INTO silences (silence_id, matchers_json, until_wall_s, comment) "
                "VALUES (?, ?, ?, ?)",
                [
                    (s.silence_id, _labels_json(s.matchers), s.until_wall_s, s.comment)
                    for s in silences
                ],
            )

    # Remediations: persisted before each step is taken.

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
        finished = started_wall_s if state in FINISHED_REMEDIATION_STATES else None
        with self._db.transaction() as conn:
            cursor = conn.execute(
                "INSERT INTO remediations (incident_id, fingerprint, instance, action, state, "
                "reason, started_wall_s, finished_wall_s, old_pid) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    incident_id,
                    fingerprint,
                    instance,
                    action,
                    state,
                    mask_text(reason),
                    started_wall_s,
                    finished,
                    old_pid,
                ),
            )
            return int(cursor.lastrowid or 0)

    def update_remediation(
        self,
        remediation_id: int,
        *,
        state: RemediationState,
        reason: str | None = None,
        now_wall_s: float,
        new_pid: int | None = None,
    ) -> None:
        """Moves a remediation on; a finishing state stamps `finished_wall_s` with `now_wall_s`."""
        _check_state(state)
        finished = now_wall_s if state in FINISHED_REMEDIATION_STATES else None
        with self._db.transaction() as conn:
            cursor = conn.execute(
                "UPDATE remediations SET state = ?, reason = coalesce(?, reason), "
                "finished_wall_s = coalesce(?, finished_wall_s), "
                "new_pid = coalesce(?, new_pid) WHERE id = ?",
                (state, reason and mask_text(reason), finished, new_pid, remediation_id),
            )
            if cursor.rowcount != 1:
                raise KeyError(f"no remediation with id {remediation_id}")

    def remediation(self, remediation_id: int) -> RemediationRecord | None:
        rows = self._db.read("SELECT * FROM remediations WHERE id = ?", (remediation_id,))
        return _remediation(rows[0]) if rows else None

    def remediations(
        self,
        *,
        incident_id: str | None = None,
        instance: str | None = None,
        since_wall_s: float | None = None,
        unfinished_only: bool = False,
        limit: int = 100,
    ) -> list[RemediationRecord]:
        """Matching remediations, newest first."""
        where = ["1 = 1"]
        params: list[str | float] = []
        if incident_id is not None:
            where.append("incident_id = ?")
            params.append(incident_id)
        if instance is not None:
            where.append("instance = ?")
            params.append(instance)
        if since_wall_s is not None:
            where.append("started_wall_s >= ?")
            params.append(since_wall_s)
        if unfinished_only:
            where.append("finished_wall_s IS NULL")
        rows = self._db.read(
            f"SELECT * FROM remediations WHERE {' AND '.join(where)} "  # noqa: S608 (fixed text)
            "ORDER BY started_wall_s DESC, id DESC LIMIT ?",
            (*params, limit),
        )
        return [_remediation(r) for r in rows]

    # Audit.

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
        with self._db.transaction() as conn:
            cursor = conn.execute(
                "INSERT INTO audit (wall_s, actor, action, target, decision, reason, "
                "incident_id, remediation_id, details_json) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    wall_s,
                    actor,
                    action,
                    mask_text(target),
                    decision,
                    mask_text(reason),
                    incident_id,
                    remediation_id,
                    json.dumps(mask(_plain(dict(details or {}))), sort_keys=True),
                ),
            )
            return int(cursor.lastrowid or 0)

    def audit_records(
        self, *, since_wall_s: float | None = None, limit: int = 100
    ) -> list[AuditRecord]:
        """Audit records, newest first."""
        rows = self._db.read(
            "SELECT * FROM audit WHERE wall_s >= ? ORDER BY wall_s DESC, id DESC LIMIT ?",
            (float("-inf") if since_wall_s is None else since_wall_s, limit),
        )
        return [
            AuditRecord(
                id=r["id"],
                wall_s=r["wall_s"],
                actor=r["actor"],
                action=r["action"],
                target=r["target"],
                decision=read_decision(r["decision"]),
                reason=r["reason"],
                incident_id=r["incident_id"],
                remediation_id=r["remediation_id"],
                details=json.loads(r["details_json"]),
            )
            for r in rows
        ]

    # Small facts (circuit-breaker state, promoted flags): JSON values by key.

    def get_fact(self, key: str) -> Any | None:
        rows = self._db.read("SELECT value_json FROM kv WHERE key = ?", (key,))
        return json.loads(rows[0][0]) if rows else None

    def set_fact(self, key: str, value: Any, now_wall_s: float) -> None:
        """Stores `value` masked (`collectors.secrets.mask`): an argv's secrets are `***` in
        the file; whoever runs it takes them back from the argv it came from."""
        text = json.dumps(mask(value), sort_keys=True)
        with self._db.transaction() as conn:
            conn.execute(
                "INSERT INTO kv (key, value_json, updated_wall_s) VALUES (?, ?, ?) "
                "ON CONFLICT (key) DO UPDATE SET value_json = excluded.value_json, "
                "updated_wall_s = excluded.updated_wall_s",
                (key, text, now_wall_s),
            )

    def delete_fact(self, key: str) -> None:
        with self._db.transaction() as conn:
            conn.execute("DELETE FROM kv WHERE key = ?", (key,))

    # Retention.

    def apply_retention(self, policy: RetentionConfig, now_wall_s: float) -> RetentionReport:
        """Deletes finished rows older than the policy's ages; pending work is never deleted."""
        with self._db.transaction() as conn:
            outbox = conn.execute(
                "DELETE FROM outbox WHERE state != 'pending' AND "
                "coalesce(finished_wall_s, next_attempt_wall_s) < ?",
                (now_wall_s - policy.outbox_days * _DAY_S,),
            ).rowcount
            audit = conn.execute(
                "DELETE FROM audit WHERE wall_s < ?", (now_wall_s - policy.audit_days * _DAY_S,)
            ).rowcount
            remediations = conn.execute(
                "DELETE FROM remediations WHERE finished_wall_s IS NOT NULL "
                "AND finished_wall_s < ?",
                (now_wall_s - policy.remediations_days * _DAY_S,),
            ).rowcount
            silences = conn.execute(
                "DELETE FROM silences WHERE until_wall_s < ?",
                (now_wall_s - policy.silences_days * _DAY_S,),
            ).rowcount
        return RetentionReport(outbox, audit, remediations, silences)


def _check_state(state: str) -> None:
    if state not in get_args(RemediationState):
        raise ValueError(f"remediation state must be one of {get_args(RemediationState)}")


def _remediation(row: sqlite3.Row) -> RemediationRecord:
    return RemediationRecord(**dict(row))


def _plain(value: Any) -> Any:
    """JSON-ready data for the audit details: what json cannot write becomes its text."""
    return json.loads(json.dumps(value, default=str))


def _labels_json(labels: Labels) -> str:
    return json.dumps([list(pair) for pair in labels])


def _labels(text: str) -> Labels:
    return tuple((str(k), str(v)) for k, v in json.loads(text))
