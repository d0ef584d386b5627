"""Failed writes to the state database: counted by reason, said once a minute, and once more
when writes succeed again.

A full disk or a read-only file fails every tick's write for as long as it lasts: one plain
line a minute (no traceback: the reason is the news) and a counter say so, while the agent
goes on collecting, serving and retrying. The clock is the caller's monotonic time.
"""

from __future__ import annotations

import logging
import sqlite3
from collections import Counter
from dataclasses import dataclass

from kvpilot.agent.state.errors import sqlite_reason

log = logging.getLogger(__name__)

LOG_EVERY_S = 60.0


@dataclass(slots=True)
class _Outage:
    started_s: float
    logged_s: float
    failures: int


class WriteFailures:
    """The state writes that failed, by reason; not thread-safe (the tick owns it)."""

    def __init__(self, log_every_s: float = LOG_EVERY_S) -> None:
        self.log_every_s = log_every_s
        self._totals: Counter[str] = Counter()
        self._outage: _Outage | None = None

    def failed(self, exc: sqlite3.Error, what: str, now_s: float) -> str:
        """Counts one failed write of `what`; returns its reason (disk_full, read_only, ...)."""
        reason = sqlite_reason(exc)
        self._totals[reason] += 1
        outage = self._outage
        if outage is None:
            outage = self._outage = _Outage(started_s=now_s, logged_s=now_s, failures=0)
        elif now_s - outage.logged_s < self.log_every_s:
            outage.failures += 1
            return reason
        else:
            outage.logged_s = now_s
        outage.failures += 1
        log.error(
            "state database: cannot write %s (%s: %s); it is kept and retried every tick",
            what,
            reason,
            exc,
            extra={"reason": reason, "failures": outage.failures},
        )
        return reason

    def succeeded(self, now_s: float) -> None:
        """A write committed: an outage, if one lasted, ends with one line."""
        outage, self._outage = self._outage, None
        if outage is not None:
            log.warning(
                "state database: writes succeed again after %d failed over %.0f s",
                outage.failures,
                now_s - outage.started_s,
            )

    @property
    def failing(self) -> bool:
        return self._outage is not None

    def totals(self) -> tuple[tuple[str, int], ...]:
        """(reason, failed writes) since the start, sorted."""
        return tuple(sorted(self._totals.items()))
