"""The agent's persistent state: one SQLite file in the state directory."""

from kvpilot.agent.state.db import DB_FILENAME, Database
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
    "SCHEMA_VERSION",
    "AuditRecord",
    "Database",
    "RemediationRecord",
    "RetentionReport",
    "SchemaTooNewError",
    "SqliteOutbox",
    "StateStore",
]
