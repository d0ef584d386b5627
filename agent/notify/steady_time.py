"""The delivery worker's own time: backoff and expiry that a step of the wall clock cannot move.

The steady time is the wall time at the worker's start, moved on by the monotonic clock: a
step of the wall clock back neither holds a lane back by the step, nor does a step forward
give up what is pending. An item's age counts on the monotonic clock from when this worker
first saw it (its age by the wall clock then, never below zero). Rows keep wall times, for
display and for the next start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

MAX_REMEMBERED_AGES = 100_000  # first sightings kept; past it they are forgotten (ages reset)


class SteadyTime:
    """Steady wall time and item ages for one delivery worker."""

    def __init__(
        self, wall: Callable[[], float], monotonic: Callable[[], float] | None = None
    ) -> None:
        # The real wall clock pairs with the real monotonic one; an injected clock drives both.
        if monotonic is None:
            monotonic = time.monotonic if wall is time.time else wall
        self._wall = wall
        self._monotonic = monotonic
        self._start_wall_s, self._start_mono_s = wall(), monotonic()
        self._first_seen: dict[int, float] = {}  # item id -> monotonic time its age began

    def now(self) -> float:
        """The steady wall time."""
        return self._start_wall_s + (self._monotonic() - self._start_mono_s)

    def due_by(self, now: float) -> float:
        """Where the outbox's due rows end: rows enqueued with the wall clock ahead of the
        steady one (it stepped forward) are due now too; held ones are the lanes' to hold."""
        return max(now, self._wall())

    def age_s(self, item_id: int, created_wall_s: float, now: float) -> float:
        """How old an item is, on the monotonic clock since it was first seen here."""
        mono = self._monotonic()
        began = self._first_seen.get(item_id)
        if began is None:
            if len(self._first_seen) >= MAX_REMEMBERED_AGES:
                self._first_seen.clear()
            began = mono - max(0.0, now - created_wall_s)
            self._first_seen[item_id] = began
        return mono - began

    def forget(self, item_ids: Iterable[int]) -> None:
        """Items that left the backlog."""
        for item_id in item_ids:
            self._first_seen.pop(item_id, None)
