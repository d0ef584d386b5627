"""A tick that overruns is counted and said at most once a minute; a background task that
fails is logged and counted, never dropped."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvpilot.agent.tasks import GuardedTasks
from kvpilot.agent.tick.overruns import TickOverruns


def test_overruns_are_counted_and_said_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    overruns = TickOverruns(1.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="kvpilot.agent.tick.overruns")
    for _ in range(30):  # thirty slow ticks within half a minute
        overruns.record(1.5)
        now[0] += 1.0
    overruns.record(0.2)  # on time: not counted
    assert overruns.total == 30
    assert len(caplog.records) == 1
    now[0] = 61.0
    overruns.record(2.0)
    assert len(caplog.records) == 2
    assert "30 such ticks" in caplog.records[1].getMessage()


def test_a_failing_background_task_is_logged_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def fails() -> None:
        raise RuntimeError("receiver exploded")

    async def scenario() -> GuardedTasks:
        tasks = GuardedTasks()
        task = tasks.spawn(fails(), "delivery")
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)  # done callbacks run on the next loop iteration
        return tasks

    caplog.set_level(logging.ERROR, logger="kvpilot.agent.tasks")
    tasks = asyncio.run(scenario())
    assert tasks.failures == {"delivery": 1}
    assert "background task delivery failed" in caplog.text
    assert "receiver exploded" in caplog.text
    assert tasks.running() == ()
