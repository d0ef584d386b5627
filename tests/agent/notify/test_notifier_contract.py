"""One contract for every notifier, each against a real HTTP receiver on loopback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import pytest
from pydantic import SecretStr

from kvpilot.agent.model import AlertEvent
from kvpilot.agent.notify import (
    AlertmanagerNotifier,
    DeliveryError,
    Notifier,
    SlackNotifier,
    WebhookNotifier,
)
from tests.agent.notify.notify_helpers import make_event
from tests.agent.notify.notify_receiver import Received, Receiver

TOKEN = "tok-3f9a1c77e2"  # secret material that must never show in a repr or an error


@dataclass(frozen=True, slots=True)
class Kind:
    """How to build one notifier against a receiver, and which events a request carried."""

    name: str
    build: Callable[[str, httpx.AsyncClient], Notifier]
    path: str
    events_in: Callable[[Received], list[str]]  # the fingerprints a request carried


def _webhook(url: str, client: httpx.AsyncClient) -> Notifier:
    return WebhookNotifier(
        "hook",
        f"{url}/hook/{TOKEN}",
        client,
        secret=SecretStr(TOKEN),
        headers={"Authorization": f"Bearer {TOKEN}"},
    )


def _alertmanager(url: str, client: httpx.AsyncClient) -> Notifier:
    return AlertmanagerNotifier("am", url, client, bearer_token=SecretStr(TOKEN))


def _slack(url: str, client: httpx.AsyncClient) -> Notifier:
    return SlackNotifier("slack", SecretStr(f"{url}/services/T0/B0/{TOKEN}"), client)


def _fingerprint_of_labels(labels: dict[str, str]) -> str:
    from kvpilot.agent.model import fingerprint, labels_of

    return fingerprint(labels_of(labels))


KINDS = [
    Kind(
        "webhook",
        _webhook,
        f"/hook/{TOKEN}",
        lambda r: [a["fingerprint"] for a in r.json()["alerts"]],
    ),
    Kind(
        "alertmanager",
        _alertmanager,
        "/api/v2/alerts",
        lambda r: [_fingerprint_of_labels(a["labels"]) for a in r.json()],
    ),
    Kind(
        "slack",
        _slack,
        f"/services/T0/B0/{TOKEN}",
        lambda r: [r.json()["blocks"][1]["elements"][0]["text"].split("fingerprint ")[1][:16]],
    ),
]


@pytest.fixture(params=KINDS, ids=lambda k: k.name)
def kind(request: pytest.FixtureRequest) -> Kind:
    return request.param


def run(kind: Kind, receiver: Receiver, body: Callable[[Notifier], Awaitable[None]]) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(0.5)) as client:
            await body(kind.build(receiver.url, client))

    asyncio.run(main())


def two_events() -> list[AlertEvent]:
    return [make_event(instance="vllm-0"), make_event(instance="vllm-1", incident_id="inc-2")]


def test_is_a_notifier_with_a_name(kind: Kind, receiver: Receiver) -> None:
    async def body(notifier: Notifier) -> None:
        assert isinstance(notifier, Notifier)
        assert notifier.name in {"hook", "am", "slack"}

    run(kind, receiver, body)


def test_every_event_arrives_in_order_as_json(kind: Kind, receiver: Receiver) -> None:
    events = two_events()
    run(kind, receiver, lambda n: n.send(events))
    got = receiver.received()
    assert got, "nothing arrived"
    assert all(r.method == "POST" and r.path == kind.path for r in got)
    assert all(r.headers["content-type"] == "application/json" for r in got)
    carried = [fp for r in got for fp in kind.events_in(r)]
    assert carried == [e.fingerprint for e in events]


def test_nothing_to_send_sends_nothing(kind: Kind, receiver: Receiver) -> None:
    run(kind, receiver, lambda n: n.send([]))
    assert receiver.received() == []


@pytest.mark.parametrize("status", [500, 502, 503, 408, 429])
def test_server_trouble_is_retryable(kind: Kind, receiver: Receiver, status: int) -> None:
    receiver.answer(status)

    async def body(notifier: Notifier) -> None:
        with pytest.raises(DeliveryError) as caught:
            await notifier.send([make_event()])
        assert caught.value.retryable
        assert str(status) in caught.value.message

    run(kind, receiver, body)
    assert len(receiver.received()) == 1


@pytest.mark.parametrize("status", [400, 401, 403, 404, 410, 422])
def test_a_rejected_request_is_not_retryable(kind: Kind, receiver: Receiver, status: int) -> None:
    receiver.answer(status)

    async def body(notifier: Notifier) -> None:
        with pytest.raises(DeliveryError) as caught:
            await notifier.send([make_event()])
        assert not caught.value.retryable
        assert caught.value.dedup_key == make_event().dedup_key
        assert TOKEN not in str(caught.value)

    run(kind, receiver, body)


def test_a_receiver_that_is_down_is_retryable(kind: Kind, receiver: Receiver) -> None:
    receiver.stop()

    async def body(notifier: Notifier) -> None:
        with pytest.raises(DeliveryError) as caught:
            await notifier.send([make_event()])
        assert caught.value.retryable
        assert TOKEN not in str(caught.value)

    run(kind, receiver, body)


def test_a_receiver_that_hangs_times_out_retryably(kind: Kind, receiver: Receiver) -> None:
    receiver.hang()

    async def body(notifier: Notifier) -> None:
        with pytest.raises(DeliveryError) as caught:
            await notifier.send([make_event()])
        assert caught.value.retryable
        assert "timed out" in caught.value.message

    try:
        run(kind, receiver, body)
    finally:
        receiver.release()


def test_retry_after_is_passed_on(kind: Kind, receiver: Receiver) -> None:
    receiver.answer(429, Retry_After="7")

    async def body(notifier: Notifier) -> None:
        with pytest.raises(DeliveryError) as caught:
            await notifier.send([make_event()])
        assert caught.value.retry_after_s == 7.0

    run(kind, receiver, body)


def test_what_it_says_arrived_is_what_arrived(kind: Kind, receiver: Receiver) -> None:
    """The first request is accepted, the rest get 503: `delivered` names exactly those."""
    events = two_events()
    receiver.answer(200, times=1)
    receiver.answer(503)
    said: set[str] = set()

    async def body(notifier: Notifier) -> None:
        try:
            await notifier.send(events)
            said.update(e.dedup_key for e in events)
        except DeliveryError as err:
            assert err.retryable
            said.update(err.delivered)

    run(kind, receiver, body)
    arrived = {fp for r in receiver.accepted() for fp in kind.events_in(r)}
    assert said == {e.dedup_key for e in events if e.fingerprint in arrived}
    assert arrived  # the first request was accepted


def test_secrets_stay_out_of_repr(kind: Kind, receiver: Receiver) -> None:
    async def body(notifier: Notifier) -> None:
        text = repr(notifier)
        assert TOKEN not in text
        assert notifier.name in text

    run(kind, receiver, body)


def test_the_request_is_plain_json(kind: Kind, receiver: Receiver) -> None:
    run(kind, receiver, lambda n: n.send([make_event()]))
    (request,) = receiver.received()
    assert json.loads(request.body) == request.json()
    assert request.json()  # not empty
