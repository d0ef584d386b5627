"""Slack-compatible incoming webhook: one readable message per event."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx
from pydantic import SecretStr

from kvpilot.agent.model import AlertEvent
from kvpilot.agent.notify.base import post, redacted_url
from kvpilot.collectors.secrets import url_secrets


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes} min"
    if minutes:
        return f"{minutes} min {secs} s"
    return f"{secs} s"


def message_of(event: AlertEvent) -> str:
    """One line, e.g. `[FIRING] VllmKvFragmentationHigh on vllm-0 (model m, engine 0): ...`."""
    labels = dict(event.labels)
    annotations = dict(event.annotations)
    text = f"[{event.status.upper()}] {labels.get('alertname', event.fingerprint)}"
    if "instance" in labels:
        text += f" on {labels['instance']}"
    where = [f"model {labels['model_name']}"] if "model_name" in labels else []
    if "engine" in labels:
        where.append(f"engine {labels['engine']}")
    if "source" in labels:
        where.append(f"source {labels['source']}")
    if where:
        text += f" ({', '.join(where)})"
    summary = annotations.get("summary") or annotations.get("description")
    if summary:
        text += f": {summary}"
    if event.status == "resolved" and event.ends_at_wall_s is not None:
        text += f" (resolved after {_duration(event.ends_at_wall_s - event.starts_at_wall_s)})"
    return text


def _escape(text: str) -> str:
    """Slack's mrkdwn escaping: only these three characters are control characters."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def payload_of(event: AlertEvent) -> dict[str, Any]:
    """`text` for notifications and plain clients, `blocks` for the message itself."""
    text = _escape(message_of(event))
    context = f"incident {event.incident_id} · fingerprint {event.fingerprint}"
    if event.generator_url:
        context += f" · <{event.generator_url}|source>"
    return {
        "text": text,
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": text}},
            {"type": "context", "elements": [{"type": "mrkdwn", "text": context}]},
        ],
    }


class SlackNotifier:
    """POSTs to a Slack incoming-webhook URL (the URL is the secret)."""

    def __init__(
        self,
        name: str,
        url: SecretStr,
        client: httpx.AsyncClient,
        *,
        timeout_s: float | None = None,
    ) -> None:
        self.name = name
        self._url = url
        self._client = client
        self._timeout_s = timeout_s  # per request; None: the client's own

    def __repr__(self) -> str:
        shown = redacted_url(self._url.get_secret_value())
        return f"SlackNotifier(name={self.name!r}, url={shown!r})"

    async def send(self, events: Sequence[AlertEvent]) -> None:
        delivered: set[str] = set()
        for event in events:
            await post(
                self._client,
                self.name,
                self._url.get_secret_value(),
                content=json.dumps(payload_of(event)).encode(),
                headers={"Content-Type": "application/json"},
                timeout_s=self._timeout_s,
                dedup_key=event.dedup_key,
                delivered=frozenset(delivered),
                secrets=url_secrets(self._url.get_secret_value(), path_is_secret=True),
            )
            delivered.add(event.dedup_key)
