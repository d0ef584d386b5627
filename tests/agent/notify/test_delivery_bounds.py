"""Thousands of alerts cost neither unbounded storage nor thousands of requests: each
notifier's backlog has a bound (the lowest severity, then the oldest, dropped and counted),
and Alertmanager, whose API takes a list, gets many alerts per request."""

from __future__ import annotations

import math

import httpx
import pytest

from kvpilot.agent.model import AlertEvent
from kvpilot.agent.notify import AlertmanagerNotifier, DeliveryWorker, WebhookNotifier
from kvpilot.agent.notify.delivery import Outbox
from kvpilot.agent.state import StateStore
from tests.agent.notify.notify_helpers import FakeClock, make_event
from tests.agent.notify.notify_receiver import Receiver
from tests.agent.notify.test_delivery import Tally, with_client, worker_for
from tests.fakes.outbox import MemoryOutbox

AM_BATCH = 64  # alerts per request to Alertmanager, as Prometheus's notifier sends them


def event(n: int, severity: str = "warning", **kwargs: object) -> AlertEvent:
    return make_event(
        instance=f"vllm-{n}",
        incident_id=f"inc-{n}",
        extra_labels={"severity": severity},
        **kwargs,  # type: ignore[arg-type]
    )


# -- the bound -----------------------------------------------------------------------------


def test_a_backlog_past_its_bound_drops_the_lowest_severity_then_the_oldest() -> None:
    clock, outbox = FakeClock(), MemoryOutbox()
    severities = ["critical", "info", "warning", "critical", "info", "warning", "warning"]
    for n, severity in enumerate(severities):
        outbox.enqueue("hook", event(n, severity), clock())
        clock.advance(1.0)  # each one newer than the last
    down = Receiver()  # never started: every attempt is refused, nothing leaves by delivery

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {"hook": WebhookNotifier("hook", down.url, client)}
        worker = worker_for(outbox, notifiers, clock, max_pending_per_notifier=4)
        report = await worker.deliver_due()
        assert report.count("hook", "dropped") == 3
        assert report.backlog_items == 4

    with_client(body)
    kept = {dict(i.event.labels)["instance"] for i in outbox.pending()}
    # Both info rows go first, then the oldest warning (vllm-2); the criticals stay.
    assert kept == {"vllm-0", "vllm-3", "vllm-5", "vllm-6"}
    dropped = [f for f in outbox.finished() if not f.delivered]
    assert len(dropped) == 3
    assert all((f.item.last_error or "").startswith("dropped: hook's outbox") for f in dropped)


def test_the_oldest_dropped_is_the_first_enqueued_across_a_wall_clock_step_back() -> None:
    """The wall clock steps back an hour between the first two warnings and the next two: the
    first two are still the oldest and go, not the two stamped earlier after the step."""
    clock, outbox = FakeClock(), MemoryOutbox()
    for n in range(4):
        outbox.enqueue("hook", event(n), clock())
        clock.advance(-3600.0 if n == 1 else 1.0)
    down = Receiver()  # never started: nothing leaves by delivery

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {"hook": WebhookNotifier("hook", down.url, client)}
        worker = worker_for(outbox, notifiers, clock, max_pending_per_notifier=2)
        assert (await worker.deliver_due()).count("hook", "dropped") == 2

    with_client(body)
    assert {dict(i.event.labels)["instance"] for i in outbox.pending()} == {"vllm-2", "vllm-3"}


def test_the_bound_holds_per_notifier_under_a_flood_and_keeps_every_critical() -> None:
    clock, outbox = FakeClock(), MemoryOutbox()
    for n in range(1_000):
        outbox.enqueue("hook", event(n, "info"), clock())
    for n in range(1_000, 1_010):
        outbox.enqueue("hook", event(n, "critical"), clock())
    outbox.enqueue("other", event(0), clock())
    down = Receiver()

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {
            "hook": WebhookNotifier("hook", down.url, client),
            "other": WebhookNotifier("other", down.url, client),
        }
        worker = worker_for(outbox, notifiers, clock, max_pending_per_notifier=100)
        tally = Tally(worker)
        await tally.deliver()
        assert tally.counts[("hook", "dropped")] == 910
        assert ("other", "dropped") not in tally.counts

    with_client(body)
    assert outbox.pending_counts() == {"hook": 100, "other": 1}
    criticals = [
        i for i in outbox.pending_of("hook") if dict(i.event.labels)["severity"] == "critical"
    ]
    assert len(criticals) == 10


def test_rows_that_a_running_lane_sends_are_not_dropped_but_count(receiver: Receiver) -> None:
    clock, outbox = FakeClock(), MemoryOutbox()
    receiver.hang()
    sending = event(0, "info")
    outbox.enqueue("hook", sending, clock())

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {"hook": WebhookNotifier("hook", receiver.url, client, timeout_s=20)}
        worker = worker_for(outbox, notifiers, clock, max_pending_per_notifier=2, pass_wait_s=0.05)
        await worker.deliver_due()  # its lane hangs on the receiver
        for n in range(1, 4):
            outbox.enqueue("hook", event(n, "warning"), clock())
        report = await worker.deliver_due()
        assert report.count("hook", "dropped") == 2  # two warnings go, not the info in flight
        receiver.release()
        await worker.aclose(grace_s=10.0)

    with_client(body)
    assert sending in [f.item.event for f in outbox.finished() if f.delivered]


