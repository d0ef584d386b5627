"""A receiver that answers with a body without end costs the agent the answer's cap, not the
body: the notifier reads what it needs of the answer and leaves the rest unread."""

from __future__ import annotations

import asyncio
import time
import tracemalloc

import httpx
import pytest
from pydantic import SecretStr

from kvpilot.agent.model import AlertEvent
from kvpilot.agent.notify.alertmanager import AlertmanagerNotifier
from kvpilot.agent.notify.base import DeliveryError, Notifier
from kvpilot.agent.notify.slack import SlackNotifier
from kvpilot.agent.notify.webhook import WebhookNotifier
from tests.faults.misbehaving import Misbehaving, endless

MIB = 1 << 20
HUGE_BYTES = 256 * MIB  # what the receiver would send, if it were read
TIMEOUT_S = 5.0
EVENT = AlertEvent(
    fingerprint="f" * 16,
    incident_id="i-1",
    status="firing",
    labels=(("alertname", "KvCacheSaturated"), ("instance", "vllm")),
    annotations=(("summary", "full"),),
    starts_at_wall_s=1_700_000_000.0,
    ends_at_wall_s=None,
    generator_url="",
)


def _notifier(kind: str, url: str, client: httpx.AsyncClient) -> Notifier:
    if kind == "webhook":
        return WebhookNotifier("hook", url, client, timeout_s=TIMEOUT_S)
    if kind == "slack":
        return SlackNotifier("chat", SecretStr(url), client, timeout_s=TIMEOUT_S)
    return AlertmanagerNotifier("am", url, client, timeout_s=TIMEOUT_S)


async def _send(kind: str, url: str) -> tuple[DeliveryError | None, float, int]:
    """The outcome, the seconds it took and the bytes of peak allocation while sending."""
    async with httpx.AsyncClient() as client:
        notifier = _notifier(kind, url, client)
        tracemalloc.start()
        began = time.monotonic()
        try:
            await notifier.send([EVENT])
            error = None
        except DeliveryError as exc:
            error = exc
        took = time.monotonic() - began
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return error, took, peak


@pytest.mark.parametrize("kind", ["webhook", "slack", "alertmanager"])
@pytest.mark.parametrize("status", [200, 503])
def test_a_huge_answer_is_read_only_up_to_its_cap(kind: str, status: int) -> None:
    route = endless(HUGE_BYTES, b"<html>" + b"x" * 65530, status=status)
    paths = {"webhook": "/hook", "slack": "/hook", "alertmanager": "/api/v2/alerts"}
    with Misbehaving({paths[kind]: route}) as receiver:
        url = receiver.url + ("/hook" if kind != "alertmanager" else "")
        error, took_s, peak = asyncio.run(_send(kind, url))
        assert took_s < TIMEOUT_S, f"{took_s:.1f} s: the whole answer was read"
        assert peak < 8 * MIB, f"{peak / MIB:.0f} MiB allocated while sending"
    if status == 200:
        assert error is None, error
    else:
        assert error is not None and error.retryable
        assert error.message.startswith(f"{_name(kind)}: HTTP 503: <html>xxx")


def _name(kind: str) -> str:
    return {"webhook": "hook", "slack": "chat", "alertmanager": "am"}[kind]
