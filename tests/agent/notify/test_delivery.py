"""At-least-once delivery from the outbox, against real receivers, on a hand-driven clock.

The worker waits for a pass's lanes here (`pass_wait_s`) unless a test says otherwise, so that
each pass's report holds its outcomes.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable

import httpx
import pytest
from pydantic import SecretStr

from kvpilot.agent.model import AlertEvent
from kvpilot.agent.notify import (
    Backoff,
    DeliveryWorker,
    Notifier,
    SlackNotifier,
    WebhookNotifier,
)
from tests.agent.notify.notify_helpers import START_WALL_S, FakeClock, make_event
from tests.agent.notify.notify_receiver import Receiver
from tests.fakes.outbox import MemoryOutbox

DRAW = 0.5  # the injected random: every delay is its base x (1 - 0.2 x 0.5)
JITTER = 1 - 0.2 * DRAW


def with_client(body: Callable[[httpx.AsyncClient], Awaitable[None]]) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(0.5)) as client:
            await body(client)

    asyncio.run(main())


def worker_for(
    outbox, notifiers: dict[str, Notifier], clock: FakeClock, **kwargs
) -> DeliveryWorker:
    kwargs.setdefault("pass_wait_s", 30.0)
    return DeliveryWorker(outbox, notifiers, clock=clock, random=lambda: DRAW, **kwargs)


def keys_arrived(receiver: Receiver) -> list[str]:
    return [r.headers["x-kvpilot-dedup-key"] for r in receiver.accepted()]


async def eventually(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Until `check()` holds, letting the worker's lanes run meanwhile."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.01)


class Tally:
    """Every report's counts added up: a lane's outcomes are in whichever report follows it."""

    def __init__(self, worker: DeliveryWorker) -> None:
        self.worker = worker
        self.counts: Counter[tuple[str, str]] = Counter()

    async def deliver(self) -> None:
        for count in (await self.worker.deliver_due()).counts:
            self.counts[(count.notifier, count.outcome)] += count.items_total

    async def settle(self) -> None:
        """Wait for the running lanes, then collect their outcomes."""
        await self.worker.aclose(grace_s=10.0)
        await self.deliver()


def test_delivers_due_items_and_empties_the_backlog(receiver: Receiver) -> None:
    clock, outbox = FakeClock(), MemoryOutbox()
    events = [make_event(instance="vllm-0"), make_event(instance="vllm-1")]
    for event in events:
        outbox.enqueue("hook", event, clock())

    async def body(client: httpx.AsyncClient) -> None:
        worker = worker_for(outbox, {"hook": WebhookNotifier("hook", receiver.url, client)}, clock)
        report = await worker.deliver_due()
        assert report.count("hook", "delivered") == 2
        assert report.backlog_items == 0 and report.errors == ()
        again = await worker.deliver_due()
        assert again.counts == ()

    with_client(body)
    assert sorted(keys_arrived(receiver)) == sorted(e.dedup_key for e in events)  # any order


def test_receiver_down_then_back_gets_everything_in_order(receiver: Receiver) -> None:
    """Refused, then 503, then up: nothing lost, resolved never overtakes firing."""
    clock, outbox = FakeClock(), MemoryOutbox()
    firing = make_event()
    resolved = make_event(status="resolved")
    other = make_event(instance="vllm-1", incident_id="inc-2")
    receiver.stop()
    outbox.enqueue("hook", firing, clock())
    attempts_seen: list[float] = []

    async def body(client: httpx.AsyncClient) -> None:
        worker = worker_for(outbox, {"hook": WebhookNotifier("hook", receiver.url, client)}, clock)
        for step in range(20):
            if step == 1:
                outbox.enqueue("hook", resolved, clock())
                outbox.enqueue("hook", other, clock())
            if step == 3:
                receiver.start()
                receiver.answer(503, times=2)
            firing_due = any(i.dedup_key == firing.dedup_key for i in outbox.due(clock()))
            report = await worker.deliver_due()
            if firing_due:
                attempts_seen.append(clock() - START_WALL_S)
            assert report.count("hook", "given_up") == 0
            if not outbox.backlog():
                break
            clock.now_wall_s = min(i.next_attempt_wall_s for i in outbox.pending())

    with_client(body)
    arrived = keys_arrived(receiver)
    assert sorted(arrived) == sorted([firing.dedup_key, resolved.dedup_key, other.dedup_key])
    assert arrived.index(firing.dedup_key) < arrived.index(resolved.dedup_key)
    # The firing alert's lane retries on its own backoff: 1, 2, 4, ... s less jitter.
    assert len(attempts_seen) >= 4  # refused three times, then 503 or accepted
    expected, at = [0.0], 0.0
    for base in (1, 2, 4, 8, 16)[: len(attempts_seen) - 1]:
        at += base * JITTER
        expected.append(at)
    assert attempts_seen == pytest.approx(expected)


def test_no_attempt_before_the_backoff_expires(receiver: Receiver) -> None:
    clock, outbox = FakeClock(), MemoryOutbox()
    receiver.answer(503)
    outbox.enqueue("hook", make_event(), clock())

    async def body(client: httpx.AsyncClient) -> None:
        worker = worker_for(
            outbox,
            {"hook": WebhookNotifier("hook", receiver.url, client)},
            clock,
            backoff=Backoff(initial_s=10, factor=3, max_s=50, jitter_ratio=0.2),
        )
        delays = []
        for _ in range(4):
            await worker.deliver_due()
            (item,) = outbox.pending()
            delays.append(item.next_attempt_wall_s - clock())
            requests = len(receiver.received())
            clock.advance(delays[-1] - 0.01)
            await worker.deliver_due()
            assert len(receiver.received()) == requests  # not yet due
            clock.advance(0.01)
        assert delays == pytest.approx([10 * JITTER, 30 * JITTER, 50 * JITTER, 50 * JITTER])
        (item,) = outbox.pending()
        assert item.attempts == 4 and "503" in (item.last_error or "")

    with_client(body)


def test_backoff_caps_and_never_overflows() -> None:
    backoff = Backoff()
    assert backoff.delay_s(0, 0.0) == 1.0
    assert backoff.delay_s(3, 0.0) == 8.0
    assert backoff.delay_s(10, 0.0) == 300.0
    assert backoff.delay_s(5000, 0.999) == pytest.approx(300 * (1 - 0.2 * 0.999))
    with pytest.raises(ValueError):
        Backoff(initial_s=0)
    with pytest.raises(ValueError):
        Backoff(jitter_ratio=1.0)


def test_retry_after_is_honoured(receiver: Receiver) -> None:
    clock, outbox = FakeClock(), MemoryOutbox()
    receiver.answer(503, times=1, Retry_After="30")
    outbox.enqueue("hook", make_event(), clock())

    async def body(client: httpx.AsyncClient) -> None:
        worker = worker_for(outbox, {"hook": WebhookNotifier("hook", receiver.url, client)}, clock)
        await worker.deliver_due()
        (item,) = outbox.pending()
        assert item.next_attempt_wall_s == pytest.approx(clock() + 30)

    with_client(body)


def test_a_rejected_notification_is_given_up_once(receiver: Receiver) -> None:
    """Its alert's later event still goes."""
    clock, outbox = FakeClock(), MemoryOutbox()
    receiver.answer(400, times=1)
    rejected, fine = make_event(), make_event(status="resolved")
    outbox.enqueue("hook", rejected, clock())
    outbox.enqueue("hook", fine, clock())

    async def body(client: httpx.AsyncClient) -> None:
        worker = worker_for(outbox, {"hook": WebhookNotifier("hook", receiver.url, client)}, clock)
        report = await worker.deliver_due()
        assert report.count("hook", "given_up") == 1
        assert report.count("hook", "delivered") == 1
        for _ in range(3):
            clock.advance(3600)
            await worker.deliver_due()

    with_client(body)
    assert len(receiver.received()) == 2  # one each, the rejected one never again
    (gone,) = [f for f in outbox.finished() if not f.delivered]
    assert gone.item.event == rejected and "400" in (gone.item.last_error or "")
    assert outbox.backlog() == 0


