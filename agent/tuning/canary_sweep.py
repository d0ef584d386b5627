"""The sweep for canaries nobody attends, on a schedule of its own: a replica evicted
mid-trial leaves its canary serving a share of live traffic, and a daily tuning run is too
late to find it. Every `every_s`, while this pod runs no tuning of its own and no
remediation, the sweep takes the Deployment's Lease without waiting (a tuner elsewhere holds
it: that tuner's canary is attended, and the sweep is skipped) and runs the recovery a run
begins with, which removes a canary no trial owns."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.interval import IntervalTrigger

from kvpilot.tuner.session import TuningBlocked

log = logging.getLogger(__name__)
SWEEP_EVERY_S = 300.0  # a canary left serving waits at most this long to be found


class CanarySweep:
    """Runs `sweep` every `every_s` unless `busy`; `guard` is held by the pod's tuning runs,
    so that a sweep and a run never overlap (a run's own recovery sweeps as it begins)."""

    def __init__(
        self,
        sweep: Callable[[], Awaitable[object]],
        *,
        guard: asyncio.Lock,
        busy: Callable[[], bool],
        every_s: float = SWEEP_EVERY_S,
    ) -> None:
        self._sweep = sweep
        self._guard = guard
        self._busy = busy
        self.every_s = every_s
        self.sweeps_total = 0

    def add_to(self, scheduler: AsyncIOScheduler) -> None:
        scheduler.add_job(
            self.run,
            IntervalTrigger(seconds=self.every_s),
            id="canary-sweep",
            max_instances=1,
            coalesce=True,
        )

    async def run(self) -> str:
        """One sweep, or why not now; a failure is logged, and the next sweep tries again."""
        if self._guard.locked() or self._busy():
            return "skipped: a tuning run or a remediation is under way"
        async with self._guard:
            self.sweeps_total += 1
            try:
                await self._sweep()
            except TuningBlocked as exc:
                return f"skipped: {exc}"
            except Exception as exc:
                log.warning("the sweep for unattended canaries failed: %s", exc)
                return f"failed: {type(exc).__name__}: {exc}"
        return "swept"