def test_a_lane_whose_rows_were_all_dropped_keeps_no_backoff(receiver: Receiver) -> None:
    """The worker forgets a dropped lane's failures: a later event of that alert goes out at
    once instead of waiting out a backoff that no row of it holds any more."""
    clock, outbox = FakeClock(), MemoryOutbox()
    outbox.enqueue("hook", event(0, "info"), clock())
    receiver.answer(503, times=1)

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {"hook": WebhookNotifier("hook", receiver.url, client)}
        tally = Tally(worker_for(outbox, notifiers, clock, max_pending_per_notifier=2))
        await tally.deliver()  # info fails: its lane backs off
        for n in (1, 2):
            outbox.enqueue("hook", event(n, "critical"), clock())
        await tally.deliver()  # three pending, two allowed: the info row goes
        assert tally.counts[("hook", "dropped")] == 1
        outbox.enqueue("hook", event(0, "info", status="resolved"), clock())
        await tally.deliver()
        assert tally.counts[("hook", "delivered")] == 3
        assert tally.counts[("hook", "deferred")] == 0

    with_client(body)
    assert outbox.backlog() == 0


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_pending_per_notifier"):
        DeliveryWorker(MemoryOutbox(), {}, clock=FakeClock(), max_pending_per_notifier=0)


def test_the_sqlite_outbox_sheds_the_same_way(tmp_path) -> None:  # type: ignore[no-untyped-def]
    clock = FakeClock()
    down = Receiver()
    with StateStore.open(tmp_path) as store:
        outbox: Outbox = store.outbox
        for n in range(1_200):  # past SQLite's oldest limit of parameters in one statement
            outbox.enqueue("hook", event(n, "info" if n % 2 else "warning"), clock())

        async def body(client: httpx.AsyncClient) -> None:
            notifiers = {"hook": WebhookNotifier("hook", down.url, client)}
            worker = worker_for(outbox, notifiers, clock, max_pending_per_notifier=500)
            report = await worker.deliver_due()
            assert report.count("hook", "dropped") == 700

        with_client(body)
        kept = store.outbox.pending_of("hook")
        assert len(kept) == 500 and outbox.backlog() == 500
        assert {dict(i.event.labels)["severity"] for i in kept} == {"warning"}


# -- batches -------------------------------------------------------------------------------


def test_alertmanager_gets_many_alerts_in_one_request(receiver: Receiver) -> None:
    """A thousand alerts, each its own lane, in ceil(1000 / 64) requests instead of 1,000;
    the one alert with two events has them in order inside its batch."""
    clock, outbox = FakeClock(), MemoryOutbox()
    alerts = 1_000
    for n in range(alerts):
        outbox.enqueue("am", event(n), clock())
    resolved = event(0, status="resolved")
    outbox.enqueue("am", resolved, clock())

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {"am": AlertmanagerNotifier("am", receiver.url, client)}
        # Four sends at once (the test receiver's listen queue is short); a pass sends four.
        worker = worker_for(outbox, notifiers, clock, batch_limit=2_000, lanes_per_notifier=4)
        delivered = []
        for _ in range(4):
            report = await worker.deliver_due()
            delivered.append(report.count("am", "delivered"))
        assert delivered == [256, 256, 256, alerts + 1 - 3 * 256], report.errors
        assert report.backlog_items == 0

    with_client(body)
    requests = receiver.accepted()
    assert len(requests) == math.ceil((alerts + 1) / AM_BATCH)
    bodies = [r.json() for r in requests]
    assert max(len(b) for b in bodies) == AM_BATCH
    posted = [a for b in bodies for a in b]
    assert len(posted) == alerts + 1
    first = [a for a in posted if a["labels"]["instance"] == "vllm-0"]
    assert first[0]["endsAt"] > first[1]["endsAt"]  # firing (valid ahead), then its end


def test_a_failed_batch_holds_each_of_its_lanes_and_then_arrives(receiver: Receiver) -> None:
    clock, outbox = FakeClock(), MemoryOutbox()
    for n in range(10):
        outbox.enqueue("am", event(n), clock())
    receiver.answer(503, times=1)

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {"am": AlertmanagerNotifier("am", receiver.url, client)}
        worker = worker_for(outbox, notifiers, clock)
        tally = Tally(worker)
        await tally.deliver()
        assert tally.counts == {("am", "retry"): 10}
        await tally.deliver()  # every lane waits out its backoff
        assert tally.counts[("am", "deferred")] == 0 and len(receiver.received()) == 1
        clock.advance(10.0)
        await tally.deliver()
        assert tally.counts[("am", "delivered")] == 10

    with_client(body)
    assert [len(r.json()) for r in receiver.received()] == [10, 10]


def test_a_rejected_batch_is_sent_one_by_one_and_only_the_culprit_is_given_up(
    receiver: Receiver,
) -> None:
    clock, outbox = FakeClock(), MemoryOutbox()
    for n in range(3):
        outbox.enqueue("am", event(n), clock())
    receiver.answer(400, times=1)  # the batch
    receiver.answer(200, times=1)
    receiver.answer(400, times=1)  # the second alert alone

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {"am": AlertmanagerNotifier("am", receiver.url, client)}
        tally = Tally(worker_for(outbox, notifiers, clock))
        await tally.deliver()
        assert tally.counts == {("am", "delivered"): 2, ("am", "given_up"): 1}

    with_client(body)
    assert [len(r.json()) for r in receiver.received()] == [3, 1, 1, 1]


def test_webhooks_still_get_one_request_per_event(receiver: Receiver) -> None:
    clock, outbox = FakeClock(), MemoryOutbox()
    for n in range(5):
        outbox.enqueue("hook", event(n), clock())

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {"hook": WebhookNotifier("hook", receiver.url, client)}
        tally = Tally(worker_for(outbox, notifiers, clock))
        await tally.deliver()
        assert tally.counts == {("hook", "delivered"): 5}

    with_client(body)
    assert [len(r.json()["alerts"]) for r in receiver.accepted()] == [1] * 5


def test_a_batch_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        AlertmanagerNotifier("am", "http://127.0.0.1:9", httpx.AsyncClient(), batch_size=0)