def test_gives_up_after_max_age(receiver: Receiver) -> None:
    clock, outbox = FakeClock(), MemoryOutbox()
    receiver.answer(503)
    outbox.enqueue("hook", make_event(), clock())

    async def body(client: httpx.AsyncClient) -> None:
        worker = worker_for(
            outbox, {"hook": WebhookNotifier("hook", receiver.url, client)}, clock, max_age_s=600
        )
        while outbox.backlog():
            assert clock() - START_WALL_S < 600 + 300, "kept retrying past max_age_s"
            await worker.deliver_due()
            if outbox.backlog():
                clock.now_wall_s = outbox.pending()[0].next_attempt_wall_s

    with_client(body)
    (gone,) = outbox.finished()
    assert not gone.delivered
    assert gone.item.last_error is not None and gone.item.last_error.startswith("gave up after 600")
    assert 5 <= len(receiver.received()) <= 12  # retried with backoff, then stopped


def test_one_notifier_down_does_not_hold_up_another(receiver: Receiver) -> None:
    clock, outbox = FakeClock(), MemoryOutbox()
    down = Receiver().start()
    down.hang()  # answers only when released: the slow kind of down
    for i in range(5):
        outbox.enqueue("down", make_event(instance=f"vllm-{i}"), clock())
    slack_event = make_event(instance="vllm-9")
    outbox.enqueue("slack", slack_event, clock())

    async def body(client: httpx.AsyncClient) -> None:
        notifiers: dict[str, Notifier] = {
            "down": WebhookNotifier("down", down.url, client, timeout_s=20),
            "slack": SlackNotifier("slack", SecretStr(receiver.url + "/s"), client),
        }
        tally = Tally(worker_for(outbox, notifiers, clock, batch_limit=3, pass_wait_s=0.05))
        await tally.deliver()  # the 3 oldest, all for "down": they hang
        await tally.deliver()  # the rest: slack goes beside them
        await eventually(lambda: len(receiver.accepted()) == 1, "slack's notification")
        assert len(down.arrived()) <= 5 and not down.received()  # still hanging
        down.release()
        await tally.settle()
        assert tally.counts == {("down", "delivered"): 5, ("slack", "delivered"): 1}

    try:
        with_client(body)
    finally:
        down.stop()
    assert outbox.backlog() == 0


