"""A step of the wall clock back neither holds the ticks nor makes `/healthz` stale.

The wall clock is stepped inside this process only (never the machine's): `time.time` and
the `datetime` class that the agent and its scheduler read are replaced by ones an hour back.
The monotonic clock is left alone, as a real step (NTP, a resumed VM) leaves it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvpilot.agent.app.http import build_app
from kvpilot.agent.app.lifecycle import LoopSettings, bind_listener, serve_and_tick
from kvpilot.agent.tick.ticker import TickState

INTERVAL_S = 0.05
STEP_S = 3600.0
DEADLINE_S = 5.0  # ticks every 0.05 s: 10 of them take 0.5 s; the old scheduler waited 1 h


class _WallClock:
    """What Python code in this process reads as the wall clock, set back once stepped."""

    offset_s = 0.0


_REAL_DATETIME = dt.datetime


class _SteppedDatetime(dt.datetime):
    @classmethod
    def now(cls, tz: dt.tzinfo | None = None) -> dt.datetime:  # type: ignore[override]
        return _REAL_DATETIME.now(tz) - dt.timedelta(seconds=_WallClock.offset_s)


@pytest.fixture
def wall_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_WallClock]]:
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() - _WallClock.offset_s)
    for name, module in list(sys.modules.items()):
        if name.startswith(("apscheduler", "kvpilot")) and (
            getattr(module, "datetime", None) is _REAL_DATETIME
        ):
            monkeypatch.setattr(module, "datetime", _SteppedDatetime)
    monkeypatch.setattr(dt, "datetime", _SteppedDatetime)
    yield _WallClock
    _WallClock.offset_s = 0.0


async def _wait_for_ticks(starts: list[float], count: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while len(starts) < count:
        assert time.monotonic() < deadline, f"{len(starts)} ticks, {count} awaited"
        await asyncio.sleep(INTERVAL_S / 2)


def test_a_wall_clock_stepped_back_an_hour_keeps_ticks_coming_and_healthz_200(
    wall_clock: type[_WallClock],
) -> None:
    state = TickState()
    starts: list[float] = []

    async def tick() -> None:
        now_s = time.monotonic()
        starts.append(now_s)
        state.ticks_total += 1
        state.last_tick_at_s = now_s

    async def main() -> None:
        sock = bind_listener("127.0.0.1", 0)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/healthz"
        app = build_app(state, CollectorRegistry(), clock=time.monotonic, stale_after_s=0.5)
        stop = asyncio.Event()
        settings = LoopSettings(interval_s=INTERVAL_S, shutdown_grace_s=2.0)
        agent = asyncio.create_task(serve_and_tick(tick, app, settings, stop=stop, sock=sock))
        try:
            await _wait_for_ticks(starts, 3)
            wall_clock.offset_s = STEP_S
            stepped_at = len(starts)
            await _wait_for_ticks(starts, stepped_at + 20)  # 1 s: twice the staleness limit
            async with httpx.AsyncClient(timeout=2.0) as client:
                health = await client.get(url)
        finally:
            stop.set()
            await asyncio.wait_for(agent, 10)
        assert health.status_code == 200, health.text
        gaps = [b - a for a, b in zip(starts[stepped_at - 1 :], starts[stepped_at:], strict=False)]
        assert max(gaps) < 10 * INTERVAL_S

    asyncio.run(main())
