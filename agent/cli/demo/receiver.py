"""The demo's own webhook receiver: a real HTTP server on loopback that checks each body's
HMAC signature the way `agent/notify/signing.py` signs it, and keeps what arrived.

An unsigned or wrongly signed request is answered 401 and kept as unverified, so the view
shows a forgery rather than hiding it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvpilot.agent.app.lifecycle import bind_listener
from kvpilot.agent.app.listener_limits import ListenerLimits, listener_config
from kvpilot.agent.notify.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, verify_signature

MAX_BODY_BYTES = 1024 * 1024
KEEP = 50  # the view shows the last few; the summary counts all


@dataclass(frozen=True, slots=True)
class Delivery:
    """One webhook request as the receiver saw it."""

    wall_s: float
    verified: bool
    status: str  # the payload's "firing" or "resolved"; "?" when the body is not a payload
    alertnames: tuple[str, ...]

    def describe(self) -> str:
        names = ", ".join(self.alertnames) or "?"
        check = "signature verified" if self.verified else "signature INVALID"
        return f"{names} {self.status} ({check})"


def read_delivery(body: bytes, verified: bool, wall_s: float) -> Delivery:
    """What an Alertmanager-style (version 4) webhook body says, never raising on bad input."""
    try:
        payload = json.loads(body)
    except ValueError:
        return Delivery(wall_s, verified, "?", ())
    if not isinstance(payload, dict):
        return Delivery(wall_s, verified, "?", ())
    alerts = payload.get("alerts")
    names: list[str] = []
    for alert in alerts if isinstance(alerts, list) else ():
        labels = alert.get("labels") if isinstance(alert, dict) else None
        name = labels.get("alertname") if isinstance(labels, dict) else None
        if isinstance(name, str) and name not in names:
            names.append(name)
    status = payload.get("status")
    return Delivery(wall_s, verified, status if isinstance(status, str) else "?", tuple(names))


async def _read_capped(request: Request, max_bytes: int) -> bytes | None:
    """The body, or None once it is past `max_bytes`: read as it streams, never whole first."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            return None
    return bytes(body)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the agent owns SIGTERM and SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class WebhookReceiver:
    """Serves POST /alerts on 127.0.0.1 (a free port) while used as an async context."""

    def __init__(
        self,
        secret: str,
        *,
        on_delivery: Callable[[Delivery], None] | None = None,
        clock: Callable[[], float] = time.time,
        limits: ListenerLimits = ListenerLimits(),  # noqa: B008 (frozen, shared safely)
    ) -> None:
        self._secret = secret
        self._on_delivery = on_delivery
        self._clock = clock
        self._sock = bind_listener("127.0.0.1", 0)
        self.port: int = self._sock.getsockname()[1]
        self.deliveries: list[Delivery] = []
        self.received_total = 0
        self.verified_total = 0
        app = Starlette(routes=[Route("/alerts", self._receive, methods=["POST"])])
        self._server = _Server(listener_config(app, limits))
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/alerts"

    async def _receive(self, request: Request) -> Response:
        body = await _read_capped(request, MAX_BODY_BYTES)
        if body is None:
            return Response("too large\n", status_code=413)
        verified = verify_signature(
            self._secret,
            request.headers.get(TIMESTAMP_HEADER, ""),
            body,
            request.headers.get(SIGNATURE_HEADER),
            now=self._clock(),
        )
        delivery = read_delivery(body, verified, self._clock())
        self.received_total += 1
        self.verified_total += verified
        self.deliveries = [*self.deliveries[-(KEEP - 1) :], delivery]
        if self._on_delivery is not None:
            self._on_delivery(delivery)
        if not verified:
            return Response("bad signature\n", status_code=401)
        return Response("ok\n")

    async def __aenter__(self) -> WebhookReceiver:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started and not self._task.done():  # noqa: ASYNC110 (uvicorn has no started event)
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # raise what stopped it
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(self._task, timeout=5.0)
        self._sock.close()
