"""The Kubernetes API's failures as kvpilot met them: a bounded, process-wide record.

Each failed call (`api.call`: a refusal, a server error, no answer within the deadline,
an answer that is not an API object) is kept here with its verb, object and status, so that
a failure kvpilot survived (a renewal retried, a pull-back tried again, a tick that fell back
to the pod's processes) is still on record, beside the trials' own reasons.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

KEPT = 200


@dataclass(frozen=True, slots=True)
class ApiFault:
    """One failed call: `status` is the HTTP status (0: no answer; 200: not an API object)."""

    at_wall_s: float
    verb: str
    what: str
    status: int
    kind: str  # the failure's class: Forbidden, Conflict, UnexpectedAnswer, ...
    message: str

    def describe(self) -> str:
        answer = "no answer" if self.status == 0 else f"HTTP {self.status}"
        return f"{self.kind} ({answer}) on {self.verb} {self.what}"


class FaultLog:
    """The latest KEPT failures, oldest first; safe to append from worker threads."""

    def __init__(self, kept: int = KEPT) -> None:
        self._faults: deque[ApiFault] = deque(maxlen=kept)
        self._lock = threading.Lock()
        self.total = 0

    def add(self, verb: str, what: str, status: int, kind: str, message: str) -> None:
        fault = ApiFault(time.time(), verb, what, status, kind, message[:300])
        with self._lock:
            self._faults.append(fault)
            self.total += 1

    def since(self, total: int) -> list[ApiFault]:
        """The failures recorded after the log's `total` was `total` (those still kept)."""
        with self._lock:
            new = self.total - total
            return list(self._faults)[-new:] if new > 0 else []


FAULTS = FaultLog()
