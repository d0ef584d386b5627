"""The notifier interface, its error, and the HTTP POST that every notifier shares."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit

import httpx
from pydantic import SecretStr

from kvpilot.agent.model import AlertEvent
from kvpilot.collectors.secrets import mask_text, url_secrets

# Alertmanager writes a firing alert's unknown end as Go's zero time.
ZERO_TIME = "0001-01-01T00:00:00Z"
# Statuses that say "try again later"; every other 4xx means the request itself is wrong.
RETRYABLE_STATUSES = frozenset({408, 425, 429})
MAX_RETRY_AFTER_S = 3600.0
MAX_ANSWER_BYTES = 64 * 1024  # of a receiver's answer: enough for its error message


class DeliveryError(Exception):
    """A notification did not arrive.

    `retryable` is False when sending the same again cannot succeed (a 4xx other than
    408/425/429, a redirect, a payload the receiver rejects). `delivered` holds the dedup
    keys of the events that did arrive before the failure (notifiers that send one request
    per event); `dedup_key` names the one event the error is about, when it is about one.
    `retry_after_s` is the receiver's own Retry-After, when it sent one.
    """

    def __init__(
        self,
        message: str,
        retryable: bool,
        *,
        delivered: frozenset[str] = frozenset(),
        dedup_key: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable
        self.delivered = delivered
        self.dedup_key = dedup_key
        self.retry_after_s = retry_after_s


@runtime_checkable
class Notifier(Protocol):
    """Sends alert events somewhere; raises `DeliveryError` when they did not arrive."""

    name: str

    async def send(self, events: Sequence[AlertEvent]) -> None: ...


@runtime_checkable
class BatchingNotifier(Notifier, Protocol):
    """A notifier whose receiver takes many events in one request (Alertmanager's
    `POST /api/v2/alerts` takes a list): the worker hands it up to `batch_size` events of
    many alerts at once, instead of one request per alert."""

    batch_size: int


def rfc3339(wall_s: float) -> str:
    """Wall time as RFC 3339 in UTC with milliseconds (the precision of the dedup key)."""
    text = datetime.fromtimestamp(wall_s, UTC).isoformat(timespec="milliseconds")
    return text.replace("+00:00", "Z")


def redacted_url(url: str) -> str:
    """Scheme and host only: paths and queries of webhook URLs often hold tokens."""
    parts = urlsplit(url)
    host = parts.hostname or "?"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}/..."


def with_headers(custom: Mapping[str, SecretStr], ours: Mapping[str, str]) -> dict[str, str]:
    """The configured headers' values, with ours replacing any of the same name (in any case).

    The values may carry credentials: they go into the request only, never into a message.
    """
    taken = {name.lower() for name in ours}
    headers = {k: v.get_secret_value() for k, v in custom.items() if k.lower() not in taken}
    headers.update(ours)
    return headers


def _retry_after_s(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None  # an HTTP date: rare for webhooks; the worker's backoff applies
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


async def post(
    client: httpx.AsyncClient,
    name: str,
    url: str,
    *,
    content: bytes,
    headers: Mapping[str, str],
    timeout_s: float | None = None,
    dedup_key: str | None = None,
    delivered: frozenset[str] = frozenset(),
    secrets: Iterable[str] = (),
) -> None:
    """POST and classify the outcome; messages never carry the URL (it may hold a token),
    and what the receiver or the transport says is masked: the URL's secret parts, the
    notifier's own `secrets` (credentials, header values) and whatever reads as a secret.

    `timeout_s` bounds the whole request (connect, send, answer) in place of the client's own
    timeouts; None keeps the client's. The answer is streamed and at most
    `MAX_ANSWER_BYTES` of it is read: a receiver that answers with gigabytes costs that much.
    """
    known = (*secrets, *url_secrets(url))
    try:
        if timeout_s is None:
            status, answer, retry_after = await _exchange(client, url, content, headers, None)
        else:
            # httpx's timeout applies to each phase; the deadline bounds them together.
            async with asyncio.timeout(timeout_s):
                status, answer, retry_after = await _exchange(
                    client, url, content, headers, timeout_s
                )
    except (httpx.TimeoutException, TimeoutError) as exc:
        after = "" if timeout_s is None else f" after {timeout_s:g} s"
        raise DeliveryError(
            f"{name}: timed out{after} ({type(exc).__name__})",
            True,
            delivered=delivered,
            dedup_key=dedup_key,
        ) from exc
    except httpx.TransportError as exc:
        raise DeliveryError(
            f"{name}: {type(exc).__name__}: {mask_text(str(exc), known)}",
            True,
            delivered=delivered,
            dedup_key=dedup_key,
        ) from exc
    if 200 <= status < 300:
        return
    excerpt = mask_text(answer[:200].decode("utf-8", errors="replace").strip(), known)
    retryable = status >= 500 or status in RETRYABLE_STATUSES
    raise DeliveryError(
        f"{name}: HTTP {status}" + (f": {excerpt}" if excerpt else ""),
        retryable,
        delivered=delivered,
        dedup_key=dedup_key,
        retry_after_s=_retry_after_s(retry_after) if retryable else None,
    )


async def _exchange(
    client: httpx.AsyncClient,
    url: str,
    content: bytes,
    headers: Mapping[str, str],
    timeout_s: float | None,
) -> tuple[int, bytes, str | None]:
    """The status, the first `MAX_ANSWER_BYTES` of the answer and its Retry-After; the rest of
    the answer is never read (leaving the stream early closes the connection)."""
    timeout: float | httpx.Timeout = client.timeout if timeout_s is None else timeout_s
    sent = {**headers, "Accept-Encoding": "identity"}  # the cap bounds what is decoded too
    async with client.stream("POST", url, content=content, headers=sent, timeout=timeout) as r:
        answer = bytearray()
        async for chunk in r.aiter_raw():
            answer += chunk[: MAX_ANSWER_BYTES - len(answer)]
            if len(answer) >= MAX_ANSWER_BYTES:
                break
        return r.status_code, bytes(answer), r.headers.get("retry-after")
