"""Pushes alerts to a real Alertmanager through `POST /api/v2/alerts`.

Users keep Alertmanager's routing, grouping, silences and inhibition. Alertmanager treats
an alert as resolved once its `endsAt` passes, so a firing alert is sent with `endsAt` =
now + `resend_validity_s` (Prometheus sends now + 4 x its resend delay) and must be sent
again before that: the agent's repeat interval for firing alerts has to stay below
`resend_validity_s` (and below Alertmanager's `resolve_timeout` for any client that omits
`endsAt`). A resolved alert is sent with `endsAt` at its resolution time.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
from pydantic import SecretStr

from kvpilot.agent.model import AlertEvent
from kvpilot.agent.notify.base import post, redacted_url, rfc3339, with_headers
from kvpilot.agent.notify.webhook import INCIDENT_ANNOTATION

# Prometheus: 4 x its default resend delay of 1 min.
DEFAULT_RESEND_VALIDITY_S = 240.0
# Prometheus's notifier sends at most 64 alerts in one request (maxBatchSize).
DEFAULT_BATCH_SIZE = 64


class AlertmanagerNotifier:
    """Sends events as Alertmanager's postable alerts, all of one call in one request (the
    worker batches up to `batch_size` events of many alerts into one call)."""

    def __init__(
        self,
        name: str,
        url: str,
        client: httpx.AsyncClient,
        *,
        resend_validity_s: float = DEFAULT_RESEND_VALIDITY_S,
        username: str | None = None,
        password: SecretStr | None = None,
        bearer_token: SecretStr | None = None,
        headers: Mapping[str, SecretStr | str] | None = None,
        timeout_s: float | None = None,
        clock: Callable[[], float] = time.time,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if resend_validity_s <= 0:
            raise ValueError(f"resend_validity_s must be positive, got {resend_validity_s}")
        if bearer_token is not None and username is not None:
            raise ValueError("give either basic auth (username, password) or a bearer token")
        self.name = name
        self.batch_size = batch_size  # events of many alerts in one request
        self._endpoint = url.rstrip("/") + "/api/v2/alerts"
        self._client = client
        self.resend_validity_s = resend_validity_s
        self._username = username
        self._password = password
        self._bearer_token = bearer_token
        # Extra headers (a tenant, a proxy's token) may be credentials: secrets until the request.
        self._headers = {
            k: v if isinstance(v, SecretStr) else SecretStr(v) for k, v in (headers or {}).items()
        }
        self._timeout_s = timeout_s  # per request; None: the client's own
        self._clock = clock

    def __repr__(self) -> str:
        return f"AlertmanagerNotifier(name={self.name!r}, url={redacted_url(self._endpoint)!r})"

    def postable(self, event: AlertEvent, now_wall_s: float) -> dict[str, Any]:
        """One postable alert; firing ones stay valid for `resend_validity_s` from now."""
        if event.status == "firing":
            ends = now_wall_s + self.resend_validity_s
        else:
            ends = now_wall_s if event.ends_at_wall_s is None else event.ends_at_wall_s
        annotations = dict(event.annotations)
        annotations[INCIDENT_ANNOTATION] = event.incident_id
        alert: dict[str, Any] = {
            "labels": dict(event.labels),
            "annotations": annotations,
            "startsAt": rfc3339(event.starts_at_wall_s),
            "endsAt": rfc3339(max(ends, event.starts_at_wall_s)),
        }
        if event.generator_url:
            alert["generatorURL"] = event.generator_url
        return alert

    def headers_for_push(self) -> dict[str, str]:
        """Every push's headers: the configured ones, the content type, the credentials."""
        ours = {"Content-Type": "application/json"}
        if self._bearer_token is not None:
            ours["Authorization"] = f"Bearer {self._bearer_token.get_secret_value()}"
        elif self._username is not None:
            password = "" if self._password is None else self._password.get_secret_value()
            token = base64.b64encode(f"{self._username}:{password}".encode()).decode()
            ours["Authorization"] = f"Basic {token}"
        return with_headers(self._headers, ours)

    def _secrets(self) -> list[str]:
        """What a receiver's answer must not repeat: the credentials and header values."""
        values = [*self._headers.values(), self._password, self._bearer_token]
        found = [v.get_secret_value() for v in values if v is not None]
        authorization = self.headers_for_push().get("Authorization", "")
        return [*found, authorization.partition(" ")[2]]  # the encoded basic credentials

    async def send(self, events: Sequence[AlertEvent]) -> None:
        if not events:
            return
        now = self._clock()
        body = json.dumps([self.postable(event, now) for event in events]).encode()
        # A rejected batch names no single event; the worker then retries them one by one.
        only = events[0].dedup_key if len(events) == 1 else None
        await post(
            self._client,
            self.name,
            self._endpoint,
            content=body,
            headers=self.headers_for_push(),
            timeout_s=self._timeout_s,
            dedup_key=only,
            secrets=self._secrets(),
        )
