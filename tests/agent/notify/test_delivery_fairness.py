"""Delivery that cannot livelock or starve, against real receivers on loopback.

A lane longer than the send timeout still goes through (each request has its own timeout and
each event is marked delivered as soon as it arrives), and each notifier reads its own due
rows, so a slow receiver owing thousands holds back no other notifier's events.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from kvpilot.agent.model import AlertEvent
from kvpilot.agent.notify import Backoff, DeliveryWorker, WebhookNotifier
from kvpilot.agent.state import StateStore
from tests.agent.notify.notify_helpers import START_WALL_S, FakeClock, make_event
from tests.agent.notify.notify_receiver import Receiver
from tests.agent.notify.test_delivery import (
    Tally,
    eventually,
    keys_arrived,
    with_client,
    worker_for,
)
from tests.fakes.outbox import MemoryOutbox

PASS_S = 0.2  # how long a pass waits for its lanes here: a tick, shortened


def incidents(count: int) -> list[AlertEvent]:
    """`count` incidents of one alert, each firing then resolved: one lane, in this order."""
    events: list[AlertEvent] = []
    for n in range(count):
        starts = START_WALL_S + 100.0 * n
        for status in ("firing", "resolved"):
            events.append(
                make_event(status=status, starts_at_wall_s=starts, incident_id=f"inc-{n}")  # type: ignore[arg-type]
            )
    return events


def severe(n: int, severity: str) -> AlertEvent:
    return make_event(
        instance=f"vllm-{n}", incident_id=f"inc-{n}", extra_labels={"severity": severity}
    )


def test_a_lane_longer_than_the_send_timeout_delivers_each_event_once(receiver: Receiver) -> None:
    """Twelve events owed to one alert's lane, 0.1 s each under a 0.75 s send timeout (the
    ratio of 0.4 s under 3 s): the whole lane takes longer than the timeout, yet each event goes
    out exactly once, in order, and the last resolved goes too."""
    clock, outbox = FakeClock(), MemoryOutbox()
    events = incidents(6)
    for e in events:
        outbox.enqueue("hook", e, clock())
    receiver.slow(0.1)

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {"hook": WebhookNotifier("hook", receiver.url, client, timeout_s=5.0)}
        worker = worker_for(
            outbox,
            notifiers,
            clock,
            send_timeout_s=0.75,
            pass_wait_s=PASS_S,
            backoff=Backoff(initial_s=1.0, max_s=30.0),
        )
        tally = Tally(worker)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        while (outbox.backlog() or worker.lanes_running()) and loop.time() < deadline:
            await tally.deliver()
            await asyncio.sleep(PASS_S)  # the next tick; a pass with no new lane waits for none
            clock.advance(60.0)  # past the backoff that a timeout would have earned
        await tally.settle()
        assert tally.counts[("hook", "delivered")] == len(events), tally.counts

    with_client(body)
    assert receiver.arrived() == [e.dedup_key for e in events]
    assert outbox.backlog() == 0


def test_a_slow_receiver_owing_thousands_holds_back_no_other_notifiers_page(
    receiver: Receiver,
) -> None:
    """2,000 rows owed to a receiver that takes 10 s an answer, all older than one critical
    page for another notifier: the page arrives within the first passes."""
    clock, outbox = FakeClock(), MemoryOutbox()
    slow = Receiver().start()
    slow.slow(10.0)
    for n in range(2_000):
        outbox.enqueue("slow", severe(n, "warning"), clock())
    page = make_event("VllmServerDown", instance="vllm-9", extra_labels={"severity": "critical"})
    outbox.enqueue("fast", page, clock())

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {
            "slow": WebhookNotifier("slow", slow.url, client, timeout_s=20.0),
            "fast": WebhookNotifier("fast", receiver.url, client),
        }
        worker = worker_for(outbox, notifiers, clock, send_timeout_s=20.0, pass_wait_s=PASS_S)
        for _ in range(2):  # a pass and the next: the slow lanes are out by the second
            await worker.deliver_due()
        try:
            assert keys_arrived(receiver) == [page.dedup_key]
            assert worker.lanes_running() == 8  # the slow receiver's sends, still out
        finally:
            slow.stop()  # its held answers end now
            await worker.aclose(grace_s=5.0)

    try:
        with_client(body)
    finally:
        slow.stop()


def test_a_notifiers_critical_lanes_start_before_its_warnings(receiver: Receiver) -> None:
    """One send at a time and five older warnings: the critical page is the first request."""
    clock, outbox = FakeClock(), MemoryOutbox()
    for n in range(5):
        outbox.enqueue("hook", severe(n, "warning"), clock())
    page = severe(9, "critical")
    outbox.enqueue("hook", page, clock())
    receiver.hang()

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {"hook": WebhookNotifier("hook", receiver.url, client, timeout_s=20.0)}
        worker = worker_for(outbox, notifiers, clock, lanes_per_notifier=1, pass_wait_s=0.05)
        tally = Tally(worker)
        await tally.deliver()
        await eventually(lambda: bool(receiver.arrived()), "the first request")
        assert receiver.arrived() == [page.dedup_key]
        receiver.release()
        for _ in range(6):
            await tally.settle()
        assert tally.counts == {("hook", "delivered"): 6}

    with_client(body)
    assert outbox.backlog() == 0


def test_a_page_behind_thousands_of_the_same_receivers_warnings_goes_in_the_first_pass(
    receiver: Receiver, tmp_path: Path
) -> None:
    """2,000 due warnings for one receiver, far more than a pass reads (`batch_limit`), then
    one critical page for the same receiver: the state database gives the page first, so the
    first pass sends it, and first (one send at a time makes the order plain)."""
    clock = FakeClock()
    page = make_event("VllmServerDown", instance="vllm-9", extra_labels={"severity": "critical"})
    with StateStore.open(tmp_path) as store:
        with store.transaction():
            for n in range(2_000):
                store.outbox.enqueue("hook", severe(n, "warning"), clock())
            store.outbox.enqueue("hook", page, clock())

        async def body(client: httpx.AsyncClient) -> None:
            notifiers = {"hook": WebhookNotifier("hook", receiver.url, client)}
            worker = worker_for(store.outbox, notifiers, clock, lanes_per_notifier=1)
            report = await worker.deliver_due()
            assert report.count("hook", "delivered") == 1, report

        with_client(body)
    assert keys_arrived(receiver) == [page.dedup_key]


def test_each_notifier_gets_its_own_budget_of_rows(receiver: Receiver) -> None:
    """A batch limit of 2 rows a pass: a notifier owing 10 older rows takes its 2, and another
    notifier still gets its own 2 in the same pass."""
    clock, outbox = FakeClock(), MemoryOutbox()
    for n in range(10):
        outbox.enqueue("busy", severe(n, "warning"), clock())
    later = [severe(20 + n, "warning") for n in range(2)]
    for e in later:
        outbox.enqueue("other", e, clock())

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {
            "busy": WebhookNotifier("busy", receiver.url + "/busy", client),
            "other": WebhookNotifier("other", receiver.url + "/other", client),
        }
        worker: DeliveryWorker = worker_for(outbox, notifiers, clock, batch_limit=2)
        report = await worker.deliver_due()
        assert report.count("busy", "delivered") == 2
        assert report.count("other", "delivered") == 2

    with_client(body)
    assert [r.path for r in receiver.accepted()].count("/other") == 2
