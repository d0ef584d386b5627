"""A step of the wall clock moves no delivery: backoff and the expiry after `max_age_s` run on
the worker's steady time. Stepped back, a lane is not held back by the step; stepped
forward, what is pending is not given up. The wall and monotonic clocks are driven by hand."""

from __future__ import annotations

import asyncio

import httpx

from kvpilot.agent.notify import Backoff, DeliveryWorker, WebhookNotifier
from tests.agent.notify.notify_helpers import FakeClock, make_event
from tests.agent.notify.notify_receiver import Receiver
from tests.fakes.outbox import MemoryOutbox

BACKOFF_S = 10.0
DAY_S = 86400.0


class Clocks:
    """A wall clock and a monotonic one; `pass_s` moves both, `step_s` the wall alone."""

    def __init__(self) -> None:
        self.wall = FakeClock()
        self.mono = FakeClock(1000.0)

    def pass_s(self, seconds: float) -> None:
        self.wall.advance(seconds)
        self.mono.advance(seconds)

    def step_s(self, seconds: float) -> None:
        self.wall.advance(seconds)


def _run(receiver: Receiver, clocks: Clocks, plan: object, max_age_s: float = 600.0) -> None:
    outbox = MemoryOutbox()
    outbox.enqueue("hook", make_event(), clocks.wall())

    async def main() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(2.0)) as client:
            worker = DeliveryWorker(
                outbox,
                {"hook": WebhookNotifier("hook", receiver.url, client)},
                clock=clocks.wall,
                monotonic=clocks.mono,
                backoff=Backoff(initial_s=BACKOFF_S, jitter_ratio=0.0),
                max_age_s=max_age_s,
                pass_wait_s=10.0,
            )
            assert callable(plan)
            await plan(worker, outbox)

    asyncio.run(main())


def test_a_wall_clock_stepped_back_does_not_hold_a_lane_back(receiver: Receiver) -> None:
    clocks = Clocks()
    receiver.answer(503, times=1)

    async def plan(worker: DeliveryWorker, outbox: MemoryOutbox) -> None:
        first = await worker.deliver_due()
        assert first.count("hook", "retry") == 1
        clocks.step_s(-3600.0)  # NTP steps the clock back an hour
        clocks.pass_s(BACKOFF_S + 0.01)
        second = await worker.deliver_due()
        assert second.count("hook", "delivered") == 1, "held back by the step"
        assert outbox.backlog() == 0

    _run(receiver, clocks, plan)


def test_a_wall_clock_stepped_forward_gives_up_nothing(receiver: Receiver) -> None:
    clocks = Clocks()
    receiver.answer(503, times=1)

    async def plan(worker: DeliveryWorker, outbox: MemoryOutbox) -> None:
        assert (await worker.deliver_due()).count("hook", "retry") == 1
        clocks.step_s(DAY_S)  # a day ahead, at once
        early = await worker.deliver_due()
        assert early.count("hook", "given_up") == 0, "given up on a step of the clock"
        assert len(receiver.received()) == 1  # and the backoff still holds
        clocks.pass_s(BACKOFF_S + 0.01)
        later = await worker.deliver_due()
        assert later.count("hook", "delivered") == 1 and outbox.backlog() == 0

    _run(receiver, clocks, plan)


def test_max_age_still_ends_retries_on_the_monotonic_clock(receiver: Receiver) -> None:
    clocks = Clocks()
    receiver.answer(503)

    async def plan(worker: DeliveryWorker, outbox: MemoryOutbox) -> None:
        given_up = 0
        for _ in range(100):
            report = await worker.deliver_due()
            given_up += report.count("hook", "given_up")
            if given_up:
                break
            clocks.pass_s(BACKOFF_S + 0.01)
            clocks.step_s(-50.0)  # a wall clock that keeps going back
        assert given_up == 1 and outbox.backlog() == 0

    _run(receiver, clocks, plan, max_age_s=100.0)
