"""A tick slower than its interval: counted as an overrun, never run twice at once, and no
APScheduler "maximum number of running instances" warning each interval (the job only
starts the tick, so the scheduler never finds one of its runs still going)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from starlette.applications import Starlette

from kvpilot.agent.app.lifecycle import LoopSettings, serve_and_tick
from kvpilot.agent.app.tick_loop import TickLoop
from kvpilot.agent.tick.overruns import TickOverruns


@pytest.mark.parametrize("counted", [False, True])  # unfiltered first: nothing global helps
def test_a_slow_tick_is_not_skipped_loudly_nor_run_twice(
    caplog: pytest.LogCaptureFixture, counted: bool
) -> None:
    running, most, done = 0, 0, 0
    overruns = TickOverruns(0.1) if counted else None

    async def tick() -> None:
        nonlocal running, most, done
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.35)  # three and a half intervals
        running -= 1
        done += 1

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(1.6, stop.set)
        settings = LoopSettings(listen_port=0, interval_s=0.1, shutdown_grace_s=2.0)
        await serve_and_tick(tick, Starlette(), settings, stop=stop, overruns=overruns)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    assert most == 1
    assert 2 <= done <= 5
    assert not [r for r in caplog.records if "maximum number of running" in r.getMessage()]
    assert not [
        r
        for r in caplog.records
        if r.name.startswith("apscheduler") and r.levelno == logging.WARNING
    ]
    if overruns is not None:
        assert overruns.total >= 2


def test_the_start_an_overrun_held_back_goes_as_soon_as_the_tick_ends() -> None:
    """One slow tick (1.5 intervals) must not leave a gap of two intervals: the start it held
    back follows it at once, and the cadence goes on from there."""
    starts: list[float] = []
    slow = 0.15
    five = asyncio.Event()

    async def tick() -> None:
        starts.append(asyncio.get_running_loop().time())
        if len(starts) == 2:
            await asyncio.sleep(slow)
        if len(starts) == 5:
            five.set()

    async def main() -> None:
        stop = asyncio.Event()
        ticks = TickLoop(tick, interval_s=0.1)
        running = asyncio.create_task(ticks.run(stop))
        await five.wait()
        stop.set()
        await running

    asyncio.run(asyncio.wait_for(main(), timeout=10.0))
    after_slow = starts[2] - starts[1]
    assert slow <= after_slow < slow + 0.04, after_slow  # not the next slot at 0.2 s
