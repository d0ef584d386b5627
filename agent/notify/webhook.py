"""Generic webhook in Alertmanager's webhook payload, version 4, optionally HMAC-signed.

Each event goes in its own request, as Alertmanager sends with `group_by: ['...']`: the
group is the alert's full label set, so `groupKey` is stable per alert and any receiver
written for Alertmanager works unchanged. De-duplication: receivers key on
(`fingerprint`, `startsAt`, `status`); the same key is in the `X-Kvpilot-Dedup-Key` header,
and the incident id is the `kvpilot_incident_id` annotation.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
from pydantic import SecretStr

from kvpilot.agent.model import AlertEvent
from kvpilot.agent.notify.base import ZERO_TIME, post, redacted_url, rfc3339, with_headers
from kvpilot.agent.notify.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign

DEDUP_HEADER = "X-Kvpilot-Dedup-Key"
INCIDENT_ANNOTATION = "kvpilot_incident_id"


def group_key(labels: Mapping[str, str]) -> str:
    """Alertmanager's group key for the root route grouped by every label."""
    inner = ", ".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return "{}:{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def alert_of(event: AlertEvent) -> dict[str, Any]:
    """One entry of `alerts[]` as Alertmanager writes it."""
    annotations = dict(event.annotations)
    annotations[INCIDENT_ANNOTATION] = event.incident_id
    ends = ZERO_TIME if event.ends_at_wall_s is None else rfc3339(event.ends_at_wall_s)
    return {
        "status": event.status,
        "labels": dict(event.labels),
        "annotations": annotations,
        "startsAt": rfc3339(event.starts_at_wall_s),
        "endsAt": ends,
        "generatorURL": event.generator_url,
        "fingerprint": event.fingerprint,
    }


def payload_of(event: AlertEvent, receiver: str, external_url: str) -> dict[str, Any]:
    """The version-4 payload for one event."""
    alert = alert_of(event)
    return {
        "version": "4",
        "groupKey": group_key(alert["labels"]),
        "truncatedAlerts": 0,
        "status": event.status,
        "receiver": receiver,
        "groupLabels": alert["labels"],
        "commonLabels": alert["labels"],
        "commonAnnotations": alert["annotations"],
        "externalURL": external_url,
        "alerts": [alert],
    }


class WebhookNotifier:
    """POSTs Alertmanager's version-4 webhook payload, one request per event."""

    def __init__(
        self,
        name: str,
        url: str,
        client: httpx.AsyncClient,
        *,
        external_url: str = "",
        secret: SecretStr | None = None,
        headers: Mapping[str, SecretStr | str] | None = None,
        timeout_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.name = name
        self._url = url
        self._client = client
        self._timeout_s = timeout_s  # per request; None: the client's own
        self._external_url = external_url
        self._secret = secret
        # Custom headers may carry a bearer token: kept as secrets until the request.
        self._headers = {
            k: v if isinstance(v, SecretStr) else SecretStr(v) for k, v in (headers or {}).items()
        }
        self._clock = clock

    def __repr__(self) -> str:
        signed = "signed" if self._secret is not None else "unsigned"
        return f"WebhookNotifier(name={self.name!r}, url={redacted_url(self._url)!r}, {signed})"

    def headers_for(self, event: AlertEvent, body: bytes) -> dict[str, str]:
        """The request headers: content type, custom ones, dedup key, signature."""
        ours = {"Content-Type": "application/json", DEDUP_HEADER: event.dedup_key}
        if self._secret is not None:
            timestamp = int(self._clock())
            ours[TIMESTAMP_HEADER] = str(timestamp)
            ours[SIGNATURE_HEADER] = sign(self._secret, timestamp, body)
        return with_headers(self._headers, ours)

    def _secrets(self) -> list[str]:
        """What a receiver's answer must not repeat: the header values and the signing key."""
        values = [*self._headers.values(), *([self._secret] if self._secret else [])]
        return [v.get_secret_value() for v in values]

    async def send(self, events: Sequence[AlertEvent]) -> None:
        delivered: set[str] = set()
        for event in events:
            body = json.dumps(payload_of(event, self.name, self._external_url)).encode()
            await post(
                self._client,
                self.name,
                self._url,
                content=body,
                headers=self.headers_for(event, body),
                timeout_s=self._timeout_s,
                dedup_key=event.dedup_key,
                delivered=frozenset(delivered),
                secrets=self._secrets(),
            )
            delivered.add(event.dedup_key)
