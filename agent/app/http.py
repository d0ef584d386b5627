"""The agent's HTTP surface: `/metrics` (prometheus-client's ASGI app) and `/healthz`.

Every JSON answer goes through `JsonResponse` (non-finite numbers as null), and a handler
that fails answers a short JSON 500; its traceback goes to the log once, never to the client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from prometheus_client import make_asgi_app
from prometheus_client.registry import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpilot.agent.app.json_render import JsonResponse, error_response

log = logging.getLogger(__name__)


class TickRecord(Protocol):
    """What records the last tick (a TickState, the Sidecar): the two fields read here."""

    @property
    def last_tick_at_s(self) -> float | None: ...

    @property
    def ticks_total(self) -> int: ...


class _AsgiApp:
    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(scope, receive, send)


class _JsonServerErrors:
    """An unexpected error in a handler: a JSON 500, and its traceback logged here once.

    The error is not raised on, so neither Starlette nor uvicorn logs it a second time or
    answers in plain text.
    """

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._app(scope, receive, watched)
        except Exception:
            log.exception("%s %s failed", scope.get("method", "?"), scope.get("path", "?"))
            if not started:  # once the answer has begun, the connection just ends
                answer = error_response(500, "internal error; the agent's log has the details")
                await answer(scope, receive, send)


async def _http_error(_: Request, exc: Exception) -> JsonResponse:
    """Starlette's own refusals (no such path, method not allowed) in JSON too."""
    assert isinstance(exc, HTTPException)
    return JsonResponse({"error": exc.detail}, exc.status_code, headers=exc.headers)


def build_app(
    state: TickRecord,
    registry: CollectorRegistry,
    *,
    clock: Callable[[], float],
    stale_after_s: float,
    extra_routes: Sequence[BaseRoute] = (),
) -> Starlette:
    """`/healthz` is 200 while ticks keep completing, 503 once the last is stale.

    `state` is whatever records the last tick: its `last_tick_at_s` and `ticks_total`.
    """

    async def healthz(_: Request) -> JsonResponse:
        last = state.last_tick_at_s
        age_s = None if last is None else clock() - last
        healthy = age_s is not None and age_s <= stale_after_s
        body = {
            "status": "ok" if healthy else "stale",
            "ticks_total": state.ticks_total,
            "last_tick_age_s": age_s,
        }
        return JsonResponse(body, status_code=200 if healthy else 503)

    return Starlette(
        routes=[
            Route("/healthz", healthz),
            # A Route (not a Mount) so that /metrics answers without a redirect to /metrics/;
            # wrapped so that Starlette treats the function as an ASGI app, not a handler.
            Route("/metrics", _AsgiApp(make_asgi_app(registry))),
            *extra_routes,
        ],
        middleware=[Middleware(_JsonServerErrors)],
        exception_handlers={HTTPException: _http_error},
    )
