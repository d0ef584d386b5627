"""The demo's webhook receiver: a real loopback server that checks kvpilot's HMAC signature."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from kvpilot.agent.cli.demo.receiver import Delivery, WebhookReceiver, read_delivery
from kvpilot.agent.notify.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign

SECRET = "demo-secret-0123456789"
BODY = json.dumps(
    {"status": "firing", "alerts": [{"labels": {"alertname": "VllmPreemptionSpike"}}]}
).encode()


def _post(url: str, body: bytes, headers: dict[str, str]) -> int:
    with httpx.Client(timeout=5.0) as client:
        return client.post(url, content=body, headers=headers).status_code


async def _exchange(headers_of: list[dict[str, str]]) -> tuple[list[int], list[Delivery]]:
    seen: list[Delivery] = []
    async with WebhookReceiver(SECRET, on_delivery=seen.append) as receiver:
        codes = [
            await asyncio.to_thread(_post, receiver.url, BODY, headers) for headers in headers_of
        ]
    return codes, seen


def _signed(secret: str, stamp: int) -> dict[str, str]:
    return {TIMESTAMP_HEADER: str(stamp), SIGNATURE_HEADER: sign(secret, stamp, BODY)}


def test_a_signed_delivery_is_verified_and_a_forged_one_refused() -> None:
    now = int(time.time())
    codes, seen = asyncio.run(_exchange([_signed(SECRET, now), _signed("another-secret", now), {}]))
    assert codes == [200, 401, 401]
    assert [d.verified for d in seen] == [True, False, False]
    assert seen[0].describe() == "VllmPreemptionSpike firing (signature verified)"
    assert "INVALID" in seen[1].describe()


def test_a_replayed_delivery_outside_the_tolerance_is_refused() -> None:
    codes, seen = asyncio.run(_exchange([_signed(SECRET, int(time.time()) - 3600)]))
    assert codes == [401]
    assert not seen[0].verified


def test_a_body_that_is_no_payload_is_read_without_raising() -> None:
    assert read_delivery(b"\xff not json", True, 1.0) == Delivery(1.0, True, "?", ())
    assert read_delivery(b"[1, 2]", False, 1.0).status == "?"
    odd = json.dumps({"status": 3, "alerts": [None, {"labels": []}, {"labels": {"alertname": 7}}]})
    assert read_delivery(odd.encode(), True, 1.0).alertnames == ()
    two = json.dumps(
        {"status": "resolved", "alerts": [{"labels": {"alertname": n}} for n in "aab"]}
    )
    assert read_delivery(two.encode(), True, 1.0).alertnames == ("a", "b")
