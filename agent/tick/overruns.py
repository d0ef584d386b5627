"""Ticks that overran their interval: counted, and said at most once a minute."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

OVERRUN_LOG_EVERY_S = 60.0


class TickOverruns:
    """Ticks that took longer than the interval: counted, and said at most once a minute
    (the tick loop skips the starts due meanwhile; none piles up)."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.total = 0
        self._clock = clock
        self._last_said_s: float | None = None
        self._unsaid = 0

    def record(self, took_s: float) -> None:
        if took_s <= self.interval_s:
            return
        self.total += 1
        self._unsaid += 1
        now_s = self._clock()
        if self._last_said_s is None or now_s - self._last_said_s >= OVERRUN_LOG_EVERY_S:
            log.warning(
                "a tick took %.2f s, longer than the %.2f s interval (%d such ticks since "
                "the last word on it; the next tick waits, none piles up)",
                took_s,
                self.interval_s,
                self._unsaid,
            )
            self._last_said_s, self._unsaid = now_s, 0
