"""Canaries that nobody attends: a process-wide record, exported as
`kvpilot_unattended_canaries` and paged on (KvpilotUnattendedCanary).

A canary is unattended when kvpilot found one that no trial owns (a replica evicted mid-trial)
or could not take its share of live traffic back: it keeps serving that share until it is
cleaned up. A Deployment once marked keeps its series at 0 after the clean-up, so that the
alert resolves rather than its series vanishing.
"""

from __future__ import annotations

import threading


class UnattendedCanaries:
    """The number of unattended canaries per stable Deployment (`namespace/name`)."""

    def __init__(self) -> None:
        self._count: dict[str, float] = {}
        self._lock = threading.Lock()  # marked from worker threads and the event loop

    def mark(self, deployment: str) -> None:
        with self._lock:
            self._count[deployment] = 1.0  # one canary name per Deployment

    def clear(self, deployment: str) -> None:
        with self._lock:
            if deployment in self._count:
                self._count[deployment] = 0.0

    def series(self) -> tuple[tuple[str, float], ...]:
        with self._lock:
            return tuple(sorted(self._count.items()))


UNATTENDED = UnattendedCanaries()