def test_duplicates_carry_the_same_dedup_key(receiver: Receiver) -> None:
    """A crash between sending and recording sends again: the receiver can tell."""

    class ForgetfulOutbox(MemoryOutbox):
        def __init__(self) -> None:
            super().__init__()
            self.fail_next_mark = True

        def mark_delivered(self, item_ids, now_wall_s) -> None:
            if self.fail_next_mark:
                self.fail_next_mark = False
                raise OSError("disk I/O error")
            super().mark_delivered(item_ids, now_wall_s)

    clock, outbox = FakeClock(), ForgetfulOutbox()
    events = [make_event(), make_event(status="resolved")]
    for event in events:
        outbox.enqueue("hook", event, clock())

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {"hook": WebhookNotifier("hook", receiver.url, client)}
        first = await worker_for(outbox, notifiers, clock).deliver_due()
        assert first.errors and "disk I/O error" in first.errors[0][1]
        # A new worker, as after a restart, over the same (persistent) outbox.
        await worker_for(outbox, notifiers, clock).deliver_due()

    with_client(body)
    assert outbox.backlog() == 0
    by_key: dict[str, list[bytes]] = defaultdict(list)
    for request in receiver.accepted():
        by_key[request.headers["x-kvpilot-dedup-key"]].append(request.body)
    assert set(by_key) == {e.dedup_key for e in events}
    # The first went twice (its record failed, which ended the lane); the second once.
    assert [len(by_key[e.dedup_key]) for e in events] == [2, 1]
    for bodies in by_key.values():
        assert len(set(bodies)) == 1  # a duplicate is the same notification


def test_a_new_worker_sends_at_once_what_an_earlier_one_held_back(receiver: Receiver) -> None:
    """The agent started again owes its backlog now, not after the last process's backoff."""
    clock, outbox = FakeClock(), MemoryOutbox()
    receiver.answer(503, times=6)
    firing, resolved = make_event(), make_event(status="resolved")
    outbox.enqueue("hook", firing, clock())

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {"hook": WebhookNotifier("hook", receiver.url, client)}
        first = worker_for(outbox, notifiers, clock)
        for _ in range(6):  # refused six times: the next try is 32 s (less jitter) away
            assert (await first.deliver_due()).count("hook", "retry") == 1
            clock.now_wall_s = outbox.pending()[0].next_attempt_wall_s
        clock.now_wall_s -= 10.0
        outbox.enqueue("hook", resolved, clock())
        assert outbox.due(clock()) == [outbox.pending()[1]]  # the firing one is held back
        assert (await first.deliver_due()).count("hook", "deferred") == 1
        # The agent starts again before the held-back time: the new worker sends both, in order.
        again = worker_for(outbox, notifiers, clock)
        assert (await again.deliver_due()).count("hook", "delivered") == 2

    with_client(body)
    assert keys_arrived(receiver) == [firing.dedup_key, resolved.dedup_key]
    assert outbox.backlog() == 0


