"""Tuning trials and rollout records in the state database (tables from migration 2).

Each trial is a row with its state and study columns for queries, and the whole record as
JSON (`trial_to_dict`). Thread safety: as `Database` (the event-loop thread only).
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from typing import Any

from kvpilot.agent.state.db import Database
from kvpilot.collectors.secrets import mask
from kvpilot.tuner.rollout.canary import Phase, RolloutRecord, Strategy
from kvpilot.tuner.trials import Trial, trial_from_dict, trial_to_dict


class SqliteTrialStore:
    """The TrialStore the agent uses (see `kvpilot.tuner.trials.TrialStore`)."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def add(self, trial: Trial) -> None:
        try:
            with self._db.transaction() as conn:
                conn.execute(
                    "INSERT INTO trials (trial_id, fingerprint, number, state, created_wall_s,"
                    " updated_wall_s, trial_json) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        trial.trial_id,
                        trial.fingerprint,
                        trial.number,
                        trial.state.value,
                        trial.created_wall_s,
                        trial.updated_wall_s,
                        _json(trial_to_dict(trial)),
                    ),
                )
        except sqlite3.IntegrityError:
            raise ValueError(f"trial {trial.trial_id} exists") from None

    def save(self, trial: Trial) -> None:
        with self._db.transaction() as conn:
            cursor = conn.execute(
                "UPDATE trials SET state = ?, updated_wall_s = ?, trial_json = ?"
                " WHERE trial_id = ?",
                (
                    trial.state.value,
                    trial.updated_wall_s,
                    _json(trial_to_dict(trial)),
                    trial.trial_id,
                ),
            )
            if cursor.rowcount == 0:
                raise KeyError(trial.trial_id)

    def get(self, trial_id: str) -> Trial | None:
        rows = self._db.read("SELECT trial_json FROM trials WHERE trial_id = ?", (trial_id,))
        return trial_from_dict(json.loads(rows[0]["trial_json"])) if rows else None

    def trials(self, fingerprint: str | None = None) -> list[Trial]:
        if fingerprint is None:
            rows = self._db.read("SELECT trial_json FROM trials ORDER BY created_wall_s, number")
        else:
            rows = self._db.read(
                "SELECT trial_json FROM trials WHERE fingerprint = ?"
                " ORDER BY created_wall_s, number",
                (fingerprint,),
            )
        return [trial_from_dict(json.loads(row["trial_json"])) for row in rows]

    def unfinished(self) -> list[Trial]:
        rows = self._db.read(
            "SELECT trial_json FROM trials WHERE state IN ('planned', 'running')"
            " ORDER BY created_wall_s, number"
        )
        return [trial_from_dict(json.loads(row["trial_json"])) for row in rows]


class SqliteRolloutJournal:
    """The RolloutJournal the agent uses: one row per trial, replaced at each transition."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def save(self, record: RolloutRecord) -> None:
        with self._db.transaction() as conn:
            conn.execute(
                "INSERT INTO rollouts (trial_id, phase, final, seq, updated_wall_s, record_json)"
                " VALUES (?, ?, ?, (SELECT COALESCE(MAX(seq), 0) + 1 FROM rollouts), ?, ?)"
                " ON CONFLICT (trial_id) DO UPDATE SET phase = excluded.phase,"
                " final = excluded.final, updated_wall_s = excluded.updated_wall_s,"
                " record_json = excluded.record_json",
                (
                    record.trial_id,
                    record.phase.value,
                    int(record.phase.final),
                    record.updated_wall_s,
                    _json(record_to_dict(record)),
                ),
            )

    def get(self, trial_id: str) -> RolloutRecord | None:
        rows = self._db.read("SELECT record_json FROM rollouts WHERE trial_id = ?", (trial_id,))
        return record_from_dict(json.loads(rows[0]["record_json"])) if rows else None

    def records(self) -> list[RolloutRecord]:
        rows = self._db.read("SELECT record_json FROM rollouts ORDER BY seq")
        return [record_from_dict(json.loads(row["record_json"])) for row in rows]

    def open_records(self) -> list[RolloutRecord]:
        rows = self._db.read("SELECT record_json FROM rollouts WHERE final = 0 ORDER BY seq")
        return [record_from_dict(json.loads(row["record_json"])) for row in rows]


def record_to_dict(record: RolloutRecord) -> dict[str, Any]:
    """A JSON-ready dict of a rollout record, masked for storage: the argv's secrets are
    `***` in the file, and the tuner's runtime takes them back from the running argv
    (`collectors.secrets.restore_secrets`) before it starts a server with one."""
    data = dataclasses.asdict(record)
    data["stable_argv"] = list(record.stable_argv)
    data["candidate_argv"] = list(record.candidate_argv)
    masked: dict[str, Any] = mask(data)  # a dict masked is a dict
    return masked


def record_from_dict(data: dict[str, Any]) -> RolloutRecord:
    """The inverse of record_to_dict."""
    return RolloutRecord(
        trial_id=data["trial_id"],
        strategy=Strategy(data["strategy"]),
        phase=Phase(data["phase"]),
        stable_argv=tuple(data["stable_argv"]),
        candidate_argv=tuple(data["candidate_argv"]),
        updated_wall_s=float(data["updated_wall_s"]),
        reason=data.get("reason"),
        baseline_goodput_tokens_per_s=data.get("baseline_goodput_tokens_per_s"),
        bake_goodput_tokens_per_s=data.get("bake_goodput_tokens_per_s"),
    )


def _json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
