"""What one client may hold on a listener kvpilot serves with uvicorn, and the config that
bounds it.

uvicorn bounds the head's size (`h11_max_incomplete_event_size`), the idle time between
requests (`timeout_keep_alive`) and the requests answered at once (`limit_concurrency`), but
not the time a client takes to send its request, and it counts every open connection toward
`limit_concurrency`: a thousand connections sending a byte a second would hold their
descriptors for ever and turn every scrape into a 503. `_GuardedH11` adds the two missing
bounds, below the ASGI app: each request must arrive whole (head and body) within
`request_deadline_s` of the moment the connection started owing it, and at most `max_waiting`
connections may owe one; a new connection pushes the oldest out, so a flood cannot shut out a
client whose request arrives at once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import ClassVar

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

_OWED = (h11.IDLE, h11.SEND_BODY)  # the client still owes (part of) a request


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    """Per listener; the defaults suit Prometheus scraping and a few API calls."""

    request_deadline_s: float = 10.0  # from connect (or the last answer) to the request's end
    max_waiting: int = 64  # connections owing a request; past this the oldest is closed
    max_in_flight: int = 32  # requests answered at once; more are answered 503
    keep_alive_s: int = 5  # idle time between requests on one connection
    max_head_bytes: int = 16 * 1024  # request line and headers together (400 past it)


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline per request and a cap on owing connections."""

    limits: ClassVar[ListenerLimits]
    owing: ClassVar[dict[_GuardedH11, asyncio.TimerHandle]]  # oldest first

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._follow()
        while len(self.owing) > self.limits.max_waiting:
            next(iter(self.owing))._cut_off()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._settle()
        super().connection_lost(exc)

    def _follow(self) -> None:
        """Owing from the moment the client owes a request until it has sent it whole; the
        deadline is armed once per request, so trickling bytes does not extend it."""
        if self.transport.is_closing() or self.conn.their_state not in _OWED:
            self._settle()
        elif self not in self.owing:
            self.owing[self] = self.loop.call_later(self.limits.request_deadline_s, self._cut_off)

    def _settle(self) -> None:
        timer = self.owing.pop(self, None)
        if timer is not None:
            timer.cancel()

    def _cut_off(self) -> None:
        self._settle()
        self.transport.close()


def guarded_protocol(limits: ListenerLimits) -> type[asyncio.Protocol]:
    """A protocol class of its own per listener: the owing connections are counted per
    listener, so a flood on one port does not push out the clients of another."""
    owing: dict[_GuardedH11, asyncio.TimerHandle] = {}
    return type("GuardedH11", (_GuardedH11,), {"limits": limits, "owing": owing})


def listener_config(app: ASGIApp, limits: ListenerLimits = ListenerLimits()) -> uvicorn.Config:
    """uvicorn's Config for one of kvpilot's listeners, every client bound by `limits`."""
    return uvicorn.Config(
        app,
        http=guarded_protocol(limits),
        ws="none",
        log_level="warning",
        access_log=False,
        lifespan="off",
        # Owing connections are capped apart; this bounds the requests being answered.
        limit_concurrency=limits.max_waiting + limits.max_in_flight,
        timeout_keep_alive=limits.keep_alive_s,
        h11_max_incomplete_event_size=limits.max_head_bytes,
    )