def test_unknown_notifier_is_given_up_and_recorded() -> None:
    clock, outbox = FakeClock(), MemoryOutbox()
    outbox.enqueue("gone", make_event(), clock())

    async def body(client: httpx.AsyncClient) -> None:
        report = await worker_for(outbox, {}, clock).deliver_due()
        assert report.count("gone", "given_up") == 1

    with_client(body)
    (gone,) = outbox.finished()
    assert "not configured" in (gone.item.last_error or "")


def test_never_raises() -> None:
    class Broken:
        name = "broken"

        async def send(self, events: list[AlertEvent]) -> None:
            raise RuntimeError("bug")

    class BrokenOutbox(MemoryOutbox):
        def due(self, now_wall_s, limit=100, *, notifier=None):
            raise OSError("database is locked")

    clock, outbox, broken = FakeClock(), MemoryOutbox(), BrokenOutbox()
    outbox.enqueue("broken", make_event(), clock())
    broken.enqueue("broken", make_event(), clock())

    async def body(client: httpx.AsyncClient) -> None:
        report = await worker_for(outbox, {"broken": Broken()}, clock).deliver_due()
        assert report.count("broken", "retry") == 1
        assert "RuntimeError" in report.errors[0][1]
        report = await worker_for(broken, {}, clock).deliver_due()
        assert report.backlog_items is None and "database is locked" in (
            report.backlog_reason or ""
        )

    with_client(body)


def test_a_lane_in_progress_is_not_doubled(receiver: Receiver) -> None:
    clock, outbox = FakeClock(), MemoryOutbox()
    outbox.enqueue("hook", make_event(), clock())
    receiver.hang()

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {"hook": WebhookNotifier("hook", receiver.url, client)}
        worker = worker_for(outbox, notifiers, clock, pass_wait_s=0.1)
        first = await worker.deliver_due()  # its lane waits for the receiver
        second = await worker.deliver_due()
        assert first.counts == () and second.counts == ()
        receiver.release()
        await worker.aclose(grace_s=10.0)
        assert (await worker.deliver_due()).count("hook", "delivered") == 1  # reported later

    with_client(body)
    assert len(receiver.received()) == 1


def test_a_slow_alert_holds_up_no_other_alert(receiver: Receiver) -> None:
    clock, outbox = FakeClock(), MemoryOutbox()
    slow, fast = make_event(instance="vllm-0"), make_event(instance="vllm-1")
    later = make_event(instance="vllm-2")
    receiver.hang_alert(slow.fingerprint)
    for event in (slow, fast):
        outbox.enqueue("hook", event, clock())

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {"hook": WebhookNotifier("hook", receiver.url, client, timeout_s=20)}
        tally = Tally(worker_for(outbox, notifiers, clock, pass_wait_s=0.05))
        await tally.deliver()
        await eventually(lambda: fast.dedup_key in keys_arrived(receiver), "fast, beside slow")
        outbox.enqueue("hook", later, clock())
        for _ in range(3):
            await tally.deliver()
        await eventually(lambda: later.dedup_key in keys_arrived(receiver), "later, too")
        assert receiver.arrived().count(slow.dedup_key) == 1  # never sent twice meanwhile
        receiver.release()
        await tally.settle()
        assert tally.counts == {("hook", "delivered"): 3}

    with_client(body)
    assert outbox.backlog() == 0
    assert keys_arrived(receiver)[-1] == slow.dedup_key


def test_an_alerts_resolved_waits_behind_its_slow_firing(receiver: Receiver) -> None:
    clock, outbox = FakeClock(), MemoryOutbox()
    firing, resolved = make_event(), make_event(status="resolved")
    receiver.hang_alert(firing.fingerprint)
    outbox.enqueue("hook", firing, clock())

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {"hook": WebhookNotifier("hook", receiver.url, client, timeout_s=20)}
        tally = Tally(worker_for(outbox, notifiers, clock, pass_wait_s=0.05))
        await tally.deliver()
        await eventually(lambda: receiver.arrived() == [firing.dedup_key], "the firing one")
        outbox.enqueue("hook", resolved, clock())
        for _ in range(3):
            await tally.deliver()
        assert receiver.arrived() == [firing.dedup_key]  # the resolved one waits its turn
        receiver.release()
        await tally.settle()  # firing through; its lane done
        await tally.settle()  # now resolved
        assert tally.counts == {("hook", "delivered"): 2}

    with_client(body)
    assert keys_arrived(receiver) == [firing.dedup_key, resolved.dedup_key]


