"""The persistent notification outbox: the `Outbox` protocol over the state database."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence

from kvpilot.agent.model import AlertEvent
from kvpilot.agent.notify.outbox_item import OutboxItem
from kvpilot.agent.notify.shedding import severity_rank_of
from kvpilot.agent.state.db import Database
from kvpilot.collectors.secrets import mask_text

_IDS_PER_STATEMENT = 500
_COLUMNS = (
    "id, notifier, dedup_key, event_json, attempts, next_attempt_wall_s, created_wall_s, last_error"
)


def event_to_json(event: AlertEvent) -> str:
    """The event as stored, and so as every receiver gets it: each label and annotation
    masked (a failed source's reason may name a URL with its password)."""
    return json.dumps(
        {
            "fingerprint": event.fingerprint,
            "incident_id": event.incident_id,
            "status": event.status,
            "labels": [[name, mask_text(value)] for name, value in event.labels],
            "annotations": [[name, mask_text(value)] for name, value in event.annotations],
            "starts_at_wall_s": event.starts_at_wall_s,
            "ends_at_wall_s": event.ends_at_wall_s,
            "generator_url": event.generator_url,
        },
        sort_keys=True,
    )


def event_from_json(text: str) -> AlertEvent:
    data = json.loads(text)
    return AlertEvent(
        fingerprint=data["fingerprint"],
        incident_id=data["incident_id"],
        status=data["status"],
        labels=tuple((str(k), str(v)) for k, v in data["labels"]),
        annotations=tuple((str(k), str(v)) for k, v in data["annotations"]),
        starts_at_wall_s=float(data["starts_at_wall_s"]),
        ends_at_wall_s=None if data["ends_at_wall_s"] is None else float(data["ends_at_wall_s"]),
        generator_url=data["generator_url"],
    )


def _item(row: sqlite3.Row) -> OutboxItem:
    return OutboxItem(
        id=row["id"],
        notifier=row["notifier"],
        dedup_key=row["dedup_key"],
        event=event_from_json(row["event_json"]),
        attempts=row["attempts"],
        next_attempt_wall_s=row["next_attempt_wall_s"],
        created_wall_s=row["created_wall_s"],
        last_error=row["last_error"],
    )


def _placeholders(ids: Sequence[int]) -> str:
    return ",".join("?" * len(ids))


def _chunks(ids: Sequence[int]) -> list[Sequence[int]]:
    """Ids in slices under SQLite's oldest limit on a statement's parameters (999)."""
    return [
        ids[start : start + _IDS_PER_STATEMENT] for start in range(0, len(ids), _IDS_PER_STATEMENT)
    ]


class SqliteOutbox:
    """Implements `Outbox` on the `outbox` table; same thread contract as `Database`.

    Rows are ordered by their id, the order they were enqueued in (AUTOINCREMENT never reuses
    one): a firing event goes before its resolved one even when the wall clock stepped back
    between the two. `created_wall_s` is kept for people and for an item's age. Due rows come
    critical first (`severity_rank`, stored on enqueue; the index `outbox_due` is in this
    order), so that a page is read ahead of any number of a notifier's older warnings."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def enqueue(self, notifier: str, event: AlertEvent, now_wall_s: float) -> int:
        key = event.dedup_key
        with self._db.transaction() as conn:
            row = conn.execute(
                "SELECT id FROM outbox WHERE notifier = ? AND dedup_key = ? AND state = 'pending'",
                (notifier, key),
            ).fetchone()
            if row is not None:
                return int(row[0])
            cursor = conn.execute(
                "INSERT INTO outbox (notifier, dedup_key, event_json, severity_rank, "
                "next_attempt_wall_s, created_wall_s) VALUES (?, ?, ?, ?, ?, ?)",
                (
                    notifier,
                    key,
                    event_to_json(event),
                    severity_rank_of(event.labels),
                    now_wall_s,
                    now_wall_s,
                ),
            )
            return int(cursor.lastrowid or 0)

    def due(
        self, now_wall_s: float, limit: int = 100, *, notifier: str | None = None
    ) -> list[OutboxItem]:
        mine = "" if notifier is None else "AND notifier = ? "
        only = () if notifier is None else (notifier,)
        rows = self._db.read(
            f"SELECT {_COLUMNS} FROM outbox WHERE state = 'pending' "  # noqa: S608 (constants)
            f"AND next_attempt_wall_s <= ? {mine}ORDER BY severity_rank, id LIMIT ?",
            (now_wall_s, *only, limit),
        )
        return [_item(row) for row in rows]

    def mark_delivered(self, item_ids: Sequence[int], now_wall_s: float) -> None:
        with self._db.transaction() as conn:
            for ids in _chunks(item_ids):
                conn.execute(
                    "UPDATE outbox SET state = 'delivered', finished_wall_s = ? "  # noqa: S608
                    f"WHERE state = 'pending' AND id IN ({_placeholders(ids)})",
                    (now_wall_s, *ids),
                )

    def mark_failed(
        self,
        item_ids: Sequence[int],
        error: str,
        next_attempt_wall_s: float,
        *,
        give_up: bool = False,
    ) -> None:
        with self._db.transaction() as conn:
            for ids in _chunks(item_ids):
                conn.execute(
                    "UPDATE outbox SET attempts = attempts + 1, last_error = ?, "  # noqa: S608
                    "next_attempt_wall_s = ?, state = ? "
                    f"WHERE state = 'pending' AND id IN ({_placeholders(ids)})",
                    (
                        mask_text(error),
                        next_attempt_wall_s,
                        "given_up" if give_up else "pending",
                        *ids,
                    ),
                )

    def make_pending_due(self, now_wall_s: float) -> int:
        with self._db.transaction() as conn:
            cursor = conn.execute(
                "UPDATE outbox SET next_attempt_wall_s = ? "
                "WHERE state = 'pending' AND next_attempt_wall_s > ?",
                (now_wall_s, now_wall_s),
            )
            return int(cursor.rowcount)

    def pending_counts(self) -> dict[str, int]:
        rows = self._db.read(
            "SELECT notifier, count(*) FROM outbox WHERE state = 'pending' GROUP BY notifier"
        )
        return {str(row[0]): int(row[1]) for row in rows}

    def pending_of(self, notifier: str) -> list[OutboxItem]:
        rows = self._db.read(
            f"SELECT {_COLUMNS} FROM outbox WHERE state = 'pending' "  # noqa: S608 (constant)
            "AND notifier = ? ORDER BY id",
            (notifier,),
        )
        return [_item(row) for row in rows]

    def backlog(self) -> int:
        return int(self._db.read("SELECT count(*) FROM outbox WHERE state = 'pending'")[0][0])

    def pending(self) -> list[OutboxItem]:
        """Every pending row, due or not, oldest first (for `kvpilot status`)."""
        rows = self._db.read(
            f"SELECT {_COLUMNS} FROM outbox WHERE state = 'pending' "  # noqa: S608 (constant)
            "ORDER BY id"
        )
        return [_item(row) for row in rows]
