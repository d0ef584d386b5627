"""The agent's HTTP surface: `/metrics` (prometheus-client's ASGI app) and `/healthz`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from prometheus_client import make_asgi_app
from prometheus_client.registry import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send


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

    async def healthz(_: Request) -> JSONResponse:
        last = state.last_tick_at_s
        age_s = None if last is None else clock() - last
        healthy = age_s is not None and age_s <= stale_after_s
        body = {
            "status": "ok" if healthy else "stale",
            "ticks_total": state.ticks_total,
            "last_tick_age_s": age_s,
        }
        return JSONResponse(body, status_code=200 if healthy else 503)

    return Starlette(
        routes=[
            Route("/healthz", healthz),
            # A Route (not a Mount) so that /metrics answers without a redirect to /metrics/;
            # wrapped so that Starlette treats the function as an ASGI app, not a handler.
            Route("/metrics", _AsgiApp(make_asgi_app(registry))),
            *extra_routes,
        ]
    )
