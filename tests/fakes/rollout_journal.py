"""An in-memory `RolloutJournal` (see `kvpilot.tuner.rollout.ports`): a dict, for tuner tests that
need no database. It passes the same contract as the agent's SQLite journal
(tests/tuner/rollout/test_journal_contract.py).
"""

from __future__ import annotations

from kvpilot.tuner.rollout.canary import RolloutRecord


class InMemoryRolloutJournal:
    """A RolloutJournal in a dict (first-saved order, as the SQLite one keeps it)."""

    def __init__(self) -> None:
        self._records: dict[str, RolloutRecord] = {}

    def save(self, record: RolloutRecord) -> None:
        self._records[record.trial_id] = record

    def get(self, trial_id: str) -> RolloutRecord | None:
        return self._records.get(trial_id)

    def records(self) -> list[RolloutRecord]:
        return list(self._records.values())

    def open_records(self) -> list[RolloutRecord]:
        return [r for r in self._records.values() if not r.phase.final]
