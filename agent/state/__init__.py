"""The agent's persistent state: one SQLite file in the state directory."""

from kvpilot.agent.state.check import DatabaseCheck, check_database, move_aside
from kvpilot.agent.state.db import DB_FILENAME, Database
from kvpilot.agent.state.errors import StateDamaged, StateError, StateLocked, StateUnusable
from kvpilot.agent.state.exclusive import open_exclusive
from kvpilot.agent.state.lock import LOCK_FILENAME, StateLock
from kvpilot.agent.state.migrations import SCHEMA_VERSION, SchemaTooNewError
from kvpilot.agent.state.outbox import SqliteOutbox
from kvpilot.agent.state.store import (
    AuditRecord,
    RemediationRecord,
    RetentionReport,
    StateStore,
)

__all__ = [
    "DB_FILENAME",
    "LOCK_FILENAME",
    "SCHEMA_VERSION",
    "AuditRecord",
    "Database",
    "DatabaseCheck",
    "RemediationRecord",
    "RetentionReport",
    "SchemaTooNewError",
    "SqliteOutbox",
    "StateDamaged",
    "StateError",
    "StateLock",
    "StateLocked",
    "StateStore",
    "StateUnusable",
    "check_database",
    "move_aside",
    "open_exclusive",
]
