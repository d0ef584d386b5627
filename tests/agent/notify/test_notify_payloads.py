"""What each notifier puts on the wire: Alertmanager's v4 webhook, postable alerts, Slack."""

from __future__ import annotations

import asyncio
import base64
from datetime import datetime

import httpx
import pytest
from pydantic import SecretStr

from kvpilot.agent.notify import (
    AlertmanagerNotifier,
    DeliveryError,
    SlackNotifier,
    WebhookNotifier,
    sign,
    verify_signature,
)
from kvpilot.agent.notify.slack import message_of
from tests.agent.notify.notify_helpers import START_WALL_S, FakeClock, make_event
from tests.agent.notify.notify_receiver import Receiver

V4_KEYS = {
    "version",
    "groupKey",
    "truncatedAlerts",
    "status",
    "receiver",
    "groupLabels",
    "commonLabels",
    "commonAnnotations",
    "externalURL",
    "alerts",
}
ALERT_KEYS = {
    "status",
    "labels",
    "annotations",
    "startsAt",
    "endsAt",
    "generatorURL",
    "fingerprint",
}


def parse_rfc3339(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def send(notifier_factory, events) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(timeout=2.0) as client:
            await notifier_factory(client).send(events)

    asyncio.run(main())


def test_webhook_sends_alertmanager_v4_payload(receiver: Receiver) -> None:
    firing = make_event()
    resolved = make_event(status="resolved", ends_at_wall_s=START_WALL_S + 95.5)
    send(
        lambda c: WebhookNotifier(
            "ops",
            receiver.url + "/hook",
            c,
            external_url="http://kvpilot:9400",
            headers={"Authorization": "Bearer abc"},
        ),
        [firing, resolved],
    )
    first, second = (r.json() for r in receiver.received())
    for payload, event in ((first, firing), (second, resolved)):
        assert set(payload) == V4_KEYS
        assert payload["version"] == "4"
        assert payload["status"] == event.status
        assert payload["receiver"] == "ops"
        assert payload["externalURL"] == "http://kvpilot:9400"
        assert payload["truncatedAlerts"] == 0
        assert payload["groupLabels"] == payload["commonLabels"] == dict(event.labels)
        (alert,) = payload["alerts"]
        assert set(alert) == ALERT_KEYS
        assert alert["status"] == event.status
        assert alert["labels"] == dict(event.labels)
        assert alert["annotations"]["summary"] == dict(event.annotations)["summary"]
        assert alert["annotations"]["kvpilot_incident_id"] == event.incident_id
        assert payload["commonAnnotations"] == alert["annotations"]
        assert alert["fingerprint"] == event.fingerprint
        assert alert["generatorURL"] == event.generator_url
        assert parse_rfc3339(alert["startsAt"]) == pytest.approx(event.starts_at_wall_s, abs=1e-3)
        assert alert["startsAt"].endswith("Z")
    assert first["alerts"][0]["endsAt"] == "0001-01-01T00:00:00Z"
    assert parse_rfc3339(second["alerts"][0]["endsAt"]) == pytest.approx(START_WALL_S + 95.5)
    # Alertmanager's group key: route key, then the group's labels, sorted and quoted.
    assert first["groupKey"].startswith('{}:{alertname="VllmKvFragmentationHigh", engine="0"')
    assert first["groupKey"] == second["groupKey"]
    headers = [r.headers for r in receiver.received()]
    assert [h["x-kvpilot-dedup-key"] for h in headers] == [firing.dedup_key, resolved.dedup_key]
    assert all(h["authorization"] == "Bearer abc" for h in headers)
    assert all("x-kvpilot-signature" not in h for h in headers)


def test_signed_webhook_verifies_at_the_receiver() -> None:
    clock = FakeClock(1_760_000_100.0)
    receiver = Receiver(secret="s3cret", now=clock).start()
    try:
        send(
            lambda c: WebhookNotifier(
                "ops", receiver.url, c, secret=SecretStr("s3cret"), clock=clock
            ),
            [make_event()],
        )
        (request,) = receiver.received()
        assert request.signature_ok is True and request.accepted
        assert request.headers["x-kvpilot-timestamp"] == "1760000100"
        assert request.headers["x-kvpilot-signature"].startswith("sha256=")
    finally:
        receiver.stop()


@pytest.mark.parametrize("secret", [SecretStr("wrong"), None])
def test_bad_or_missing_signature_is_refused_for_good(secret: SecretStr | None) -> None:
    receiver = Receiver(secret="s3cret").start()
    try:
        with pytest.raises(DeliveryError) as caught:
            send(lambda c: WebhookNotifier("ops", receiver.url, c, secret=secret), [make_event()])
        assert not caught.value.retryable
        (request,) = receiver.received()
        assert request.signature_ok is False and request.status == 401
    finally:
        receiver.stop()


def test_verify_signature() -> None:
    body = b'{"version":"4"}'
    header = sign("k", 1000, body)
    assert verify_signature("k", "1000", body, header, now=1000.0)
    assert verify_signature(SecretStr("k"), 1000, body, header, now=1299.0)
    assert verify_signature(b"k", 1000, body, header, now=701.0)
    assert not verify_signature("k", "1000", body + b" ", header, now=1000.0)  # tampered
    assert not verify_signature("other", "1000", body, header, now=1000.0)
    assert not verify_signature("k", "1001", body, header, now=1000.0)  # other timestamp
    assert not verify_signature("k", "1000", body, header, now=1301.0)  # replayed late
    assert not verify_signature("k", "1000", body, header, now=1000.0 + 11, tolerance_s=10)
    assert not verify_signature("k", "1000", body, None, now=1000.0)
    assert not verify_signature("k", "soon", body, header, now=1000.0)


def test_alertmanager_postable_alerts(receiver: Receiver) -> None:
    clock = FakeClock(START_WALL_S + 30)
    firing = make_event()
    resolved = make_event(status="resolved", ends_at_wall_s=START_WALL_S + 20)
    send(
        lambda c: AlertmanagerNotifier(
            "am",
            receiver.url + "/prefix/",
            c,
            resend_validity_s=120,
            clock=clock,
            username="kv",
            password=SecretStr("pw"),
        ),
        [firing, resolved],
    )
    (request,) = receiver.received()
    assert request.path == "/prefix/api/v2/alerts"
    assert request.headers["authorization"] == "Basic " + base64.b64encode(b"kv:pw").decode()
    first, second = request.json()
    assert set(first) == {"labels", "annotations", "startsAt", "endsAt", "generatorURL"}
    assert first["labels"] == dict(firing.labels)
    assert first["annotations"]["kvpilot_incident_id"] == firing.incident_id
    assert parse_rfc3339(first["startsAt"]) == pytest.approx(START_WALL_S, abs=1e-3)
    assert parse_rfc3339(first["endsAt"]) == pytest.approx(clock() + 120, abs=1e-3)
    assert parse_rfc3339(second["endsAt"]) == pytest.approx(START_WALL_S + 20, abs=1e-3)


def test_alertmanager_settings_are_checked() -> None:
    client = httpx.AsyncClient()
    with pytest.raises(ValueError, match="resend_validity_s"):
        AlertmanagerNotifier("am", "http://x", client, resend_validity_s=0)
    with pytest.raises(ValueError, match="either"):
        AlertmanagerNotifier("am", "http://x", client, username="u", bearer_token=SecretStr("t"))


def test_slack_text_reads_as_a_sentence(receiver: Receiver) -> None:
    firing = make_event()
    resolved = make_event(status="resolved", ends_at_wall_s=START_WALL_S + 95)
    assert message_of(firing) == (
        "[FIRING] VllmKvFragmentationHigh on vllm-0 (model tiny-llama, engine 0, source kv_blocks):"
        " fragmentation 0.41 > 0.30 for 60 s"
    )
    assert message_of(resolved).startswith("[RESOLVED] VllmKvFragmentationHigh on vllm-0 (")
    assert message_of(resolved).endswith("(resolved after 1 min 35 s)")
    send(lambda c: SlackNotifier("slack", SecretStr(receiver.url + "/s"), c), [firing])
    (request,) = receiver.received()
    payload = request.json()
    # Slack's mrkdwn needs &, < and > escaped; nothing else changes.
    assert payload["text"] == message_of(firing).replace(">", "&gt;")
    assert payload["blocks"][0]["text"] == {"type": "mrkdwn", "text": payload["text"]}
    context = payload["blocks"][1]["elements"][0]["text"]
    assert firing.incident_id in context and firing.fingerprint in context
