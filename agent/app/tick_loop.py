"""The tick's schedule, on the monotonic clock.

The event loop's own clock (`loop.time()`, monotonic) times the ticks, never the wall clock:
a step of the wall clock back (NTP, a VM resumed, an operator) must not hold the ticks for the
length of the step, and with them every scrape, rule, delivery, restart and `/healthz`.
APScheduler keeps only the cron-like jobs (the nightly tuning run), which are meant on the
wall clock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from kvpilot.agent.tick.overruns import TickOverruns

log = logging.getLogger(__name__)


class TickLoop:
    """Starts `tick` every `interval_s` in a task of its own, one at a time.

    A tick that overruns its interval is never run twice at once: the next tick starts as
    soon as it ends, the other starts due meanwhile are skipped (the overrun is counted by
    `TickOverruns`), and the cadence goes on from that start."""

    def __init__(
        self,
        tick: Callable[[], Awaitable[None]],
        interval_s: float,
        overruns: TickOverruns | None = None,
        on_start: Callable[[float], None] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self._tick = tick
        self._interval_s = interval_s
        self._overruns = overruns
        self._on_start = on_start
        self._running: asyncio.Task[None] | None = None

    @property
    def running(self) -> asyncio.Task[None] | None:
        """The tick under way, if any (shutdown waits for it)."""
        if self._running is not None and self._running.done():
            self._running = None
        return self._running

    async def run(self, stop: asyncio.Event) -> None:
        """Start ticks until `stop` is set; the first starts at once."""
        loop = asyncio.get_running_loop()
        due_s = loop.time()
        while not stop.is_set():
            running = self.running
            if running is not None:
                # The tick overran its interval: the start it held back goes as soon as it
                # ends (one kept, as Go's ticker keeps one tick for a slow reader), the others
                # are skipped. Waiting for the next slot instead would leave a gap of two
                # intervals after every overrun.
                await _first_of(running, stop)
                if stop.is_set():
                    return
                due_s = loop.time()
            self._running = loop.create_task(self._one_tick(), name="tick")
            due_s = _next_due(due_s, self._interval_s, loop.time())
            try:
                async with asyncio.timeout_at(due_s):
                    await stop.wait()
            except TimeoutError:
                continue

    async def _one_tick(self) -> None:
        started_s = time.monotonic()
        if self._on_start is not None:  # the loop watch: gaps between starts, for soaks
            self._on_start(started_s)
        try:
            await self._tick()
        except Exception:
            # A tick that dies is logged loudly; the next one runs on schedule.
            log.exception("tick failed")
        finally:
            if self._overruns is not None:
                self._overruns.record(time.monotonic() - started_s)


async def _first_of(running: asyncio.Task[None], stop: asyncio.Event) -> None:
    """Wait until the tick under way ends or `stop` is set; the tick itself is never
    cancelled here (shutdown gives it its grace)."""
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({running, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()


def _next_due(due_s: float, interval_s: float, now_s: float) -> float:
    """The next start on the grid `due_s + k * interval_s` after `now_s`: starts missed while
    the loop was held (a long tick, a blocked loop) coalesce into that one."""
    following = due_s + interval_s
    if following > now_s:
        return following
    missed = (now_s - following) // interval_s + 1
    return following + missed * interval_s