def test_lanes_per_notifier_are_bounded_and_rows_they_hold_crowd_out_nothing(
    receiver: Receiver,
) -> None:
    clock, outbox = FakeClock(), MemoryOutbox()
    down = Receiver().start()
    down.hang()
    for i in range(4):
        outbox.enqueue("down", make_event(instance=f"vllm-{i}"), clock())
    outbox.enqueue("hook", make_event(instance="vllm-9"), clock())

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {
            "down": WebhookNotifier("down", down.url, client, timeout_s=20),
            "hook": WebhookNotifier("hook", receiver.url, client),
        }
        worker = worker_for(
            outbox, notifiers, clock, batch_limit=2, lanes_per_notifier=2, pass_wait_s=0.05
        )
        tally = Tally(worker)
        await tally.deliver()  # the two oldest rows: two lanes of "down", hanging
        await tally.deliver()  # reads past them and the two with no room: "hook" goes
        await eventually(lambda: len(receiver.accepted()) == 1, "hook's notification")
        for _ in range(3):
            await tally.deliver()
        await eventually(lambda: len(down.arrived()) == 2, "two requests to down")
        assert worker.lanes_running() == 2 and len(down.arrived()) == 2  # never more
        down.release()
        await tally.settle()
        await tally.settle()  # the two that had no room
        assert tally.counts == {("down", "delivered"): 4, ("hook", "delivered"): 1}

    try:
        with_client(body)
    finally:
        down.stop()
    assert outbox.backlog() == 0


def test_one_pass_starts_no_more_lanes_than_the_bound(receiver: Receiver) -> None:
    clock, outbox = FakeClock(), MemoryOutbox()
    receiver.hang()
    for i in range(5):
        outbox.enqueue("hook", make_event(instance=f"vllm-{i}"), clock())

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {"hook": WebhookNotifier("hook", receiver.url, client, timeout_s=20)}
        worker = worker_for(outbox, notifiers, clock, lanes_per_notifier=2, pass_wait_s=0.05)
        tally = Tally(worker)
        for _ in range(3):
            await tally.deliver()
        await eventually(lambda: len(receiver.arrived()) == 2, "two requests")
        assert worker.lanes_running() == 2 and len(receiver.arrived()) == 2
        receiver.release()
        for _ in range(3):  # two lanes at a time, oldest alerts first
            await tally.settle()
        assert tally.counts == {("hook", "delivered"): 5}

    with_client(body)
    assert outbox.backlog() == 0


def test_aclose_cancels_lanes_that_do_not_finish_and_keeps_their_items(
    receiver: Receiver,
) -> None:
    clock, outbox = FakeClock(), MemoryOutbox()
    event = make_event()
    outbox.enqueue("hook", event, clock())
    receiver.hang()

    async def body(client: httpx.AsyncClient) -> None:
        notifiers = {"hook": WebhookNotifier("hook", receiver.url, client, timeout_s=20)}
        worker = worker_for(outbox, notifiers, clock, pass_wait_s=0.1)
        await worker.deliver_due()
        await worker.aclose(grace_s=0.1)
        assert worker.lanes_running() == 0

    try:
        with_client(body)
    finally:
        receiver.release()
    (item,) = outbox.pending()
    assert item.event == event and item.attempts == 0  # sent again on the next start


def test_items_enqueued_during_backoff_wait_behind_older_ones(receiver: Receiver) -> None:
    clock, outbox = FakeClock(), MemoryOutbox()
    receiver.answer(503, times=1)
    firing, resolved = make_event(), make_event(status="resolved")
    outbox.enqueue("hook", firing, clock())

    async def body(client: httpx.AsyncClient) -> None:
        worker = worker_for(outbox, {"hook": WebhookNotifier("hook", receiver.url, client)}, clock)
        assert (await worker.deliver_due()).count("hook", "retry") == 1
        clock.advance(0.3)
        outbox.enqueue("hook", resolved, clock())
        report = await worker.deliver_due()
        assert report.count("hook", "deferred") == 1
        assert len(receiver.received()) == 1  # the resolved one was not sent ahead
        assert {i.next_attempt_wall_s for i in outbox.pending()} == {START_WALL_S + JITTER}
        clock.now_wall_s = START_WALL_S + JITTER
        assert (await worker.deliver_due()).count("hook", "delivered") == 2

    with_client(body)
    assert keys_arrived(receiver) == [firing.dedup_key, resolved.dedup_key]
