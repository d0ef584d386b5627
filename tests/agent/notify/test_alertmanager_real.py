"""The Alertmanager notifier against a real Alertmanager, checked through Alertmanager's API."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from datetime import datetime

import httpx
import pytest

from kvpilot.agent.notify import (
    AlertmanagerNotifier,
    DeliveryError,
    DeliveryWorker,
)
from tests.agent.notify.alertmanager_server import AlertmanagerServer
from tests.agent.notify.notify_helpers import make_event
from tests.fakes.outbox import MemoryOutbox

pytestmark = pytest.mark.slow


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        time.sleep(0.05)


def ours(am: AlertmanagerServer, alertname: str) -> list[dict]:
    return [a for a in am.alerts() if a["labels"].get("alertname") == alertname]


def parse(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def test_firing_shows_in_alertmanager_and_resolved_leaves(alertmanager: AlertmanagerServer) -> None:
    alertname = f"KvTest{uuid.uuid4().hex[:8]}"
    started = time.time() - 30
    firing = make_event(alertname, starts_at_wall_s=started)

    async def push(event) -> None:
        async with httpx.AsyncClient(timeout=5.0) as client:
            await AlertmanagerNotifier("am", alertmanager.url, client, resend_validity_s=240).send(
                [event]
            )

    sent_at = time.time()
    asyncio.run(push(firing))
    wait_for(lambda: len(ours(alertmanager, alertname)) == 1)
    (alert,) = ours(alertmanager, alertname)
    assert alert["labels"] == dict(firing.labels)
    assert alert["annotations"]["kvpilot_incident_id"] == firing.incident_id
    assert alert["status"]["state"] == "active"
    assert parse(alert["startsAt"]) == pytest.approx(started, abs=1e-3)
    assert parse(alert["endsAt"]) == pytest.approx(sent_at + 240, abs=5)

    resolved = make_event(
        alertname, status="resolved", starts_at_wall_s=started, ends_at_wall_s=time.time()
    )
    asyncio.run(push(resolved))
    wait_for(lambda: ours(alertmanager, alertname) == [])


def test_an_invalid_alert_is_refused_for_good(alertmanager: AlertmanagerServer) -> None:
    bad = make_event(f"KvTest{uuid.uuid4().hex[:8]}", extra_labels={"bad label": "x"})

    async def push() -> None:
        async with httpx.AsyncClient(timeout=5.0) as client:
            await AlertmanagerNotifier("am", alertmanager.url, client).send([bad])

    with pytest.raises(DeliveryError) as caught:
        asyncio.run(push())
    assert not caught.value.retryable
    assert "400" in caught.value.message


def test_worker_delivers_through_alertmanager(alertmanager: AlertmanagerServer) -> None:
    """Outbox to worker to Alertmanager; a bad alert in the batch does not sink the good one."""
    good = make_event(f"KvTest{uuid.uuid4().hex[:8]}", starts_at_wall_s=time.time())
    bad = make_event(f"KvTest{uuid.uuid4().hex[:8]}", extra_labels={"bad label": "x"})
    outbox = MemoryOutbox()
    outbox.enqueue("am", bad, time.time())
    outbox.enqueue("am", good, time.time())

    async def main():
        async with httpx.AsyncClient(timeout=5.0) as client:
            notifier = AlertmanagerNotifier("am", alertmanager.url, client)
            worker = DeliveryWorker(outbox, {"am": notifier}, clock=time.time, pass_wait_s=10.0)
            return await worker.deliver_due()

    report = asyncio.run(main())
    assert report.count("am", "delivered") == 1
    assert report.count("am", "given_up") == 1
    assert [f.item.event for f in outbox.finished() if not f.delivered] == [bad]
    wait_for(lambda: len(ours(alertmanager, dict(good.labels)["alertname"])) == 1)


def test_a_flood_of_alerts_reaches_alertmanager_in_batches(
    alertmanager: AlertmanagerServer,
) -> None:
    """Three hundred alerts, each its own lane, go in lists of up to 64 that the real
    Alertmanager takes whole: a pass reads 100 due rows (two requests, 64 and 36)."""
    alertname = f"KvTest{uuid.uuid4().hex[:8]}"
    outbox = MemoryOutbox()
    for n in range(300):
        event = make_event(alertname, instance=f"vllm-{n}", starts_at_wall_s=time.time())
        outbox.enqueue("am", event, time.time())

    async def main():
        async with httpx.AsyncClient(timeout=5.0) as client:
            notifier = AlertmanagerNotifier("am", alertmanager.url, client)
            worker = DeliveryWorker(outbox, {"am": notifier}, clock=time.time, pass_wait_s=10.0)
            return [await worker.deliver_due() for _ in range(3)]

    reports = asyncio.run(main())
    assert [r.count("am", "delivered") for r in reports] == [100, 100, 100]
    assert all(r.errors == () for r in reports)
    wait_for(lambda: len(ours(alertmanager, alertname)) == 300)
